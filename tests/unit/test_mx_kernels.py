"""The MX pieces of the CPU kernels (k3compile/kernels/mx.py) and the MXFP4 matmul kernel against k3compile.quant.mx
and the eager op: MXFP8 fake quantization bit for bit (Hypothesis draws blocks of any float32: zeros, subnormals,
huge values, ties, inf, NaN), the matmul on shapes with one and many rows, tiles that do not divide, with and
without quantized activations, and the pass that lowers the op's calls."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from k3compile.ops.mxfp4_matmul import mxfp4_matmul
from k3compile.quant.mx import fake_quant_mx, quantize_mxfp4
from tests.hardening import examples

tvm = pytest.importorskip("tvm")

ROWS = 8


def _build_fake_quant(fmt):
    from tvm.script import tirx as T

    from k3compile.kernels.mx import fake_quant_block

    quant = fake_quant_block(fmt)

    @T.prim_func
    def f(a: T.Buffer((ROWS, 64), "float32"), b: T.Buffer((ROWS, 64), "float32")):
        for r, c in T.grid(ROWS, 2):
            quant(a, b, r, c * 32)

    return tvm.compile(tvm.IRModule({"main": f}), target="llvm")


@pytest.fixture(scope="module")
def fake_quant_lib():
    return {fmt: _build_fake_quant(fmt) for fmt in ("e4m3", "e5m2")}


def _fake_quant(lib, x):
    out = tvm.runtime.empty(x.shape, "float32")
    lib["main"](tvm.runtime.tensor(x), out)
    return out.numpy()


def _same(got, want):
    return bool(((got == want) | (np.isnan(got) & np.isnan(want))).all()) and np.array_equal(
        np.signbit(got[~np.isnan(got)]), np.signbit(want[~np.isnan(want)]))


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_fake_quant_block_edges(fake_quant_lib, fmt):
    rng = np.random.default_rng(0)
    x = (rng.standard_normal((ROWS, 64)) * np.exp(rng.uniform(-30, 30, (ROWS, 1)))).astype(np.float32)
    x[0] = 0.0
    x[1, :32] = 1e-45  # the smallest subnormal: amax subnormal
    x[1, 32:] = np.float32(2**-130)
    x[2, 5] = np.inf
    x[3, 40] = np.nan
    x[4] = 3e38
    x[5] = -0.0
    x[6] = np.arange(64) * 0.5**9  # ties at every quantum
    x[7] = rng.standard_normal(64).astype(np.float32) * 1e-38
    assert _same(_fake_quant(fake_quant_lib[fmt], x), fake_quant_mx(torch.from_numpy(x), fmt).numpy())


FLOATS = st.floats(width=32, allow_nan=True, allow_infinity=True, allow_subnormal=True)


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
@given(x=arrays(np.float32, (ROWS, 64), elements=FLOATS))
@settings(max_examples=examples(60), deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
def test_fake_quant_block_equals_torch_bit_for_bit(fake_quant_lib, fmt, x):
    assert _same(_fake_quant(fake_quant_lib[fmt], x), fake_quant_mx(torch.from_numpy(x), fmt).numpy())


def _run_matmul(x, packed, scale, act_quant):
    from k3compile.targets import resolve

    from k3compile.kernels.mxfp4_matmul import mxfp4_matmul_kernel

    n, k = packed.shape[0], x.shape[1]
    f = mxfp4_matmul_kernel(k, n, act_quant).with_attr("global_symbol", "main")
    y = tvm.runtime.empty((x.shape[0], n), "float32")
    feeds = [x.numpy(), np.ascontiguousarray(packed.numpy().T), np.ascontiguousarray(scale.numpy().T)]  # "kn"
    tvm.compile(tvm.IRModule({"main": f}), target=resolve().tvm())["main"](*map(tvm.runtime.tensor, feeds), y)
    return y.numpy()


@pytest.mark.parametrize("m,k,n", [(1, 64, 128), (7, 96, 24), (33, 32, 200)])  # N = 24, 200: tiles of 8
@pytest.mark.parametrize("act_quant", ["none", "e4m3", "e5m2"])
def test_mxfp4_matmul_kernel_equals_the_op(m, k, n, act_quant):
    gen = torch.Generator().manual_seed(m + n)
    x = torch.randn(m, k, generator=gen) * torch.logspace(-2, 2, k)
    packed, scale = quantize_mxfp4(torch.randn(n, k, generator=gen))
    want = mxfp4_matmul(x, packed, scale, act_quant).numpy()
    # fp32: the same decoded weights and (bit-exact) quantized activations, products summed in another order
    np.testing.assert_allclose(_run_matmul(x, packed, scale, act_quant), want, rtol=1e-5, atol=1e-4)


def test_pass_lowers_mxfp4_matmul_calls_of_any_rank():
    from k3compile.passes import run_phases
    from tvm import relax

    b, t = tvm.tirx.Var("b", "int64"), tvm.tirx.Var("t", "int64")
    x = relax.Var("x", relax.TensorType([b, t, 64], "float32"))
    p = relax.Var("p", relax.TensorType([24, 32], "uint8"))
    s = relax.Var("s", relax.TensorType([24, 2], "uint8"))
    bb = relax.BlockBuilder()
    with bb.function("main", [x, p, s]):
        with bb.dataflow():
            y = bb.emit(relax.call_dps_packed("k3.mxfp4_matmul", [x, p, s, tvm.ir.StringImm("e4m3")],
                                              relax.TensorType([b, t, 24], "float32")))
            gv = bb.emit_output(y)
        bb.emit_func_output(gv)
    mod = run_phases(bb.get(), upto="lower-k3-calls")
    text = str(mod["main"])
    assert "call_dps_packed" not in text and "k3_mxfp4_matmul_64_24_e4m3" in text
    assert "R.Tensor((b, t, 24)" in text  # the kernel's [b * t, 24] reshaped back

    gen = torch.Generator().manual_seed(5)
    xv = torch.randn(2, 3, 64, generator=gen)
    packed, scale = quantize_mxfp4(torch.randn(24, 64, generator=gen))
    from k3compile.targets import resolve

    target = resolve()
    built = tvm.compile(run_phases(bb.get(), target=target), target=target.tvm(),
                        relax_pipeline=tvm.transform.Sequential(target.finish_passes()))
    vm = relax.VirtualMachine(built, tvm.cpu())
    got = vm["main"](*[tvm.runtime.tensor(v.numpy()) for v in (xv, packed, scale)]).numpy()
    want = mxfp4_matmul(xv, packed, scale, "e4m3").numpy()
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-4)  # as above
