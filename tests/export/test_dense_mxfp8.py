"""`--dense-weights mxfp8` (issue #19, item 1): the export quantizes the model's dense matrices to MXFP8 (E4M3, a
scale per 32 inputs), the compiler stores them as one code byte per value plus one scale byte per block and the
kernels decode them as they read them. Built once (k3-tiny, llvm, `export --target` as a user runs it).

Tolerance: both sides hold the same MXFP8 values (eager rebuilt with the same quantization; the kernel's decode is
exact: tests/unit/test_mxfp8_panels.py), so what is left is fp32 arithmetic in other summation orders, the bound
of every fp32 comparison of the TVM path (tests/export/test_tvm.py: ATOL, observed ~1e-6)."""

from __future__ import annotations

import json
import subprocess
import sys

import ml_dtypes
import numpy as np
import pytest
import torch
from hardening import one_line_error, run
from safetensors.numpy import load_file

from k3compile.backends.eager import EagerBackend
from k3compile.backends.tvm import TvmBackend
from k3compile.generate import generate
from k3compile.modes import Forms
from k3compile.quant.dense import dense_matrices, with_dense_weights
from k3compile.quant.mx import E4M3, quantize_mx
from k3compile.source import load_model
from k3compile.verify import compare

ATOL = 1e-4  # fp32 on both sides, other summation orders (see the module docstring)
PROMPTS = [[5, 17, 200, 3, 9, 9, 41], [1, 2], [250, 251, 252, 253]]


@pytest.fixture(scope="module")
def mx_artifact(tmp_path_factory):
    out = tmp_path_factory.mktemp("artifacts") / "k3-tiny-mxfp8"
    r = run("export", "k3-tiny", "--target", "llvm", "--dense-weights", "mxfp8", "-o", out)
    assert r.exit_code == 0, r.output
    assert "mxfp8 matrices" in r.output
    return out, load_model("k3-tiny", seed=0)


def test_the_artifact_stores_each_dense_matrix_as_its_mxfp8_codes_and_scales(mx_artifact):
    """Every dense matrix the kernels multiply by is stored as E4M3 codes [N/64, K, 64] and E8M0 scales
    [N/64, K/32, 64]: decoded by ml_dtypes (an independent E4M3 decoder) times 2^(scale - 127), they are the panels
    of a matrix of the model quantized by quant/mx.py (the OCP rule, bit-exact), and the scales are that rule's."""
    out, model = mx_artifact
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["dense_weights"] == "mxfp8" and set(manifest["dense_matrices"]) == {"mxfp8"}
    assert json.loads((out / "export.json").read_text())["dense_weights"] == "mxfp8"
    stored = load_file(str(out / "weights.safetensors"))
    expected = {}
    for _, lin in dense_matrices(model):
        elems, scales = quantize_mx(lin.weight.detach().float(), E4M3)  # [N, K], [N, K/32]
        n, k = elems.shape
        if n % 64 == 0:
            panels = elems.numpy().reshape(n // 64, 64, k).transpose(0, 2, 1)
            scale_panels = scales.numpy().reshape(n // 64, 64, k // 32).transpose(0, 2, 1)
            expected[(np.ascontiguousarray(scale_panels).tobytes())] = panels
    codes = [w for w in stored.values() if w.dtype == np.uint8 and w.ndim == 3 and w.shape[2] == 64
             and w.shape[1] % 32 == 0]
    pairs = 0
    for c in codes:  # its scales: the uint8 [N/64, K/32, 64] the model's quantization names for these values
        values = c.view(ml_dtypes.float8_e4m3fn).astype(np.float32)
        match = [s for s in stored.values() if s.dtype == np.uint8 and s.shape == (c.shape[0], c.shape[1] // 32, 64)
                 and s.tobytes() in expected and np.array_equal(expected[s.tobytes()], values)]
        pairs += bool(match)
    assert pairs == manifest["dense_matrices"]["mxfp8"] >= 20
    assert not any(w.dtype == np.uint16 for w in stored.values())  # no bf16 matrix left: all of them are MXFP8


def test_the_artifact_equals_eager_with_the_same_weights(mx_artifact):
    """Every output at prefill and three decode steps within ATOL of eager holding the same MXFP8 values, and the
    same 32 greedy tokens for a left-padded batch; eager with the source's (bf16) values is far off, so the bound
    tells the formats apart."""
    out, model = mx_artifact
    backend = TvmBackend(out)
    quantized = with_dense_weights(model, "mxfp8")
    rows = compare(EagerBackend(quantized, Forms.exported()), backend, decode_steps=3, prompts=PROMPTS)
    bad = [r for r in rows if not r["max_abs"] <= ATOL]
    assert not bad, bad[:3]
    assert {r["output"] for r in rows} >= {"logits", "present.0.recurrent_state", "present.6.latent"}
    assert generate(backend, PROMPTS, 32).tokens == generate(EagerBackend(quantized), PROMPTS, 32).tokens
    source = compare(EagerBackend(model, Forms.exported()), backend, decode_steps=0, prompts=PROMPTS)
    assert max(r["max_abs"] for r in source if r["output"] == "logits") > 100 * ATOL


def test_verify_in_a_fresh_process_rebuilds_eager_quantized(mx_artifact):
    """`verify OUT` rebuilds eager from the record (quantized as the export was) in its own process."""
    out, _ = mx_artifact
    r = subprocess.run([sys.executable, "-m", "k3compile.cli", "verify", str(out), "--json", "--quiet"],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    rows = json.loads(r.stdout)["rows"]
    assert {row["backend"] for row in rows} == {"onnxruntime", "tvm-llvm"}
    assert all(row["max_abs"] <= ATOL for row in rows)


def test_mxfp8_refusals(tmp_path, tiny_export):
    """mxfp8 needs an export quantized so (the compiler never chooses the values), a CPU target, no mesh."""
    from k3compile.targets import resolve

    from k3compile.compile import dense_target
    from k3compile.interface import ExportError

    _, folder, _ = tiny_export
    one_line_error(run("compile", folder, "-o", tmp_path / "no", "--dense-weights", "mxfp8"),
                   "this export holds the source's dense weights")
    assert not (tmp_path / "no").exists()
    with pytest.raises(ExportError, match="target 'opencl' reads its dense weights as fp32"):
        dense_target(resolve("opencl"), [], [], "mxfp8")
    r = run("export", "k3-tiny", "--mesh", "ep=2", "--dense-weights", "mxfp8", "-o", tmp_path / "mesh")
    assert r.exit_code != 0 and "does not apply to --mesh" in r.output and not (tmp_path / "mesh").exists()
    r = run("export", "k3-tiny", "--dense-weights", "bf16", "-o", tmp_path / "onnx")
    assert r.exit_code != 0 and "give --target" in r.output and not (tmp_path / "onnx").exists()


def test_with_dense_weights_quantizes_a_copy():
    model = load_model("k3-tiny", seed=0)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    quantized = with_dense_weights(model, "mxfp8")
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())  # the input is untouched
    names = {f"{n}.weight" for n, _ in dense_matrices(model)}
    after = quantized.state_dict()
    changed = {k for k in before if not torch.equal(before[k], after[k])}
    assert changed and changed <= names  # only dense matrices change (router, norms, embedding, experts do not)
    assert not any(".gate.weight" in k or "embed" in k or "norm" in k for k in changed)
    assert with_dense_weights(model, "source") is model
    with pytest.raises(ValueError, match="dense weights"):
        with_dense_weights(model, "fp16")


def test_the_artifact_carries_its_tokenizer(mx_artifact, tmp_path):
    """The export writes the source's tokenizer files (hashed in export.json), the compile copies them (hashed in the
    manifest), and text runs through the copy: the preset's tokenizer, byte for byte; a changed copy, or a record
    naming another file, is one error line (issue #20 item 1)."""
    import shutil

    from k3compile.presets import load_config
    from k3compile.source import tokenizer_for

    out, _ = mx_artifact
    record = json.loads((out / "export.json").read_text())["tokenizer"]
    manifest = json.loads((out / "manifest.json").read_text())
    preset = tokenizer_for("k3-tiny", load_config("k3-tiny"))
    assert set(record) == set(preset.files) and all(manifest["files"][n] == d for n, d in record.items())
    assert all((out / n).read_bytes() == data for n, data in preset.files.items())
    r = run("generate", out, "--prompt", "hello", "--max-new-tokens", "3", "--json", "--quiet")
    assert r.exit_code == 0, r.output
    assert json.loads(r.output)["prompts"] == [preset.encode("hello")]
    copy = tmp_path / "copy"
    shutil.copytree(out, copy)
    with open(copy / "tokenizer.json", "a") as f:
        f.write(" ")
    one_line_error(run("generate", copy, "--backend", "eager", "--prompt", "hello"), "changed since the export")
    doc = json.loads((copy / "export.json").read_text())
    doc["tokenizer"] = {"../evil.json": "0" * 64}
    (copy / "export.json").write_text(json.dumps(doc))
    one_line_error(run("generate", copy, "--backend", "eager", "--prompt", "hello"), "tokenizer")
