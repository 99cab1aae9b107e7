"""TIR kernels of the k3 ops against the eager ops, and the pass that puts them in place of the extern calls
(on shapes that exercise the edges: one token, a long sequence, heads and widths of other sizes, a given state)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from k3compile.model.kda import l2_normalize
from k3compile.ops.kda_recurrence import kda_recurrence, kda_recurrent

tvm = pytest.importorskip("tvm")


@pytest.fixture(scope="module")
def kda_lib():
    from k3compile.kernels.kda import kda_recurrence_kernel

    libs = {}

    def build(h, k, v):
        if (h, k, v) not in libs:
            f = kda_recurrence_kernel(h, k, v).with_attr("global_symbol", "main")
            libs[(h, k, v)] = tvm.compile(tvm.IRModule({"main": f}), target="llvm")
        return libs[(h, k, v)]

    return build


def _inputs(b, t, h, k, v, seed):
    gen = torch.Generator().manual_seed(seed)
    q = l2_normalize(torch.randn(b, t, h, k, generator=gen)) * k**-0.5
    kk = l2_normalize(torch.randn(b, t, h, k, generator=gen))
    vv = torch.randn(b, t, h, v, generator=gen)
    g = -torch.rand(b, t, h, k, generator=gen) * 3
    beta = torch.rand(b, t, h, generator=gen)
    s0 = torch.randn(b, h, k, v, generator=gen)
    return q, kk, vv, g, beta, s0


@pytest.mark.parametrize("b,t,h,k,v", [(2, 1, 3, 16, 16), (1, 70, 2, 8, 24), (3, 9, 1, 24, 8)])
def test_kda_kernel_equals_the_recurrence(kda_lib, b, t, h, k, v):
    args = _inputs(b, t, h, k, v, seed=t)
    want_o, want_s = kda_recurrent(*args)
    out = [tvm.runtime.empty((b, t, h, v), "float32"), tvm.runtime.empty((b, h, k, v), "float32")]
    kda_lib(h, k, v)["main"](*[tvm.runtime.tensor(x.numpy()) for x in args], *out)
    # fp32, the same recurrence in the same order up to the sums over K (observed ~6e-8)
    np.testing.assert_allclose(out[0].numpy(), want_o.numpy(), rtol=0, atol=1e-5)
    np.testing.assert_allclose(out[1].numpy(), want_s.numpy(), rtol=0, atol=1e-5)
    # and the op the model calls (chunked for t > 1): the same up to the chunked form's ~1e-6
    op_o, op_s = kda_recurrence(*args)
    np.testing.assert_allclose(out[0].numpy(), op_o.numpy(), rtol=0, atol=1e-4)
    np.testing.assert_allclose(out[1].numpy(), op_s.numpy(), rtol=0, atol=1e-4)


def test_kda_kernel_leaves_its_input_state_alone(kda_lib):
    args = _inputs(1, 5, 2, 8, 8, seed=3)
    s0 = tvm.runtime.tensor(args[-1].numpy())
    out = [tvm.runtime.empty((1, 5, 2, 8), "float32"), tvm.runtime.empty((1, 2, 8, 8), "float32")]
    kda_lib(2, 8, 8)["main"](*[tvm.runtime.tensor(x.numpy()) for x in args[:-1]], s0, *out)
    assert np.array_equal(s0.numpy(), args[-1].numpy())


def _module(heads):
    from tvm import relax

    b, t = tvm.tirx.Var("b", "int64"), tvm.tirx.Var("t", "int64")
    qk = relax.TensorType([b, t, heads, 8], "float32")
    ps = [relax.Var(n, ty) for n, ty in (("q", qk), ("k", qk), ("v", qk), ("g", qk),
                                         ("beta", relax.TensorType([b, t, heads], "float32")),
                                         ("s", relax.TensorType([b, heads, 8, 8], "float32")))]
    bb = relax.BlockBuilder()
    with bb.function("main", ps):
        with bb.dataflow():
            out = bb.emit(relax.call_dps_packed("k3.kda_recurrence", ps, [ps[2].ty, ps[5].ty]))
            other = bb.emit(relax.call_dps_packed("k3.unknown", [ps[0]], ps[0].ty))
            gv = bb.emit_output(relax.Tuple([out, other]))
        bb.emit_func_output(gv)
    return bb.get()


def test_pass_lowers_static_kda_calls_and_leaves_the_rest():
    from k3compile.passes import run_phases

    lowered = str(run_phases(_module(2))["main"])
    assert 'call_dps_packed("k3.kda_recurrence"' not in lowered and "k3_kda_recurrence_2_8_8" in lowered
    assert 'call_dps_packed("k3.unknown"' in lowered  # no kernel: stays extern
    symbolic = str(run_phases(_module(tvm.tirx.Var("h", "int64")))["main"])
    assert 'call_dps_packed("k3.kda_recurrence"' in symbolic  # a head count that is not static: left alone
