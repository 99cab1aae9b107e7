"""Every k3 call of every config of the family becomes a kernel, whatever its widths (issue #17, item 5;
docs/architecture.md, "The compile path"): float experts whose widths are not whole 32-blocks (and float16 ones) run
the MoE kernel at padded sizes, equal to the eager op; a call that a kernel factory declines is refused at build
time with the op and the reason, never left extern; transformers-built Kimi-Linear checkpoints export and compile
with the CLI and generate eager's greedy tokens from the written artifact in a fresh process.

The three checkpoints are built and compiled two at a time (~45 s each on 2 cores)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch
import tvm
from builders import build_hf
from hardening import one_line_error, run
from k3compile.passes import run_phases
from k3compile.passes.lower_k3_calls import Declined, declined, lower_k3_calls
from k3compile.targets import resolve
from onnx import TensorProto, helper
from tvm import relax

from k3compile.compile import _no_extern_calls, build_proto
from k3compile.config import ConfigError
from k3compile.interface import ExportError
from k3compile.kernels.moe import column_tile, grouped
from k3compile.ops.latent_moe_dispatch import latent_moe_dispatch_eager
from k3compile.ops.mxfp4_matmul import mxfp4_matmul_eager
from k3compile.ops.onnx_body import ACT_QUANT_CODES, ACTIVATION_CODES
from k3compile.quant.mx import quantize_mxfp4

LLVM = resolve("llvm")
TOKENS = (1, 24)  # top-2 over 3 or 4 experts: per-pair GEMVs (2 pairs), pairs grouped by expert (48: `grouped`)
# fp32 accumulation on both sides (float16 weights are exact in fp32), products summed in another order, and the
# padding adds exact zeros: observed ~5e-7 at these magnitudes (as tests/unit/test_kernels.py's MoE bound)
ATOL = 1e-5


def _attrs(offset: int, activation: str, act_quant: str) -> list:
    return [relax.prim_value(tvm.tirx.IntImm("int64", offset)), tvm.ir.StringImm(activation),
            relax.prim_value(tvm.tirx.FloatImm("float64", 4.0)), relax.prim_value(tvm.tirx.FloatImm("float64", 25.0)),
            tvm.ir.StringImm(act_quant)]


def _moe_module(e: int, i: int, d: int, dtype: str, offset: int, activation: str, act_quant: str = "none"):
    """main(z, idx, w; w13, w2) = k3.latent_moe_dispatch as the frontend writes it, the experts weights (num_input)."""
    n = tvm.tirx.Var("n", "int64")
    ts = [("z", [n, d], "float32"), ("idx", [n, 2], "int64"), ("w", [n, 2], "float32"), ("w13", [e, 2 * i, d], dtype),
          ("w2", [e, d, i], dtype)]
    ps = [relax.Var(name, relax.TensorType(shape, dt)) for name, shape, dt in ts]
    bb = relax.BlockBuilder()
    with bb.function("main", ps, attrs={"num_input": 3}):
        with bb.dataflow():
            y = bb.emit(relax.call_dps_packed("k3.latent_moe_dispatch", [*ps, *_attrs(offset, activation, act_quant)],
                                              relax.TensorType([n, d], "float32")))
            gv = bb.emit_output(y)
        bb.emit_func_output(gv)
    return bb.get()


@pytest.mark.parametrize("e,i,d,dtype,offset,activation", [
    (3, 24, 40, "float16", 2, "silu"),   # neither width a 32-block, float16 experts, a slice [2, 5)
    (4, 20, 48, "float32", 1, "situ"),   # I = 20 (a partial block only in I), D = 48 (one and a half blocks)
])
def test_float_experts_of_any_width_lower_to_the_kernel_and_equal_the_op(e, i, d, dtype, offset, activation):
    mod = _moe_module(e, i, d, dtype, offset, activation)
    lifted = run_phases(mod, LLVM, upto="lift-weight-transforms")
    main, transform = lifted["main"].script(), lifted["main_transform_params"].script()
    assert "call_dps_packed" not in main and not declined(lifted)
    ip, dp = -(-i // 32) * 32, -(-d // 32) * 32
    assert f"k3_latent_moe_dispatch_{e}_{ip}_{dp}_{offset}_{activation}_4p0_25p0_none" in main  # the padded kernel
    assert main.count("R.nn.pad") == 1 and "R.strided_slice" in main  # z padded, y sliced at run time
    assert transform.count("R.nn.pad") == 2 and ("R.astype" in transform) == (dtype != "float32")  # at compile time

    built = run_phases(mod, LLVM)
    _no_extern_calls(built, LLVM)
    with LLVM.compiling():
        ex = tvm.compile(built, target=LLVM.tvm(), relax_pipeline=tvm.transform.Sequential(LLVM.finish_passes()))
    vm = relax.VirtualMachine(ex, tvm.cpu())
    gen = torch.Generator().manual_seed(e + i + d)
    w13 = (torch.randn(e, 2 * i, d, generator=gen) * 0.2).to(getattr(torch, dtype))
    w2 = (torch.randn(e, d, i, generator=gen) * 0.2).to(getattr(torch, dtype))
    weights = list(vm["main_transform_params"]([tvm.runtime.tensor(w13.numpy()), tvm.runtime.tensor(w2.numpy())]))
    ta, td = column_tile(2 * ip), column_tile(dp)  # stored padded, in column tiles (expert_tiles), float32
    assert [tuple(t.shape) for t in weights] == [(e, 2 * ip // ta, dp, ta), (e, dp // td, ip, td)]
    assert [grouped(n, 2, e) for n in TOKENS] == [False, True]  # both of the kernel's paths
    for n in TOKENS:
        z = torch.randn(n, d, generator=gen)
        idx = torch.randint(0, offset + e + 2, (n, 2), generator=gen)  # ids 0 .. offset - 1 and past the slice too
        idx[-1] = torch.tensor([offset + e - 1, offset + e])  # one slot in the slice, one past it
        if n > 1:
            idx[0] = torch.tensor([offset - 1, offset + e])  # routed outside the slice only
        w = torch.rand(n, 2, generator=gen)
        got = vm["main"](*(tvm.runtime.tensor(t.numpy()) for t in (z, idx, w)), *weights).numpy()
        want = latent_moe_dispatch_eager(z, idx, w, w13, w2, None, None, offset, activation, 4.0, 25.0).numpy()
        assert np.abs(want[-1]).max() > 0.01 and (n == 1 or not got[0].any())  # the outside-only token weighs zero
        np.testing.assert_allclose(got, want, rtol=0, atol=ATOL)


# ---- the GPU path: the same padding in front of the thread-bound kernels, and N padded for the matmul --------------

def _model(nodes, inputs, outputs, initializers):
    graph = helper.make_graph(nodes, "g", inputs, outputs, initializer=initializers)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 23), helper.make_opsetid("k3", 1)])


def _vi(name, dtype, shape):
    return helper.make_tensor_value_info(name, dtype, shape)


def _init(name, t: torch.Tensor):
    return helper.make_tensor(name, {torch.float32: TensorProto.FLOAT, torch.uint8: TensorProto.UINT8}[t.dtype],
                              list(t.shape), t.flatten().tolist())


def _moe_proto(w13, w2, offset, activation, act_quant="none"):
    e, i2, d = w13.shape
    node = helper.make_node("LatentMoEDispatch", ["z", "idx", "w", "w13", "w2"], ["y"], domain="k3",
                            expert_offset=offset, activation=ACTIVATION_CODES[activation], situ_beta=4.0,
                            situ_linear_beta=25.0, act_quant=ACT_QUANT_CODES[act_quant])
    return _model([node], [_vi("z", TensorProto.FLOAT, ["n", d]), _vi("idx", TensorProto.INT64, ["n", 2]),
                           _vi("w", TensorProto.FLOAT, ["n", 2])], [_vi("y", TensorProto.FLOAT, ["n", d])],
                  [_init("w13", w13), _init("w2", w2)])


def test_gpu_kernels_run_float_experts_of_any_width_and_matmuls_of_any_n():
    from k3compile import devices

    try:
        dev = devices.driver("opencl")
    except devices.DeviceError as err:
        pytest.skip(str(err))
    opencl = resolve("opencl")
    gen = torch.Generator().manual_seed(3)
    e, i, d, offset = 3, 24, 40, 1
    w13, w2 = torch.randn(e, 2 * i, d, generator=gen) * 0.2, torch.randn(e, d, i, generator=gen) * 0.2
    mod, _, _, weights = build_proto(_moe_proto(w13, w2, offset, "situ"), resolve("opencl"), executable=False)
    assert "k3_latent_moe_dispatch_up_3_32_64_1_situ" in mod.script()
    for n in TOKENS:
        z, idx, w = torch.randn(n, d, generator=gen), torch.randint(0, e + 2, (n, 2), generator=gen), torch.rand(n, 2)
        (got,) = devices.run_main(mod, opencl, [z.numpy(), idx.numpy(), w.numpy(), *(t.numpy() for t in weights)],
                                  dev=dev)
        want = latent_moe_dispatch_eager(z, idx, w, w13, w2, None, None, offset, "situ", 4.0, 25.0).numpy()
        np.testing.assert_allclose(got, want, rtol=0, atol=ATOL)  # as above: the kernels sum in the CPU order

    k, n_out = 64, 6  # N = 6: the scale words hold 4 columns, so N is padded to 8 and sliced back
    packed, scale = quantize_mxfp4(torch.randn(n_out, k, generator=gen))
    node = helper.make_node("MXFP4MatMul", ["x", "p", "s"], ["y"], domain="k3", act_quant=ACT_QUANT_CODES["none"])
    proto = _model([node], [_vi("x", TensorProto.FLOAT, ["m", k])], [_vi("y", TensorProto.FLOAT, ["m", n_out])],
                   [_init("p", packed), _init("s", scale)])
    mod, _, _, weights = build_proto(proto, resolve("opencl"), executable=False)
    assert "k3_mxfp4_matmul_mm_64_8_none" in mod.script()
    x = torch.randn(5, k, generator=gen)
    (got,) = devices.run_main(mod, opencl, [x.numpy(), *(t.numpy() for t in weights)], dev=dev)
    np.testing.assert_allclose(got, mxfp4_matmul_eager(x, packed, scale).numpy(), rtol=0, atol=ATOL)


# ---- a declined call is a build error, never an extern call in an artifact -----------------------------------------

def test_mxfp8_activations_over_partial_blocks_are_refused_by_eager_and_by_the_build():
    """Eager cannot quantize a 40-wide z in 32-blocks and says so; the kernel factory declines it with its reason,
    and the build refuses the call naming both."""
    z, idx, w = torch.randn(2, 40), torch.zeros(2, 2, dtype=torch.int64), torch.rand(2, 2)
    w13, w2 = torch.randn(3, 48, 40), torch.randn(3, 40, 24)
    with pytest.raises(ConfigError, match="expert input width .* is 40 and moe_intermediate_size 24"):
        latent_moe_dispatch_eager(z, idx, w, w13, w2, None, None, 0, "silu", 4.0, 25.0, "e4m3")
    lowered = run_phases(_moe_module(3, 24, 40, "float32", 0, "silu", "e4m3"), LLVM, upto="lower-k3-calls")
    assert 'call_dps_packed("k3.latent_moe_dispatch"' in lowered["main"].script()  # left as it was
    reason = declined(lowered)["k3.latent_moe_dispatch"]
    assert reason == ["MXFP8 activations (e4m3) quantize blocks of 32 along both widths, got I=24, D=40 (the eager op "
                      "refuses them too)"]
    with pytest.raises(ExportError, match=r"^k3.latent_moe_dispatch has no llvm kernel: MXFP8 activations \(e5m2\)"):
        build_proto(_moe_proto(w13, w2, 0, "silu", "e5m2"), resolve("llvm"))


def _call_module(*symbols: str):
    x = relax.Var("x", relax.TensorType((4, 8), "float32"))
    bb = relax.BlockBuilder()
    with bb.function("main", [x]):
        y = x
        for symbol in symbols:
            y = bb.emit(relax.call_dps_packed(symbol, [y], out_ty=relax.TensorType((4, 8), "float32")))
        bb.emit_func_output(y)
    return bb.get()


def test_a_declined_call_or_an_op_without_a_factory_is_refused_with_its_reason():
    mod = lower_k3_calls(LLVM, kernels={"k3.kda_recurrence": lambda args, target: Declined("a reason of the test")})(
        _call_module("k3.kda_recurrence", "k3.unknown", "k3.all_reduce", "other.extern"))
    assert declined(mod) == {"k3.kda_recurrence": ["a reason of the test"],
                             "k3.unknown": ["no kernel is written for this op"]}  # the collective and others: none
    with pytest.raises(ExportError) as err:
        _no_extern_calls(mod, LLVM)
    assert str(err.value) == ("k3.kda_recurrence has no llvm kernel: a reason of the test; "
                              "k3.unknown has no llvm kernel: no kernel is written for this op")
    _no_extern_calls(_call_module("k3.all_reduce", "k3.all_to_all"), resolve("opencl"))  # extern by design
    with pytest.raises(TypeError, match="returned None"):  # house style lesson 6: a factory says why
        lower_k3_calls(LLVM, kernels={"k3.unknown": lambda args, target: None})(_call_module("k3.unknown"))


# ---- transformers-built Kimi-Linear checkpoints, exported and compiled by the CLI --------------------------------

ORACLE = {  # tests/oracle/test_transformers_parity.py's configs (hidden 48, moe_intermediate 24: neither whole blocks)
    "no-q-lora": dict(q_lora_rank=None, heads=2, kda_heads=2, head_dim=16),
    "q-lora": dict(q_lora_rank=24, heads=4, kda_heads=3, head_dim=8),
}
ODD = dict(hidden_size=40, moe_intermediate_size=20, intermediate_size=56)  # other partial blocks, a dense FFN of 56
PROMPTS = [[5, 17, 60, 3, 9, 9, 41], [1, 2]]


def _cli(*args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "k3compile.cli", *map(str, args)], capture_output=True, text=True)


def _build_odd(folder) -> None:
    """A Kimi-Linear of build_hf's config with the widths of ODD, made and saved by transformers."""
    from transformers import KimiLinearConfig, KimiLinearForCausalLM

    build_hf(folder, **ORACLE["no-q-lora"])
    cfg = KimiLinearConfig.from_pretrained(folder)
    for name, value in ODD.items():
        setattr(cfg, name, value)
    torch.manual_seed(1)
    model = KimiLinearForCausalLM(cfg).eval()
    with torch.no_grad():  # the routing bias, as build_hf sets it
        for layer in model.model.layers:
            if hasattr(layer.mlp, "gate"):
                layer.mlp.gate.e_score_correction_bias.copy_(torch.randn(cfg.num_local_experts) * 0.05)
    model.save_pretrained(folder)


@pytest.fixture(scope="module")
def kimi_artifacts(tmp_path_factory):
    """name -> (checkpoint, artifact) for the oracle configs and ODD, each `export CKPT --target llvm -o OUT`."""
    root = tmp_path_factory.mktemp("every-width")
    jobs = {name: (root / name, root / f"{name}-llvm") for name in [*ORACLE, "odd"]}

    for name, (ckpt, _) in jobs.items():  # here, one after the other: torch's seed is global (a few s each)
        _build_odd(ckpt) if name == "odd" else build_hf(ckpt, **ORACLE[name])

    def export(name):
        ckpt, out = jobs[name]
        res = _cli("export", ckpt, "--target", "llvm", "-o", out, "--quiet")
        assert res.returncode == 0, res.stderr[-3000:]
        return name

    with ThreadPoolExecutor(2) as pool:
        list(pool.map(export, jobs))
    return jobs


@pytest.mark.parametrize("name", [*ORACLE, "odd"])
def test_kimi_linear_checkpoints_export_compile_and_generate_eager_tokens(kimi_artifacts, name):
    from k3compile.backends.eager import EagerBackend
    from k3compile.generate import generate
    from k3compile.source import load_model

    ckpt, out = kimi_artifacts[name]
    cfg = load_model(ckpt).config
    assert cfg.hidden_size % 32 and cfg.moe_intermediate_size % 32 and cfg.expert_format == "float"  # the bug's case
    # the library calls the padded MoE kernel and no extern k3 op (a kernel is k3_<op>_<key>, an extern k3.<op>)
    code = relax.VMExecutable(tvm.runtime.load_module(str(out / "model.so"))).as_text()
    ip, dp = -(-cfg.moe_intermediate_size // 32) * 32, -(-cfg.hidden_size // 32) * 32
    assert f"k3_latent_moe_dispatch_{cfg.num_experts}_{ip}_{dp}_0_silu_" in code
    assert not re.findall(r"\bk3\.\w+", code)
    args = [a for p in PROMPTS for a in ("--prompt-ids", ",".join(map(str, p)))]
    res = _cli("generate", out, "--backend", "tvm", *args, "--max-new-tokens", 8, "--json", "--quiet")
    assert res.returncode == 0, res.stderr[-3000:]
    assert json.loads(res.stdout)["tokens"] == generate(EagerBackend(load_model(ckpt)), PROMPTS, 8).tokens


@pytest.mark.parametrize("name", [*ORACLE])
def test_kimi_linear_artifact_onnx_and_tvm_equal_eager(kimi_artifacts, name):
    """The export inside each artifact (float experts, SiLU, low-rank KDA gate, no AttnRes, no latent MoE): its
    onnxruntime run and the compiled library equal eager in every output, prefill and three decode steps, and give
    eager's 32 greedy tokens for a left-padded batch (formerly tests/export/test_export_kimi_linear.py, which
    exported the same checkpoints a second time)."""
    from k3compile.backends.eager import EagerBackend
    from k3compile.backends.onnx import OnnxBackend
    from k3compile.backends.tvm import TvmBackend
    from k3compile.generate import generate
    from k3compile.modes import Forms
    from k3compile.source import load_model
    from k3compile.verify import compare

    ckpt, out = kimi_artifacts[name]
    model = load_model(ckpt)
    assert json.loads((out / "export.json").read_text())["k3_nodes"] == {"KDARecurrence": 4, "LatentMoEDispatch": 4}
    prompts = [[5, 6, 7, 8, 9], [40], [90, 91, 92]]
    eager_tokens = generate(EagerBackend(model), prompts, 32).tokens
    for backend in (OnnxBackend(out), TvmBackend(out)):
        rows = compare(EagerBackend(model, Forms.exported()), backend, decode_steps=3, prompts=prompts)
        bad = [r for r in rows if not r["max_abs"] <= 1e-4]  # fp32, summation order only; a NaN row fails too
        assert not bad, (backend.name, bad[:3])
        assert generate(backend, prompts, 32).tokens == eager_tokens, backend.name


def test_mxfp8_export_of_partial_blocks_is_one_line(kimi_artifacts, tmp_path):
    ckpt = kimi_artifacts["no-q-lora"][0]
    one_line_error(run("export", ckpt, "--activations", "mxfp8", "-o", tmp_path / "out"),
                   "MXFP8 activations (e4m3) quantize blocks of 32 along the expert widths")
    assert not (tmp_path / "out").exists()
