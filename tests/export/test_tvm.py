"""The TVM path so far (issue #8, first steps): the export imported into Relax with symbolic dims, its k3 nodes
lowered to TIR kernels (tests/unit/test_kernels.py), compiled for llvm, equal to eager. For k3-tiny nothing runs
outside TVM; the one-node tests below run the converters through the ops' reference implementations.
The k3-tiny graph is compiled once per test session (~15 s)."""

from __future__ import annotations

import json

import numpy as np
import onnx
import pytest
import torch
import tvm
from hardening import examples, one_line_error, run
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from onnx import TensorProto, helper

from k3compile.backends.eager import EagerBackend
from k3compile.backends.tvm import TvmBackend
from k3compile.frontend import k3_frontend, to_relax
from k3compile.generate import generate
from k3compile.interface import ExportError
from k3compile.modes import Forms
from k3compile.ops import register_tvm_references
from k3compile.ops.latent_moe_dispatch import latent_moe_dispatch
from k3compile.ops.mxfp4_matmul import mxfp4_matmul
from k3compile.ops.onnx_body import ACT_QUANT_CODES, ACTIVATION_CODES
from k3compile.quant.mx import quantize_mxfp4
from k3compile.verify import compare

# fp32 on both sides; TVM's kernels for the standard ops sum in other orders than torch (observed ~2e-6).
ATOL = 1e-4
PROMPTS = [[5, 17, 200, 3, 9, 9, 41], [1, 2], [250, 251, 252, 253]]


@pytest.fixture(scope="session")
def tvm_tiny(tiny_export):
    model, folder, _ = tiny_export
    return model, TvmBackend(folder)


def _calls(mod, symbol: str) -> int:
    return str(mod["main"]).count(f'R.call_dps_packed("{symbol}"')


def test_relax_module_keeps_dims_symbolic_and_k3_nodes_as_calls(tvm_tiny):
    model, backend = tvm_tiny
    cfg = model.config
    main = backend.mod["main"]
    params = {p.name: str(p.ty) for p in main.params}
    assert "(batch, seq)" in params["input_ids"] and "(batch, past + seq)" in params["attention_mask"]
    assert f"(batch, past, {cfg.kv_lora_rank})" in params["past_3_latent"]  # layer 3 is MLA: its cache grows
    assert "(batch, 2, 16, 16)" in params["past_0_recurrent_state"]  # KDA: fixed-size state
    # every k3 node is lowered to its TIR kernel (one PrimFunc per size set): no extern call is left
    main = str(backend.mod["main"])
    assert "call_dps_packed" not in main
    assert main.count("R.call_tir(k3_kda_recurrence_2_16_16,") == len(cfg.kda_layers)
    assert main.count("R.call_tir(k3_latent_moe_dispatch_mxfp4_8_32_32_0_situ_4p0_25p0_none,") == \
        cfg.num_hidden_layers - cfg.first_k_dense_replace


def test_tvm_equals_eager_prefill_and_decode(tvm_tiny):
    model, backend = tvm_tiny
    rows = compare(EagerBackend(model, Forms.exported()), backend, decode_steps=3, prompts=PROMPTS)
    bad = [r for r in rows if not r["max_abs"] <= ATOL]  # a NaN row fails too
    assert not bad, bad[:3]
    assert {r["output"] for r in rows} >= {"logits", "present.0.recurrent_state", "present.6.k_rope"}


def test_32_greedy_tokens_identical_left_padded_batch(tvm_tiny):
    model, backend = tvm_tiny
    assert generate(backend, PROMPTS, 32).tokens == generate(EagerBackend(model), PROMPTS, 32).tokens


def test_generate_with_the_tvm_backend(tiny_export):
    _, folder, _ = tiny_export
    r = run("generate", folder, "--backend", "tvm", "--prompt-ids", "4,5,6", "--prompt-ids", "9",
            "--max-new-tokens", "6", "--json", "--quiet")
    assert r.exit_code == 0, r.output
    r_eager = run("generate", "--prompt-ids", "4,5,6", "--prompt-ids", "9", "--max-new-tokens", "6", "--json")
    assert json.loads(r.output)["tokens"] == json.loads(r_eager.output)["tokens"]


def test_cache_keys_differ_with_what_determines_the_build(tmp_path):
    from k3compile.cache import entry_key
    from k3compile.source import record

    base = entry_key("artifact", record("k3-tiny", 0, "auto"), {"target": "llvm"})
    assert base == entry_key("artifact", record("k3-tiny", 0, "auto"), {"target": "llvm"})
    assert base != entry_key("artifact", record("k3-tiny", 5, "auto"), {"target": "llvm"})  # other weights
    assert base != entry_key("artifact", record("k3-tiny", 0, "float"), {"target": "llvm"})
    assert base != entry_key("artifact", record("k3-tiny", 0, "auto"), {"target": "other"})
    cfg = tmp_path / "config.json"
    cfg.write_text("{}")
    one = entry_key("export", record(str(cfg), 0, "auto"), {})
    cfg.write_text('{"vocab_size": 300}')  # the same path, edited: another entry
    assert one != entry_key("export", record(str(cfg), 0, "auto"), {})


def test_unknown_target_is_refused(tiny_export):
    with pytest.raises(ExportError, match="target 'vulkan'"):
        TvmBackend(tiny_export[1], target="vulkan")


# ---- one node at a time: each k3 converter, and the importer fixes ------------------------------------------------

def _run(model: onnx.ModelProto, feeds: list[np.ndarray]) -> list[np.ndarray]:
    import tvm
    from tvm import relax

    register_tvm_references()
    vm = relax.VirtualMachine(tvm.compile(to_relax(model), target="llvm"), tvm.cpu())
    out = vm["main"](*(tvm.runtime.tensor(x) for x in feeds))
    return [out.numpy()] if hasattr(out, "numpy") else [o.numpy() for o in out]  # one tensor, or a tuple


def _vi(name, dtype, shape):
    return helper.make_tensor_value_info(name, dtype, shape)


def _model(nodes, inputs, outputs):
    graph = helper.make_graph(nodes, "g", inputs, outputs)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 23), helper.make_opsetid("k3", 1)])


def test_mxfp4_matmul_converter():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(3, 64, generator=gen)
    packed, scale = quantize_mxfp4(torch.randn(5, 64, generator=gen))
    node = helper.make_node("MXFP4MatMul", ["x", "p", "s"], ["y"], domain="k3", act_quant=ACT_QUANT_CODES["e4m3"])
    m = _model([node], [_vi("x", TensorProto.FLOAT, [3, 64]), _vi("p", TensorProto.UINT8, [5, 32]),
                        _vi("s", TensorProto.UINT8, [5, 2])], [_vi("y", TensorProto.FLOAT, [3, 5])])
    (got,) = _run(m, [x.numpy(), packed.numpy(), scale.numpy()])
    assert np.array_equal(got, mxfp4_matmul(x, packed, scale, "e4m3").numpy())  # the same op, run through TVM


@pytest.mark.parametrize("mxfp4", [False, True])
def test_latent_moe_dispatch_converter_passes_every_attribute(mxfp4):
    gen = torch.Generator().manual_seed(1)
    n, d, i, e, k = 4, 32, 32, 3, 2
    z = torch.randn(n, d, generator=gen)
    idx = torch.randint(0, 5, (n, k), generator=gen)  # experts 3, 4 fall outside the slice [2, 5) ... partly
    w = torch.rand(n, k, generator=gen)
    w13, w2 = torch.randn(e, 2 * i, d, generator=gen) * 0.1, torch.randn(e, d, i, generator=gen) * 0.1
    attrs = dict(expert_offset=2, activation=ACTIVATION_CODES["silu"], situ_beta=3.0, situ_linear_beta=20.0,
                 act_quant=ACT_QUANT_CODES["e5m2"])
    if mxfp4:
        (w13, s13), (w2, s2) = quantize_mxfp4(w13), quantize_mxfp4(w2)
        tensors = {"z": z, "idx": idx, "w": w, "w13": w13, "w2": w2, "s13": s13, "s2": s2}
    else:
        tensors = {"z": z, "idx": idx, "w": w, "w13": w13, "w2": w2}
    types = {torch.float32: TensorProto.FLOAT, torch.int64: TensorProto.INT64, torch.uint8: TensorProto.UINT8}
    node = helper.make_node("LatentMoEDispatchMXFP4" if mxfp4 else "LatentMoEDispatch", list(tensors), ["y"],
                            domain="k3", **attrs)
    m = _model([node], [_vi(k_, types[t.dtype], list(t.shape)) for k_, t in tensors.items()],
               [_vi("y", TensorProto.FLOAT, [n, d])])
    (got,) = _run(m, [t.numpy() for t in tensors.values()])
    scales = (tensors["s13"], tensors["s2"]) if mxfp4 else (None, None)
    want = latent_moe_dispatch(z, idx, w, tensors["w13"], tensors["w2"], *scales, 2, "silu", 3.0, 20.0, "e5m2")
    assert np.array_equal(got, want.numpy())


def _shape_slice_model():
    """y = x[:, S - 1:, :] with S = x's symbolic second dim, written as torch.export writes it: Shape -> Squeeze ->
    Sub -> Reshape for the start, INT64_MAX for the end."""
    nodes = [
        helper.make_node("Shape", ["x"], ["s"], start=1, end=2),
        helper.make_node("Squeeze", ["s"], ["n"]),
        helper.make_node("Constant", [], ["one"], value=helper.make_tensor("one", TensorProto.INT64, [], [1])),
        helper.make_node("Sub", ["n", "one"], ["start0"]),
        helper.make_node("Constant", [], ["flat"], value=helper.make_tensor("flat", TensorProto.INT64, [1], [-1])),
        helper.make_node("Reshape", ["start0", "flat"], ["start"]),
        helper.make_node("Constant", [], ["end"], value=helper.make_tensor("end", TensorProto.INT64, [1],
                                                                            [2**63 - 1])),
        helper.make_node("Constant", [], ["axis"], value=helper.make_tensor("axis", TensorProto.INT64, [1], [1])),
        helper.make_node("Constant", [], ["step"], value=helper.make_tensor("step", TensorProto.INT64, [1], [1])),
        helper.make_node("Slice", ["x", "start", "end", "axis", "step"], ["y0"]),  # torch.export writes all five
        helper.make_node("Reshape", ["y0", "shape"], ["y"]),  # needs y0's shape known: [B, 1, 4] -> [B, 4]
    ]
    shape = helper.make_tensor("shape", TensorProto.INT64, [2], [0, 4])
    graph = helper.make_graph(nodes, "g", [_vi("x", TensorProto.FLOAT, ["B", "S", 4])],
                              [_vi("y", TensorProto.FLOAT, ["B", 4])], initializer=[shape])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 23)])


def test_importer_fixes_keep_a_shape_computed_slice_symbolic():
    x = np.arange(2 * 5 * 4, dtype=np.float32).reshape(2, 5, 4)
    (got,) = _run(_shape_slice_model(), [x])
    assert np.array_equal(got, x[:, -1, :])
    import tvm
    from tvm.relax.frontend.onnx import from_onnx

    with pytest.raises(tvm.error.InternalError):  # the stock 0.27 importer fails on this graph: the fixes are needed
        from_onnx(_shape_slice_model())
    with k3_frontend():  # and the patch is scoped: inside it the same call works
        assert isinstance(from_onnx(_shape_slice_model()), tvm.IRModule)


# ---- the compiled artifact ----------------------------------------------------------------------------------------

def test_artifact_holds_what_the_manifest_lists(tvm_artifact):
    from k3compile.interface import sha256_file
    from k3compile.manifest import read_manifest

    manifest, out = tvm_artifact
    assert set(manifest["files"]) >= {"model.so", "weights.safetensors", "model.onnx", "config.json", "export.json"}
    assert all(sha256_file(out / name) == digest for name, digest in manifest["files"].items())
    assert read_manifest(out) == manifest and manifest["target"] == "llvm" and len(manifest["params"]) > 100


def test_the_experts_are_stored_in_column_tiles_and_named_in_the_manifest(tiny_export, tvm_artifact):
    """Every uint8 weight of the artifact is one of the model's packed MXFP4 expert arrays (codes or scales) in the
    CPU kernel's column tiles (kernels/moe.py: expert_tiles, written here as its definition), and the manifest's
    `expert_params` (bench's roofline) names exactly those, under the names the weights file gives them."""
    from safetensors.numpy import load_file

    manifest, out = tvm_artifact
    stored = load_file(str(out / "weights.safetensors"))
    packed = {}
    for name, p in tiny_export[0].state_dict().items():
        if p.dtype == torch.uint8 and p.dim() == 3:
            e, rows, cols = p.shape
            t = next(t for t in (64, 32, 16, 8, 4, 2, 1) if rows % t == 0)
            tiles = p.numpy().reshape(e, rows // t, t, cols).transpose(0, 1, 3, 2)  # [E, rows/t, cols, t]
            packed[np.ascontiguousarray(tiles).tobytes()] = name
    experts = {n for n, w in stored.items() if w.dtype == np.uint8}
    assert experts and all(stored[n].tobytes() in packed for n in experts)
    assert sorted(manifest["expert_params"]) == sorted(experts)


def test_dense_matrices_are_stored_as_the_model_holds_them_in_bf16(tiny_export, tvm_artifact):
    """A preset holds bf16 values (as K3 ships), so `auto` stores its matrices' bf16 bits: every uint16 weight of
    the artifact is one of the model's 2-D weights, re-laid in [N/64, K, 64] panels, with exactly the upper 16 bits
    of its fp32 values (torch's own bf16 of them: the cut is exact)."""
    from safetensors.numpy import load_file

    manifest, out = tvm_artifact
    assert manifest["dense_weights"] == "bf16"
    stored = [w for w in load_file(str(out / "weights.safetensors")).values() if w.dtype == np.uint16]
    model = tiny_export[0]
    matrices = {}
    for name, p in model.state_dict().items():
        if p.dim() == 2 and p.dtype == torch.float32:
            for m in (p, p.t()):  # a Linear's [N, K] as the exporter's [K, N]
                bits = m.contiguous().to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
                k, n = bits.shape
                if n % 64 == 0:
                    matrices.setdefault(bits.tobytes(), name)  # keyed by content: a relayout below must match
                    panels = bits.reshape(k, n // 64, 64).transpose(1, 0, 2)
                    matrices.setdefault(np.ascontiguousarray(panels).tobytes(), name)
    assert len(stored) >= 10
    assert all(w.tobytes() in matrices for w in stored), "a uint16 weight that is no model matrix's bf16 panels"


def test_artifact_equals_eager(tiny_export, tvm_artifact):
    model = tiny_export[0]
    backend = TvmBackend(tvm_artifact[1])  # loaded, not compiled: the weights come from weights.safetensors
    rows = compare(EagerBackend(model, Forms.exported()), backend, decode_steps=2, prompts=PROMPTS)
    assert all(r["max_abs"] <= ATOL for r in rows), [r for r in rows if not r["max_abs"] <= ATOL][:3]
    assert generate(backend, PROMPTS, 16).tokens == generate(EagerBackend(model), PROMPTS, 16).tokens


@pytest.fixture(scope="module")
def fp32_dense_artifact(tiny_export, tmp_path_factory):
    """tiny_export compiled for llvm with `--dense-weights fp32` and no decode library: (manifest, folder). Its
    fp32 panels are the ones whose prefill rows call the host GEMM on every CPU."""
    from k3compile.compile import compile_export

    out = tmp_path_factory.mktemp("fp32-dense") / "art"
    return compile_export(tiny_export[1], out, dense="fp32", decode_library=False), out


def _host_gemm_rows(backend, prompts, model):
    """compare() of eager and `backend` on `prompts` (2 decode steps), and the row counts of the host GEMM's calls
    meanwhile (counted inside the module: a kernel keeps the function it first found)."""
    from k3compile import host_gemm

    rows = []
    columns = host_gemm._columns

    def counting(a, w, y, g0, g1):
        if g0 == 0:
            rows.append(a.shape[0])
        columns(a, w, y, g0, g1)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(host_gemm, "_columns", counting)
        got = compare(EagerBackend(model, Forms.exported()), backend, decode_steps=2, prompts=prompts)
    return got, rows


def test_prefill_rows_go_through_the_host_gemm_and_equal_eager(tiny_export, fp32_dense_artifact):
    """From HOST_GEMM_ROWS rows (batch x tokens) on, the dense matmuls over fp32 panels call the host GEMM
    (k3compile/host_gemm.py), loaded from the written folder; a left-padded batch of two prompts past it (and the
    decode steps after, below it) equals eager within ATOL, and the manifest says which kernels call it."""
    from k3compile.targets.llvm import HOST_GEMM, HOST_GEMM_ROWS

    manifest, out = fp32_dense_artifact
    assert manifest["host_gemm"]["function"] == HOST_GEMM and manifest["host_gemm"]["kernels"] >= 5
    long = [(7 * i) % 250 + 3 for i in range(HOST_GEMM_ROWS // 2 + 5)]
    got, rows = _host_gemm_rows(TvmBackend(out), [long, long[:9]], tiny_export[0])
    assert rows and all(r >= HOST_GEMM_ROWS for r in rows)
    assert all(r["max_abs"] <= ATOL for r in got), [r for r in got if not r["max_abs"] <= ATOL][:3]


def test_the_exact_build_calls_the_fp32_gemm_at_every_row_count(tiny_export, tvm_artifact):
    """On an AVX-512 CPU the default (exact) build's matmuls over bf16 panels call targets/bf16_gemm.c's fp32 GEMM
    (Target.with_f32_gemm; its bits are the loops': tests/unit/test_f32_gemm.py), linked into both libraries, and
    never the host GEMM: a left-padded batch of two prompts past HOST_GEMM_ROWS rows, its decode steps and the
    decode library's batch-1 step equal eager within ATOL with no host GEMM call, in a process without torch too."""
    from k3compile.targets import resolve
    from k3compile.targets.llvm import F32_GEMM, F32_GEMM_FEATURES, HOST_GEMM, HOST_GEMM_ROWS

    if not all(map(resolve("llvm").has_feature, F32_GEMM_FEATURES)):
        pytest.skip("this CPU has no AVX-512: exact builds keep TVM's loops and the host GEMM")
    manifest, out = tvm_artifact
    assert manifest["fp32_gemm"]["function"] == F32_GEMM and manifest["fp32_gemm"]["kernels"] >= 5
    assert "host_gemm" not in manifest and "matmul_precision" not in manifest
    assert all(F32_GEMM.encode() in (out / lib).read_bytes() for lib in ("model.so", "decode.so"))
    assert HOST_GEMM.encode() not in (out / "model.so").read_bytes()
    long = [(7 * i) % 250 + 3 for i in range(HOST_GEMM_ROWS // 2 + 5)]
    backend = TvmBackend(out)
    for prompts in ([long, long[:9]], PROMPTS[:1]):  # past the host GEMM's rows; one prompt: the decode library
        got, rows = _host_gemm_rows(backend, prompts, tiny_export[0])
        assert not rows
        assert all(r["max_abs"] <= ATOL for r in got), [r for r in got if not r["max_abs"] <= ATOL][:3]
    tokens = generate(EagerBackend(tiny_export[0]), PROMPTS, 8).tokens
    ids = [a for p in PROMPTS for a in ("--prompt-ids", ",".join(map(str, p)))]
    doc = _generate_without_torch(out, *ids, "--max-new-tokens", 8)
    assert doc["runtime"] == "torch-free" and doc["tokens"] == tokens


def test_no_host_gemm_builds_a_library_a_plain_tvm_runtime_runs_whole(tiny_export, fp32_dense_artifact, tmp_path):
    """`compile --no-host-gemm` (on fp32 panels, which call the host GEMM otherwise): no kernel names k3compile's
    host GEMM (the same build's library without the flag does, which is what makes the check able to fail), the
    manifest has no host_gemm record, and a prefill past HOST_GEMM_ROWS rows runs the kernels' own loops and equals
    eager within ATOL; a GPU target refuses the flag."""
    from k3compile.targets.llvm import HOST_GEMM, HOST_GEMM_ROWS

    out = tmp_path / "plain"
    res = run("compile", tiny_export[1], "-o", out, "--no-host-gemm", "--no-decode-library", "--dense-weights",
              "fp32", "--json", "--quiet")
    assert res.exit_code == 0, res.output
    manifest = json.loads(res.stdout)
    assert "host_gemm" not in manifest and "host_gemm" in fp32_dense_artifact[0]
    assert HOST_GEMM.encode() in (fp32_dense_artifact[1] / "model.so").read_bytes()
    assert HOST_GEMM.encode() not in (out / "model.so").read_bytes()
    long = [(5 * i) % 250 + 3 for i in range(HOST_GEMM_ROWS + 9)]
    got = compare(EagerBackend(tiny_export[0], Forms.exported()), TvmBackend(out), decode_steps=1, prompts=[long])
    assert all(r["max_abs"] <= ATOL for r in got), [r for r in got if not r["max_abs"] <= ATOL][:3]
    one_line_error(run("compile", tiny_export[1], "-o", tmp_path / "gpu", "--target", "opencl", "--no-host-gemm"),
                   "--no-host-gemm applies to the CPU")


def _bf16_inputs_eager(model):
    """Eager with the input of every dense Linear whose weight holds bf16 values rounded to bf16 by torch (an
    independent rounding): the precision `--matmul-precision bf16` asks."""
    def rounded(module, args):
        return (args[0].bfloat16().float(), *args[1:])

    for module in model.modules():
        if isinstance(module, torch.nn.Linear) and torch.equal(module.weight, module.weight.bfloat16().float()):
            module.register_forward_pre_hook(rounded)
    return EagerBackend(model, Forms.exported())


def test_bf16_matmul_precision_rounds_the_dense_activations(tiny_export, tmp_path):
    """`compile --matmul-precision bf16` (targets/bf16_gemm.c linked into both libraries): the manifest records the
    kernels that call it and each library carries the C function. At every row count the dense matmuls multiply
    bf16-rounded activations: prefill, each decode step of a left-padded batch, and the decode library's batch-1
    step. Bound: eager whose dense Linear inputs torch rounds to bf16 deviates from plain eager by E on the same
    prompts; the artifact deviates from eager by more than ATOL (the rounding took effect) and by at most 2E (the
    same rounding, at the packed matmuls only, summed in another order), and its 16 greedy tokens are eager's, in a
    process without torch too. A GPU target refuses the option, and so does --tune. A CPU without AVX512_BF16 (an
    AMD EPYC of this kind of machine) refuses it in one line and writes nothing; the rest needs the instruction."""
    import copy

    from k3compile.targets import resolve
    from k3compile.targets.llvm import BF16_GEMM, BF16_GEMM_FEATURE

    out = tmp_path / "bf16"
    if not resolve("llvm").has_feature(BF16_GEMM_FEATURE):
        one_line_error(run("compile", tiny_export[1], "-o", out, "--matmul-precision", "bf16"),
                       "needs a CPU with AVX512_BF16")
        assert not out.exists()
        pytest.skip("this CPU has no AVX512_BF16: --matmul-precision bf16 is refused on it")
    res = run("compile", tiny_export[1], "-o", out, "--matmul-precision", "bf16", "--json", "--quiet")
    assert res.exit_code == 0, res.output
    record = json.loads(res.stdout)["matmul_precision"]
    assert record["precision"] == "bf16" and record["function"] == BF16_GEMM and record["kernels"] >= 5
    assert record["min_rows"] == 1
    assert all(BF16_GEMM.encode() in (out / lib).read_bytes() for lib in ("model.so", "decode.so"))
    backend, model = TvmBackend(out), tiny_export[0]
    prompts = [*PROMPTS, [(7 * i) % 250 + 3 for i in range(40)]]  # 40 rows: several 6-row passes, rounded in parallel
    for batch in (prompts, prompts[:1]):  # a batch, and one prompt: the decode library's step
        reference = max(r["max_abs"] for r in compare(EagerBackend(model, Forms.exported()),
                                                      _bf16_inputs_eager(copy.deepcopy(model)), prompts=batch,
                                                      decode_steps=2))
        got = max(r["max_abs"] for r in compare(EagerBackend(model, Forms.exported()), backend, prompts=batch,
                                                decode_steps=2))
        assert ATOL < got <= 2 * reference, (len(batch), got, reference)
    tokens = generate(EagerBackend(model), prompts, 16).tokens
    assert generate(backend, prompts, 16).tokens == tokens
    assert generate(backend, prompts[:1], 16).tokens == generate(EagerBackend(model), prompts[:1], 16).tokens
    ids = [a for p in prompts for a in ("--prompt-ids", ",".join(map(str, p)))]
    doc = _generate_without_torch(out, *ids, "--max-new-tokens", 16)
    assert doc["runtime"] == "torch-free" and doc["tokens"] == tokens
    one_line_error(run("compile", tiny_export[1], "-o", tmp_path / "gpu", "--target", "opencl", "--matmul-precision",
                       "bf16"), "applies to the CPU")
    one_line_error(run("compile", tiny_export[1], "-o", tmp_path / "tuned", "--tune", "4", "--matmul-precision",
                       "bf16"), "meta_schedule cannot build")
    assert not (tmp_path / "tuned").exists()


@pytest.mark.parametrize("damage,msg", [
    (lambda d: (d / "weights.safetensors").write_bytes((d / "weights.safetensors").read_bytes()[:-1] + b"\x00"),
     "sha256 differs"),
    (lambda d: (d / "model.so").unlink(), "missing"),
    (lambda d: (d / "manifest.json").write_text('{"kind": "tvm-executable"}'), "not a k3compile tvm-executable"),
    (lambda d: (d / "manifest.json").write_text("{"), "unreadable"),
])
def test_tampered_artifact_is_one_line(tmp_path, tvm_artifact, damage, msg):
    import shutil

    folder = tmp_path / "art"
    shutil.copytree(tvm_artifact[1], folder)
    damage(folder)
    with pytest.raises(ExportError, match=msg):
        TvmBackend(folder)
    one_line_error(run("generate", folder, "--backend", "tvm"), msg)


def test_compile_command_refuses_bad_requests(tmp_path, tiny_export):
    folder = tiny_export[1]
    one_line_error(run("compile", folder, "-o", tmp_path / "x", "--target", "vulkan"), "target 'vulkan'")
    one_line_error(run("compile", folder, "-o", folder, "--overwrite"), "is the source")
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "mine.txt").write_text("keep")
    one_line_error(run("compile", folder, "-o", tmp_path / "busy"), "exists and is not empty")
    one_line_error(run("compile", folder, "-o", tmp_path / "z", "--dump-ir", tmp_path / "busy"),
                   "--dump-ir needs a new or empty folder")
    assert (tmp_path / "busy" / "mine.txt").read_text() == "keep" and not (tmp_path / "z").exists()
    one_line_error(run("compile", tmp_path / "busy", "-o", tmp_path / "y"), "not an export folder")
    assert (tmp_path / "busy" / "mine.txt").read_text() == "keep"
    assert not (tmp_path / "x").exists() and not (tmp_path / "y").exists()


MANIFEST_KEYS = ["k3compile", "kind", "target", "params", "files", "interface", "tuning", "host", "entry_points"]
JSON = st.none() | st.booleans() | st.integers(-2, 2**65) | st.text(max_size=6) \
    | st.lists(st.text(max_size=4), max_size=2) \
    | st.dictionaries(st.text(max_size=8), st.text(max_size=8), max_size=2) \
    | st.fixed_dictionaries({"library": st.lists(st.text(max_size=3), max_size=2) | st.sampled_from(
        ["model.so", "decode.so", "../x"])})  # compile --tune's entry


@settings(max_examples=examples(15), deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(key=st.sampled_from(MANIFEST_KEYS), value=JSON, drop=st.booleans())
def test_any_manifest_edit_loads_or_is_one_error(tmp_path_factory, tvm_artifact, key, value, drop):
    """The manifest reader never lets anything but an ExportError out, and never loads a library it did not check."""
    import shutil

    folder = tmp_path_factory.mktemp("man") / "art"
    shutil.copytree(tvm_artifact[1], folder)
    doc = json.loads((folder / "manifest.json").read_text())
    if drop:
        doc.pop(key, None)
    else:
        doc[key] = value
    (folder / "manifest.json").write_text(json.dumps(doc))
    from k3compile.lean import LeanArtifact

    for load in (TvmBackend, LeanArtifact):
        try:
            load(folder)
        except ExportError:
            pass


# ---- the torch-free decode (k3compile/lean.py) -----------------------------------------------------------------------

# A process where importing torch fails (a None entry in sys.modules): what runs there needs no torch.
NO_TORCH = ("import sys\nsys.modules['torch'] = None\nfrom k3compile.cli import main\n"
            "main(sys.argv[1:], prog_name='k3compile')\n")


def _generate_without_torch(*args) -> dict:
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-c", NO_TORCH, "generate", *map(str, args), "--json", "--quiet"],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-2000:]
    return json.loads(r.stdout)


def test_generate_on_an_artifact_runs_without_torch_and_equals_eager(tiny_export, tvm_artifact):
    """`generate ARTIFACT`, greedy, in a process that cannot import torch: eager's tokens for a left-padded batch
    (main_inplace_last) and for one prompt in prefill chunks of 2 followed by decode.so's batch-1 steps. Exact
    tokens: the same library as TvmBackend, whose logits equal eager's within ATOL (test_artifact_equals_eager)."""
    model = tiny_export[0]
    ids = [a for p in PROMPTS for a in ("--prompt-ids", ",".join(map(str, p)))]
    doc = _generate_without_torch(tvm_artifact[1], *ids, "--max-new-tokens", 16)
    assert doc["runtime"] == "torch-free" and doc["backend"] == "tvm-llvm"
    assert doc["tokens"] == generate(EagerBackend(model), PROMPTS, 16).tokens
    one = _generate_without_torch(tvm_artifact[1], "--prompt-ids", ",".join(map(str, PROMPTS[0])),
                                  "--prefill-chunk", 2, "--max-new-tokens", 12)
    assert one["tokens"] == generate(EagerBackend(model), PROMPTS[:1], 12).tokens


def test_sampling_without_torch_draws_the_tokens_of_every_runtime(tiny_export, tvm_artifact):
    """Temperature, top-p and seed in the torch-free process draw what TvmBackend (torch's runtime, the same library)
    and eager draw with that seed: one sampler (decoding.Sampler) in all three, fed logits equal within ATOL."""
    ids = [a for p in PROMPTS for a in ("--prompt-ids", ",".join(map(str, p)))]
    sampling = {"temperature": 0.8, "top_p": 0.9, "seed": 3, "eos_token_id": tiny_export[0].config.eos_token_id}
    doc = _generate_without_torch(tvm_artifact[1], *ids, "--max-new-tokens", 16, "--temperature", 0.8, "--top-p",
                                  0.9, "--seed", 3)
    assert doc["runtime"] == "torch-free"
    assert doc["tokens"] == generate(TvmBackend(tvm_artifact[1]), PROMPTS, 16, **sampling).tokens
    assert doc["tokens"] == generate(EagerBackend(tiny_export[0]), PROMPTS, 16, **sampling).tokens
    greedy = generate(EagerBackend(tiny_export[0]), PROMPTS, 16, eos_token_id=sampling["eos_token_id"]).tokens
    assert doc["tokens"] != greedy  # the draws are not the argmax's


def test_generate_through_torch_on_an_artifact_loads_no_compiler(tiny_export, tvm_artifact):
    """generate's torch runtime (here for --cache-block, which the torch-free path does not take) on an artifact
    compiled for this machine loads TVM's runtime library beside torch, never the compiler library
    (lean.runtime_library_for): eager's tokens, and libtvm_compiler.so not mapped in its process."""
    import subprocess
    import sys

    script = ("import sys\nfrom k3compile.cli import main\ntry:\n    main(sys.argv[1:], prog_name='k3compile', "
              "standalone_mode=False)\nfinally:\n    maps = open('/proc/self/maps').read()\n"
              "    print('compiler' if 'libtvm_compiler.so' in maps else 'runtime', file=sys.stderr)\n")
    ids = [a for p in PROMPTS for a in ("--prompt-ids", ",".join(map(str, p)))]
    r = subprocess.run([sys.executable, "-c", script, "generate", str(tvm_artifact[1]), *ids, "--max-new-tokens", "8",
                        "--cache-block", "4", "--json", "--quiet"], capture_output=True, text=True)
    assert r.returncode == 0 and r.stderr.strip().splitlines()[-1] == "runtime", r.stderr[-2000:]
    doc = json.loads(r.stdout)
    assert "runtime" not in doc and doc["tokens"] == generate(EagerBackend(tiny_export[0]), PROMPTS, 8).tokens


def test_the_torch_free_load_probe_loads_neither_torch_nor_the_compiler(tvm_artifact):
    """bench's memory probe of a CPU artifact runs as `generate` does: no torch, TVM's runtime library only."""
    from k3compile.bench import _probe_in_subprocess

    doc = _probe_in_subprocess("tvm", str(tvm_artifact[1]), 1)
    assert doc.get("runtime") == "torch-free" and doc.get("tvm_compiler_loaded") is False, doc


def test_an_artifact_of_another_host_is_left_to_tvm_backend(tmp_path, tvm_artifact):
    """An artifact whose recorded host differs from this machine's (or records none: built before lean.py) is not
    run without the compiler: `eligible` says no, so generate runs TvmBackend, whose check names the target; lean's
    own loader refuses it in one line. Nor is one whose library has no main_inplace_last (its entry_points)."""
    import shutil

    from k3compile.lean import LeanArtifact, eligible

    assert eligible(tvm_artifact[1])
    assert not eligible(tvm_artifact[1], cache_block=4) and not eligible(tvm_artifact[1], backend="onnx")
    assert "main_inplace_last" in tvm_artifact[0]["entry_points"]
    plain = tmp_path / "plain"
    shutil.copytree(tvm_artifact[1], plain)
    doc = json.loads((plain / "manifest.json").read_text())
    (plain / "manifest.json").write_text(json.dumps({**doc, "entry_points": ["main"]}))
    assert not eligible(plain)
    for host in ({**tvm_artifact[0]["host"], "cores": tvm_artifact[0]["host"]["cores"] + 1}, None):
        folder = tmp_path / f"art-{host is None}"
        shutil.copytree(tvm_artifact[1], folder)
        doc = json.loads((folder / "manifest.json").read_text())
        if host is None:
            del doc["host"]
        else:
            doc["host"] = host
        (folder / "manifest.json").write_text(json.dumps(doc))
        assert not eligible(folder)
        with pytest.raises(ExportError, match=r"not for this machine; build it again here \(compile\)"):
            LeanArtifact(folder)


# ---- verify, k3compile.testing, export --target ---------------------------------------------------------------------

def test_verify_an_artifact_compares_tvm_too(tvm_artifact):
    out = tvm_artifact[1]
    r = run("verify", out, "--json", "--quiet")
    assert r.exit_code == 0, r.output
    rows = json.loads(r.output)["rows"]
    assert {row["backend"] for row in rows} == {"onnxruntime", "tvm-llvm"}
    assert all(row["max_abs"] <= ATOL for row in rows)
    layered = run("verify", out, "--per-layer", "--json", "--quiet")
    layers = {(row["backend"], row["layer"]) for row in json.loads(layered.output)["rows"]}
    assert ("tvm-llvm", "0") in layers and ("tvm-llvm", "6") in layers and ("tvm-llvm", "logits") in layers


def test_assert_matches_eager_passes_on_the_artifact(tvm_artifact):
    from k3compile.testing import assert_matches_eager

    rows = assert_matches_eager(tvm_artifact[1], prompts=PROMPTS, atol=ATOL, decode_steps=2, new_tokens=8)
    assert len(rows) == 3 * (1 + 2 * 7)  # 3 phases x (logits + two states per layer)


def test_assert_matches_eager_refuses_what_is_not_a_built_folder(tmp_path):
    """A preset or a checkpoint folder is not something built: comparing it would be eager against eager."""
    from k3compile.checkpoint import save_checkpoint
    from k3compile.interface import ExportError
    from k3compile.source import load_model
    from k3compile.testing import assert_matches_eager

    save_checkpoint(load_model("k3-tiny"), tmp_path / "ckpt")
    for folder in ("k3-tiny", tmp_path / "ckpt"):
        with pytest.raises(ExportError, match="not an export folder, a compiled artifact or a sharded artifact"):
            assert_matches_eager(folder)


def test_assert_matches_eager_catches_a_wrong_weight(tmp_path, tvm_artifact):
    """An artifact consistent in itself (manifest rehashed) but with one weight changed: the helper must fail,
    naming the outputs in a table."""
    import shutil

    from safetensors.numpy import load_file, save_file

    from k3compile.interface import sha256_file, write_json
    from k3compile.manifest import MANIFEST, WEIGHTS
    from k3compile.testing import assert_matches_eager

    bad = tmp_path / "bad"
    shutil.copytree(tvm_artifact[1], bad)
    weights = load_file(str(bad / WEIGHTS))
    name = next(n for n, w in weights.items() if w.dtype == np.float32 and w.size > 1000)
    weights[name] = weights[name] * np.float32(1.5)
    save_file(weights, str(bad / WEIGHTS))
    manifest = json.loads((bad / MANIFEST).read_text())
    manifest["files"][WEIGHTS] = sha256_file(bad / WEIGHTS)
    write_json(bad / MANIFEST, manifest)
    with pytest.raises(AssertionError, match=r"outputs differ from eager by more than atol=0.0001:\nphase"):
        assert_matches_eager(bad, prompts=PROMPTS, atol=ATOL)


def test_tvm_equals_eager_with_mxfp8_activations(tiny_mxfp8_export):
    """MXFP8 activation quantization in front of the experts, in the MoE kernel: the whole equals eager in the
    exported forms."""
    model, folder, _ = tiny_mxfp8_export
    backend = TvmBackend(folder)
    main = str(backend.mod["main"])
    assert "call_dps_packed" not in main and "k3_latent_moe_dispatch_mxfp4_8_32_32_0_situ_4p0_25p0_e4m3" in main
    rows = compare(EagerBackend(model, Forms.exported("e4m3")), backend, decode_steps=2, prompts=PROMPTS)
    bad = [r for r in rows if not r["max_abs"] <= ATOL]
    assert not bad, bad[:3]


def test_tvm_equals_eager_with_float_experts(tmp_path):
    """k3-tiny with its experts dequantized to float32: the MoE calls run the same kernel on floats."""
    from k3compile.pipeline import export_checked
    from k3compile.source import load_model

    model = load_model("k3-tiny", seed=2, experts="float")
    export_checked(model, tmp_path / "float", verify_parity=False, source={"source": "k3-tiny", "seed": 2,
                                                                          "experts": "float"})
    backend = TvmBackend(tmp_path / "float")
    main = str(backend.mod["main"])
    assert "call_dps_packed" not in main and "R.call_tir(k3_latent_moe_dispatch_8_32_32_0_situ" in main
    rows = compare(EagerBackend(model, Forms.exported()), backend, decode_steps=2, prompts=PROMPTS)
    assert all(r["max_abs"] <= ATOL for r in rows), [r for r in rows if not r["max_abs"] <= ATOL][:3]


def test_dense_weights_fp32_and_bf16_refusals(tmp_path, tiny_export, tvm_artifact, fp32_dense_artifact):
    """`--dense-weights fp32` stores the same matrices in fp32 (twice the bytes) and equals eager too; bf16 on a
    model whose matrices do not hold bf16 values is refused naming one (cutting them would change the model), where
    `auto` keeps fp32; a GPU target refuses bf16 (its kernels read fp32)."""
    from k3compile.targets import resolve
    from safetensors.numpy import load_file

    from k3compile.compile import build, dense_target
    from k3compile.pipeline import export_checked
    from k3compile.source import load_model

    model, folder, _ = tiny_export
    manifest, fp32 = fp32_dense_artifact
    assert manifest["dense_weights"] == "fp32"
    assert "tuning" not in manifest and not (fp32 / "decode.so").exists()  # main runs every step
    wide, narrow = (load_file(str(d / "weights.safetensors")) for d in (fp32, tvm_artifact[1]))
    assert not any(w.dtype == np.uint16 for w in wide.values())
    nbytes = {d: sum(w.nbytes for w in ws.values() if w.dtype in (np.float32, np.uint16)) for d, ws in
              (("fp32", wide), ("bf16", narrow))}
    dense = sum(w.nbytes for w in narrow.values() if w.dtype == np.uint16)
    assert nbytes["fp32"] - nbytes["bf16"] == dense  # each uint16 matrix is half its fp32 copy
    rows = compare(EagerBackend(model, Forms.exported()), TvmBackend(fp32), decode_steps=2, prompts=PROMPTS)
    assert all(r["max_abs"] <= ATOL for r in rows), [r for r in rows if not r["max_abs"] <= ATOL][:3]

    odd = load_model("k3-tiny", seed=3)
    with torch.no_grad():
        odd.lm_head.weight.add_(1e-3 * torch.randn_like(odd.lm_head.weight))  # fp32 values, no longer bf16
    export_checked(odd, tmp_path / "odd", verify_parity=False, source={"source": "k3-tiny", "seed": 3,
                                                                      "experts": "auto"})
    with pytest.raises(ExportError, match="--dense-weights bf16: weight .* bf16 cannot represent exactly"):
        build(tmp_path / "odd", resolve("llvm"), dense="bf16", executable=False)
    r = run("compile", tmp_path / "odd", "-o", tmp_path / "odd-bf16", "--dense-weights", "bf16")
    one_line_error(r, "bf16 cannot represent exactly")
    assert not (tmp_path / "odd-bf16").exists()
    _, names, raw = to_relax(onnx.load(str(tmp_path / "odd" / "model.onnx")), keep_params=True)
    assert dense_target(resolve("llvm"), names, raw, "auto").dense_format == "fp32"  # auto keeps it exact
    assert dense_target(resolve("llvm"), *to_relax(onnx.load(str(folder / "model.onnx")), keep_params=True)[1:],
                        "auto").dense_format == "bf16"
    with pytest.raises(ExportError, match="target 'opencl' reads its dense weights as fp32"):
        dense_target(resolve("opencl"), [], [], "bf16")


def test_export_with_a_target_writes_the_artifact(tmp_path):
    import tempfile
    from pathlib import Path

    before = {p.name for p in Path(tempfile.gettempdir()).glob("k3compile-export-*")}
    out = tmp_path / "direct"
    r = run("export", "k3-tiny", "--target", "llvm", "-o", out, "--quiet", "--no-verify")
    assert r.exit_code == 0, r.output
    assert (out / "manifest.json").is_file() and (out / "model.onnx").is_file() and (out / "model.so").is_file()
    assert {p.name for p in Path(tempfile.gettempdir()).glob("k3compile-export-*")} == before  # scratch removed
    one_line_error(run("export", "k3-tiny", "--target", "vulkan", "-o", tmp_path / "gpu"), "target 'vulkan'")
    assert not (tmp_path / "gpu").exists()


# ---- the weights reader (behind the manifest's sha256, but checked on its own) ------------------------------------

def _weights_file(path, tensors: dict) -> None:
    from safetensors.numpy import save_file

    save_file(tensors, str(path))


def _both_readers(path, names):
    """library.read_weights (into TVM memory: the CPU backends) and read_tensors (into numpy, one at a time: the
    GPU executors' upload): the same tensors, or the same kind of error."""
    from k3compile.library import read_tensors, read_weights

    into_tvm = [t.numpy() for t in read_weights(path, names, tvm.cpu())]
    into_numpy = list(read_tensors(path, names))
    for a, b in zip(into_tvm, into_numpy):
        assert a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()
    return into_numpy


def test_read_weights_reads_what_safetensors_wrote(tmp_path):
    from k3compile.library import read_tensors

    tensors = {"a": np.arange(12, dtype=np.float32).reshape(3, 4), "b": np.array([1, 255], dtype=np.uint8),
               "e": np.zeros((0, 5), dtype=np.float32), "i": np.array([-3, 2**40], dtype=np.int64),
               "t": np.array(True)}  # every dtype a compiled module takes (a bool scalar among them)
    _weights_file(tmp_path / "w.safetensors", tensors)
    got = _both_readers(tmp_path / "w.safetensors", ["i", "a", "e", "b", "t"])
    for name, t in zip(["i", "a", "e", "b", "t"], got):
        np.testing.assert_array_equal(t, tensors[name])
    with pytest.raises(ExportError, match="missing the weight 'zz'"):
        _both_readers(tmp_path / "w.safetensors", ["a", "zz"])
    with pytest.raises(ExportError, match="missing the weight 'zz'"):
        list(read_tensors(tmp_path / "w.safetensors", ["a", "zz"]))


@settings(max_examples=examples(60), deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_read_weights_on_damaged_files_reads_or_raises_one_error(tmp_path, data):
    """Truncations, flipped bytes and edited headers: the right tensors, or ExportError; never another error (both
    readers)."""
    tensors = {"a": np.arange(6, dtype=np.float32).reshape(2, 3), "b": np.arange(4, dtype=np.uint8)}
    path = tmp_path / "w.safetensors"
    _weights_file(path, tensors)
    raw = bytearray(path.read_bytes())
    how = data.draw(st.sampled_from(["truncate", "flip", "header"]))
    if how == "truncate":
        raw = raw[:data.draw(st.integers(0, len(raw) - 1))]
    elif how == "flip":
        i = data.draw(st.integers(0, len(raw) - 1))
        raw[i] ^= data.draw(st.integers(1, 255))
    else:
        n = int.from_bytes(raw[:8], "little")
        header = json.loads(raw[8:8 + n])
        entry = header[data.draw(st.sampled_from(["a", "b"]))]
        key = data.draw(st.sampled_from(["dtype", "shape", "data_offsets"]))
        entry[key] = data.draw(st.one_of(st.none(), st.booleans(), st.integers(-5, 2**40), st.text(max_size=4),
                                         st.lists(st.integers(-3, 2**33), max_size=3)))
        body = json.dumps(header).encode()
        raw = bytearray(len(body).to_bytes(8, "little")) + body + raw[8 + n:]
    path.write_bytes(bytes(raw))
    try:
        got = _both_readers(path, ["a", "b"])
    except ExportError:
        return
    assert [t.shape for t in got] == [(2, 3), (4,)] or how == "flip"  # a flipped data byte reads as data
