"""MLA's attention contractions, softmax and cache write as k3compile's CPU kernels (k3compile/kernels/attention.py),
against numpy / torch, and the phases that place them (passes/lower_attention.py: which einsums and softmaxes it
takes; passes/inplace_caches.py: which caches it keeps in place)."""

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


SHAPES = [  # b, t, s, capacity, heads, width
    (1, 1, 1, 1, 8, 128),     # decode, the first position
    (1, 1, 17, 17, 8, 32),    # decode: a last tile of one position
    (2, 5, 13, 13, 2, 16),    # a batch, positions not a multiple of the tile, two heads
    (1, 7, 7, 7, 3, 48),      # an odd head count (tiles of one head)
    (1, 64, 64, 64, 4, 64),
    (2, 3, 11, 32, 4, 8),     # a cache buffer longer than its length (in place), a width of 8 lanes
    (1, 1, 5, 9, 2, 24),      # a width of 8-lane vectors, 3 of them
    (2, 64, 80, 96, 3, 48),   # prefill (from TRANSPOSE_AT tokens): the transposed cache, a last span of 16
]


@pytest.mark.parametrize("b,t,s,cap,heads,width", SHAPES)
def test_scores_kernel_equals_einsum(b, t, s, cap, heads, width):
    """Only the first s rows of the cache are read: the rest hold NaN."""
    from k3compile.kernels.attention import scores_kernel

    rng = np.random.default_rng(b * 100 + t + s)
    q = rng.standard_normal((b, t, heads, width), dtype=np.float32)
    k = np.full((b, cap, width), np.nan, np.float32)
    k[:, :s] = rng.standard_normal((b, s, width), dtype=np.float32)
    out = tvm.runtime.empty((b, heads, t, s), "float32")
    _compile(scores_kernel(heads, width))(tvm.runtime.tensor(q), tvm.runtime.tensor(k), s, out)
    want = np.einsum("bthc,bsc->bhts", q.astype(np.float64), k[:, :s].astype(np.float64))
    # fp32 sums of `width` products in another order (16 partial sums, then the lanes; in c order from TRANSPOSE_AT
    # tokens): ~1e-6 of sqrt(width)
    np.testing.assert_allclose(out.numpy(), want, rtol=0, atol=2e-5 * np.sqrt(width))


@pytest.mark.parametrize("b,t,s,cap,heads,width", SHAPES)
def test_pv_kernel_equals_einsum(b, t, s, cap, heads, width):
    """The weighted sum over the cache's first s rows (the rest NaN, never read)."""
    from k3compile.kernels.attention import pv_kernel

    rng = np.random.default_rng(b * 100 + t + s + 1)
    p = rng.random((b, heads, t, s), dtype=np.float32)
    k = np.full((b, cap, width), np.nan, np.float32)
    k[:, :s] = rng.standard_normal((b, s, width), dtype=np.float32)
    out = tvm.runtime.empty((b, t, heads, width), "float32")
    _compile(pv_kernel(heads, width))(tvm.runtime.tensor(p), tvm.runtime.tensor(k), s, out)
    want = np.einsum("bhts,bsc->bthc", p.astype(np.float64), k[:, :s].astype(np.float64))
    # fp32 sums of s products of weights in [0, 1), in position order: ~1e-7 of s
    np.testing.assert_allclose(out.numpy(), want, rtol=0, atol=1e-6 * s)


@pytest.mark.parametrize("heads", [8, 3])
def test_pv_kernel_stops_after_the_last_weight_and_keeps_uniform_rows(heads):
    """Causal weights (row t weighs positions <= t; the rest exactly 0, as a softmax under the mask gives them) sum
    only their positions: the cache rows past them hold NaN, which a product with 0 would carry. A zero weight
    before the last one (a padded key) is summed as it is; a fully padded row, uniform, sums every position; a row
    of zeros gives zeros. Equal to numpy in float64 within fp32 rounding."""
    from k3compile.kernels.attention import pv_kernel

    t, s, width = 6, 9, 32
    rng = np.random.default_rng(7)
    p = rng.random((1, heads, t, s), dtype=np.float32)
    for row in range(t):
        p[:, :, row, s - t + row + 1:] = 0  # causal: the new token `row` sits at position s - t + row
    p[:, :, 2, 1] = 0  # a padded key inside the span
    p[:, :, 4] = 1 / s  # a fully padded query row: uniform
    p[:, :, 5] = 0
    k = rng.standard_normal((1, s, width), dtype=np.float32)
    k[:, s - 1] = np.nan  # weighed only by the uniform row
    out = tvm.runtime.empty((1, t, heads, width), "float32")
    _compile(pv_kernel(heads, width))(tvm.runtime.tensor(p), tvm.runtime.tensor(k), s, out)
    got = out.numpy()
    assert np.isnan(got[:, 4]).all() and np.isfinite(np.delete(got, 4, axis=1)).all()
    kept = np.nan_to_num(k.astype(np.float64), nan=0.0)
    want = np.einsum("bhts,bsc->bthc", p.astype(np.float64), kept)
    np.testing.assert_allclose(np.delete(got, 4, axis=1), np.delete(want, 4, axis=1), rtol=0, atol=1e-6 * s)
    assert (got[:, 5] == 0).all()


def test_write_rows_kernel_writes_only_its_rows_and_refuses_an_overflow():
    from k3compile.kernels.attention import write_rows_kernel

    rng = np.random.default_rng(3)
    cache = rng.standard_normal((2, 10, 24), dtype=np.float32)
    new = rng.standard_normal((2, 3, 24), dtype=np.float32)
    buf = tvm.runtime.tensor(cache)
    write = _compile(write_rows_kernel(24))
    write(buf, tvm.runtime.tensor(new), 4)
    want = cache.copy()
    want[:, 4:7] = new
    np.testing.assert_array_equal(buf.numpy(), want)
    with pytest.raises(Exception, match="do not fit its capacity"):  # rows 8..10 of a 10-row buffer
        write(buf, tvm.runtime.tensor(new), 8)
    np.testing.assert_array_equal(buf.numpy(), want)


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
    heads = tvm.tirx.Var("h", "int64")
    dyn = relax.Var("dyn", relax.TensorType([n, t, heads, 24], "float32"))  # symbolic heads: no kernel
    with bb.function("main", [q, k, odd, kk, dyn]):
        with bb.dataflow():
            sc = bb.emit(relax.op.einsum([q, k], "bthc,bsc->bhts"))
            p = bb.emit(relax.op.nn.softmax(sc, axis=-1))
            o = bb.emit(relax.op.einsum([p, k], "bhts,bsc->bthc"))
            other = bb.emit(relax.op.einsum([odd, kk], "bthc,bsc->bhts"))
            along = bb.emit(relax.op.nn.softmax(other, axis=2))  # not the last axis
            sym = bb.emit(relax.op.einsum([dyn, kk], "bthc,bsc->bhts"))
            out = bb.emit_output(relax.Tuple([p, along, o, sym]))
        bb.emit_func_output(out)
    lowered = str(lower_attention(resolve())(bb.get())["main"])
    assert lowered.count("k3_attention_scores_4_32") == 1 and lowered.count("k3_attention_softmax") == 1
    assert lowered.count("k3_attention_scores_4_24") == 1 and lowered.count("k3_attention_pv_4_32") == 1
    assert lowered.count("R.einsum") == 1 and lowered.count("R.nn.softmax") == 1
    assert "k3_attention" not in str(lower_attention(resolve("opencl"))(bb.get())["main"])  # GPUs: dlight's
    tgt = resolve()
    with tgt.compiling():  # and the whole module builds and runs through phase 5
        ex = tvm.compile(legalize_fuse(tgt)(bb.get()), target=tgt.tvm(),
                         relax_pipeline=tvm.transform.Sequential(tgt.finish_passes()))
    rng = np.random.default_rng(0)
    feeds = [rng.standard_normal(shape, dtype=np.float32) for shape in ((2, 3, 4, 32), (2, 5, 32), (2, 3, 4, 24),
                                                                        (2, 5, 24), (2, 3, 4, 24))]
    got = relax.VirtualMachine(ex, tvm.cpu())["main"](*map(tvm.runtime.tensor, feeds))
    q_, k_, odd_, kk_, _ = map(torch.from_numpy, feeds)
    want = torch.softmax(torch.einsum("bthc,bsc->bhts", q_, k_), -1)
    torch.testing.assert_close(torch.from_numpy(got[0].numpy()), want, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(torch.from_numpy(got[1].numpy()), torch.softmax(
        torch.einsum("bthc,bsc->bhts", odd_, kk_), 2), rtol=1e-5, atol=1e-6)
    # outputs ~1 summed from 5 products in another order than torch's: a few fp32 ulps of 1 (2.4e-7 each)
    torch.testing.assert_close(torch.from_numpy(got[2].numpy()), torch.einsum("bhts,bsc->bthc", want, k_),
                               rtol=1e-5, atol=5e-6)


MASKED_SHAPES = [  # b, t, s, capacity, heads, width, rope width
    (1, 5, 9, 9, 8, 128, 32),     # k3-small's heads and widths: lane-wise sums for both parts
    (2, 3, 11, 16, 2, 32, 8),     # k3-tiny's: folded sums, a cache buffer longer than its length
    (1, 1, 17, 20, 3, 48, 24),    # decode, odd heads, a last tile of one position
    (1, 70, 70, 70, 4, 64, 16),   # whole tiles masked (the upper triangle) and skipped; prefill: transposed spans
    (2, 64, 70, 72, 2, 32, 8),    # prefill of a batch, a last span of 6, a longer cache buffer
]


@pytest.mark.parametrize("b,t,s,cap,heads,width,rope", MASKED_SHAPES)
def test_masked_scores_kernel_gives_the_chain_s_bits(b, t, s, cap, heads, width, rope):
    """The fused kernel against what it replaces, run as separate kernels (scores twice, then (s1 + s2) · scale
    and the mask in numpy's fp32): equal bit for bit under a causal mask with padded keys and a fully padded row
    (every entry the fill), and under no mask at all."""
    from k3compile.kernels.attention import masked_scores_kernel, scores_kernel

    rng = np.random.default_rng(b * 1000 + t + s + heads)
    q, qr = (rng.standard_normal((b, t, heads, w), dtype=np.float32) for w in (width, rope))
    k, kr = (rng.standard_normal((b, cap, w), dtype=np.float32) for w in (width, rope))
    causal = np.zeros((b, 1, t, s), bool)
    for i in range(t):
        causal[:, :, i, s - t + i + 1:] = True
    causal[0, :, :, : min(2, s - t)] = True  # two padded keys in the first row of the batch
    causal[0, :, 0] = True  # a fully padded query row
    scale, fill = np.array(0.125, np.float32), np.array(np.finfo(np.float32).min, np.float32)
    s1, s2 = tvm.runtime.empty((b, heads, t, s), "float32"), tvm.runtime.empty((b, heads, t, s), "float32")
    _compile(scores_kernel(heads, width))(tvm.runtime.tensor(q), tvm.runtime.tensor(k), s, s1)
    _compile(scores_kernel(heads, rope))(tvm.runtime.tensor(qr), tvm.runtime.tensor(kr), s, s2)
    fused = _compile(masked_scores_kernel(heads, width, rope))
    exact = (np.einsum("bthc,bsc->bhts", q.astype(np.float64), k[:, :s].astype(np.float64))
             + np.einsum("bthr,bsr->bhts", qr.astype(np.float64), kr[:, :s].astype(np.float64))) * 0.125
    for masked in (causal, np.zeros_like(causal)):
        out = tvm.runtime.empty((b, heads, t, s), "float32")
        fused(*(tvm.runtime.tensor(x) for x in (q, k, qr, kr, masked, scale, fill)), s, out)
        want = np.where(masked, fill, (s1.numpy() + s2.numpy()) * scale)
        np.testing.assert_array_equal(out.numpy(), want)
        # and the scores themselves: fp32 sums of width + rope products, scaled (as test_scores_kernel_equals_einsum)
        np.testing.assert_allclose(out.numpy(), np.where(masked, fill, exact), rtol=0,
                                   atol=2e-5 * np.sqrt(width + rope))


def _mla_chain(mask_batch):
    """main(q, k, qr, kr, masked, scale, fill): softmax(where(masked, fill, (scores + rope scores) · scale)) as MLA
    exports it, `masked` of batch `mask_batch` (1: broadcast over the batch)."""
    from tvm import relax

    bb = relax.BlockBuilder()
    n, t, s = (tvm.tirx.Var(v, "int64") for v in "nts")
    q = relax.Var("q", relax.TensorType([n, t, 4, 32], "float32"))
    k = relax.Var("k", relax.TensorType([n, s, 32], "float32"))
    qr = relax.Var("qr", relax.TensorType([n, t, 4, 16], "float32"))
    kr = relax.Var("kr", relax.TensorType([n, s, 16], "float32"))
    masked = relax.Var("masked", relax.TensorType([n if mask_batch is None else mask_batch, 1, t, s], "bool"))
    scale, fill = (relax.Var(v, relax.TensorType([], "float32")) for v in ("scale", "fill"))
    with bb.function("main", [q, k, qr, kr, masked, scale, fill]):
        with bb.dataflow():
            s1 = bb.emit(relax.op.einsum([q, k], "bthc,bsc->bhts"))
            s2 = bb.emit(relax.op.einsum([qr, kr], "bthr,bsr->bhts"))
            x = bb.emit(relax.op.multiply(relax.op.add(s1, s2), scale))
            p = bb.emit(relax.op.nn.softmax(relax.op.where(masked, fill, x), axis=-1))
            out = bb.emit_output(p)
        bb.emit_func_output(out)
    return bb.get()


def test_the_phase_fuses_mla_s_masked_scores_and_the_numbers_hold():
    """passes/lower_attention.py: fuse_masked_scores takes the chain whole (one kernel call, no score kernel, add,
    multiply or where left) when the mask is [B, 1, T, S]; a mask broadcast over the batch keeps the chain. Both
    modules run through phase 5 and equal torch within fp32 rounding."""
    from k3compile.passes.legalize_fuse import legalize_fuse
    from k3compile.passes.lower_attention import lower_attention
    from tvm import relax

    fused, kept = (str(lower_attention(resolve())(_mla_chain(m))["main"]) for m in (None, 1))
    assert fused.count("k3_attention_masked_scores_4_32_16") == 1 and "k3_attention_scores_" not in fused
    assert not any(op in fused for op in ("R.add", "R.multiply", "R.where"))
    assert "k3_attention_masked_scores" not in kept and kept.count("k3_attention_scores_") == 2
    rng = np.random.default_rng(1)
    q, k = rng.standard_normal((2, 3, 4, 32), dtype=np.float32), rng.standard_normal((2, 5, 32), dtype=np.float32)
    qr, kr = rng.standard_normal((2, 3, 4, 16), dtype=np.float32), rng.standard_normal((2, 5, 16), dtype=np.float32)
    masked = np.triu(np.ones((3, 5), bool), k=3)[None, None].repeat(2, 0)
    masked[1, :, :, 0] = True
    scale, fill = np.array(0.25, np.float32), np.array(np.finfo(np.float32).min, np.float32)
    scores = (torch.einsum("bthc,bsc->bhts", torch.from_numpy(q), torch.from_numpy(k))
              + torch.einsum("bthr,bsr->bhts", torch.from_numpy(qr), torch.from_numpy(kr))) * 0.25
    want = torch.softmax(scores.masked_fill(torch.from_numpy(masked), torch.finfo(torch.float32).min), -1)
    tgt = resolve()
    for mask_batch, m in ((None, masked), (1, masked[:1])):
        with tgt.compiling():
            ex = tvm.compile(legalize_fuse(tgt)(_mla_chain(mask_batch)), target=tgt.tvm(),
                             relax_pipeline=tvm.transform.Sequential(tgt.finish_passes()))
        got = relax.VirtualMachine(ex, tvm.cpu())["main"](*map(tvm.runtime.tensor, (q, k, qr, kr, m, scale, fill)))
        expect = want if mask_batch is None else torch.softmax(scores.masked_fill(
            torch.from_numpy(m), torch.finfo(torch.float32).min), -1)
        # fp32 sums of 32 + 16 products in the kernels' order, against torch's: a few ulps, through the softmax
        torch.testing.assert_close(torch.from_numpy(got.numpy()), expect, rtol=1e-5, atol=1e-6)


def test_a_square_by_a_scalar_weight_holding_2_becomes_a_product():
    """passes/exact_powers.py: power(x, w) with w a weight whose recorded value is 2 is x * x (what torch computes
    for x.pow(2), and powf(x, 2) exactly); another exponent, an unrecorded weight and a GPU target keep the power."""
    from k3compile.passes.exact_powers import exact_powers
    from tvm import relax

    from k3compile.frontend import SCALARS

    bb = relax.BlockBuilder()
    n = tvm.tirx.Var("n", "int64")
    x = relax.Var("x", relax.TensorType([n, 8], "float32"))
    two, three, unknown = (relax.Var(name, relax.TensorType([], "float32")) for name in ("two", "three", "unknown"))
    with bb.function("main", [x, two, three, unknown], attrs={"num_input": 1}):
        with bb.dataflow():
            a = bb.emit(relax.op.power(x, two))
            b = bb.emit(relax.op.power(x, three))
            c = bb.emit(relax.op.power(x, unknown))
            out = bb.emit_output(relax.Tuple([a, b, c]))
        bb.emit_func_output(out)
    mod = bb.get().with_attr(SCALARS, {"two": 2.0, "three": 3.0})
    got = str(exact_powers(resolve())(mod)["main"])
    assert got.count("R.power") == 2 and "R.multiply(x, x)" in got
    assert str(exact_powers(resolve("opencl"))(mod)["main"]).count("R.power") == 3
    assert str(exact_powers(resolve())(bb.get())["main"]).count("R.power") == 3  # no recorded values
