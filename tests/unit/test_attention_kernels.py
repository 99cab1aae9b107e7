"""MLA's score contraction and softmax as k3compile's CPU kernels (k3compile/kernels/attention.py), against numpy /
torch, and the phase that places them (passes/lower_attention.py): which einsums and softmaxes it takes."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import tvm
from k3compile.targets import resolve


def _compile(func):
    tgt = resolve()
    with tgt.compiling():
        return tvm.compile(tvm.IRModule({"main": func.with_attr("global_symbol", "main")}), target=tgt.tvm())["main"]


@pytest.mark.parametrize("b,t,s,heads,width", [
    (1, 1, 1, 8, 128),    # decode, the first position
    (1, 1, 17, 8, 32),    # decode: a last tile of one position
    (2, 5, 13, 2, 16),    # a batch, positions not a multiple of the tile, two heads
    (1, 7, 7, 3, 48),     # an odd head count (tiles of one head)
    (1, 64, 64, 4, 64),
])
def test_scores_kernel_equals_einsum(b, t, s, heads, width):
    from k3compile.kernels.attention import scores_kernel

    rng = np.random.default_rng(b * 100 + t + s)
    q = rng.standard_normal((b, t, heads, width), dtype=np.float32)
    k = rng.standard_normal((b, s, width), dtype=np.float32)
    out = tvm.runtime.empty((b, heads, t, s), "float32")
    _compile(scores_kernel(heads, width))(tvm.runtime.tensor(q), tvm.runtime.tensor(k), out)
    want = np.einsum("bthc,bsc->bhts", q.astype(np.float64), k.astype(np.float64))
    # fp32 sums of `width` products in another order (16 partial sums, then the lanes): ~1e-6 of sqrt(width)
    np.testing.assert_allclose(out.numpy(), want, rtol=0, atol=2e-5 * np.sqrt(width))


@pytest.mark.parametrize("s", [1, 15, 16, 17, 100])
def test_softmax_kernel_equals_torch(s):
    """Rows of any length (whole vectors and a tail), large and very negative entries (a masked key's minimum
    float), a row where one entry dominates; and a row of -inf is NaN as in torch."""
    from k3compile.kernels.attention import softmax_kernel

    gen = torch.Generator().manual_seed(s)
    x = torch.randn(2, 3, 4, s, generator=gen) * 10
    x[0, 0, 1, : s // 2] = torch.finfo(torch.float32).min  # masked keys
    x[1, 2, 3, -1] = 80.0
    x[0, 1, 2, :] = float("-inf")
    out = tvm.runtime.empty(tuple(x.shape), "float32")
    _compile(softmax_kernel())(tvm.runtime.tensor(x.numpy()), out)
    got, want = torch.from_numpy(out.numpy()), torch.softmax(x, dim=-1)
    assert torch.isnan(got[0, 1, 2]).all() and torch.isnan(want[0, 1, 2]).all()
    keep = ~torch.isnan(want)
    # fp32; exp_f32's relative error ~1e-7 and the sum in another order
    torch.testing.assert_close(got[keep], want[keep], rtol=1e-5, atol=1e-7)


def test_the_phase_takes_only_score_einsums_and_last_axis_softmax():
    from k3compile.passes.legalize_fuse import legalize_fuse
    from k3compile.passes.lower_attention import lower_attention, scores_form
    from tvm import relax

    assert scores_form("bthc,bsc->bhts") and scores_form("bthr,bsr->bhts") and scores_form("abcd,aed->acbe")
    assert not any(scores_form(e) for e in ("bhts,bsc->bthc", "bthc,hvc->bthv", "bthc,bsc->bths", "ab,bc->ac",
                                            "bthc,bsc", "bthh,bsh->bhts"))
    bb = relax.BlockBuilder()
    n, t, s = (tvm.tirx.Var(v, "int64") for v in "nts")
    q = relax.Var("q", relax.TensorType([n, t, 4, 32], "float32"))
    k = relax.Var("k", relax.TensorType([n, s, 32], "float32"))
    odd = relax.Var("odd", relax.TensorType([n, t, 4, 24], "float32"))  # a width that is no multiple of 16
    kk = relax.Var("kk", relax.TensorType([n, s, 24], "float32"))
    with bb.function("main", [q, k, odd, kk]):
        with bb.dataflow():
            sc = bb.emit(relax.op.einsum([q, k], "bthc,bsc->bhts"))
            p = bb.emit(relax.op.nn.softmax(sc, axis=-1))
            other = bb.emit(relax.op.einsum([odd, kk], "bthc,bsc->bhts"))
            along = bb.emit(relax.op.nn.softmax(other, axis=2))  # not the last axis
            out = bb.emit_output(relax.Tuple([p, along]))
        bb.emit_func_output(out)
    lowered = str(lower_attention(resolve())(bb.get())["main"])
    assert lowered.count("k3_attention_scores_4_32") == 1 and lowered.count("k3_attention_softmax") == 1
    assert lowered.count("R.einsum") == 1 and lowered.count("R.nn.softmax") == 1
    assert "k3_attention" not in str(lower_attention(resolve("opencl"))(bb.get())["main"])  # GPUs: dlight's
    tgt = resolve()
    with tgt.compiling():  # and the whole module builds and runs through phase 5
        ex = tvm.compile(legalize_fuse(tgt)(bb.get()), target=tgt.tvm(),
                         relax_pipeline=tvm.transform.Sequential(tgt.finish_passes()))
    rng = np.random.default_rng(0)
    feeds = [rng.standard_normal(shape, dtype=np.float32) for shape in ((2, 3, 4, 32), (2, 5, 32), (2, 3, 4, 24),
                                                                        (2, 5, 24))]
    got = relax.VirtualMachine(ex, tvm.cpu())["main"](*map(tvm.runtime.tensor, feeds))
    want = torch.softmax(torch.einsum("bthc,bsc->bhts", *map(torch.from_numpy, feeds[:2])), -1)
    torch.testing.assert_close(torch.from_numpy(got[0].numpy()), want, rtol=1e-5, atol=1e-6)
