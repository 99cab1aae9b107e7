"""TIR kernels of the k3 ops against the eager ops, and the pass that puts them in place of the extern calls
(on shapes that exercise the edges: one token, a long sequence, heads and widths of other sizes, a given state)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from k3compile.model.kda import l2_normalize
from k3compile.ops.kda_recurrence import kda_recurrence, kda_recurrent

tvm = pytest.importorskip("tvm")


@pytest.fixture(scope="module")
def kda_lib():
    from k3compile.kernels.kda import kda_chunked_kernel, kda_recurrence_kernel

    libs = {}

    def build(h, k, v, form="chunked", chunk=None):
        key = (h, k, v, form, chunk)
        if key not in libs:
            if form == "chunked":
                f = kda_chunked_kernel(h, k, v) if chunk is None else kda_chunked_kernel(h, k, v, chunk)
            else:
                f = kda_recurrence_kernel(h, k, v)
            libs[key] = tvm.compile(tvm.IRModule({"main": f.with_attr("global_symbol", "main")}), target="llvm")
        return libs[key]

    return build


def _inputs(b, t, h, k, v, seed, decay=3.0):
    gen = torch.Generator().manual_seed(seed)
    q = l2_normalize(torch.randn(b, t, h, k, generator=gen)) * k**-0.5
    kk = l2_normalize(torch.randn(b, t, h, k, generator=gen))
    vv = torch.randn(b, t, h, v, generator=gen)
    g = -torch.rand(b, t, h, k, generator=gen) * decay
    beta = torch.rand(b, t, h, generator=gen)
    s0 = torch.randn(b, h, k, v, generator=gen)
    return q, kk, vv, g, beta, s0


def _run(lib, args, b, t, h, k, v):
    out = [tvm.runtime.empty((b, t, h, v), "float32"), tvm.runtime.empty((b, h, k, v), "float32")]
    lib["main"](*[tvm.runtime.tensor(x.numpy()) for x in args], *out)
    return out[0].numpy(), out[1].numpy()


# T = 1 (decode: the tail only), T < chunk, T a multiple of the chunk (no tail), long T with a tail; head and
# widths that are not the register blocks' multiples (K = 24: lanes of 8; V = 8, 24)
KDA_SHAPES = [(2, 1, 3, 16, 16), (1, 70, 2, 8, 24), (3, 9, 1, 24, 8), (2, 16, 2, 16, 16), (1, 5, 2, 16, 8),
              (1, 131, 1, 32, 32)]


@pytest.mark.parametrize("form", ["chunked", "recurrent"])
@pytest.mark.parametrize("b,t,h,k,v", KDA_SHAPES)
def test_kda_kernel_equals_the_recurrence(kda_lib, form, b, t, h, k, v):
    args = _inputs(b, t, h, k, v, seed=t)
    want_o, want_s = kda_recurrent(*args)
    o, s = _run(kda_lib(h, k, v, form), args, b, t, h, k, v)
    # fp32; the chunked kernel sums in another order (pair terms, S₀ products) and its exp is a polynomial with
    # ~1e-7 relative error (observed ≤ 2e-7)
    np.testing.assert_allclose(o, want_o.numpy(), rtol=0, atol=1e-5)
    np.testing.assert_allclose(s, want_s.numpy(), rtol=0, atol=1e-5)
    # and the op the model calls (chunked for t > 1): the same up to the chunked form's ~1e-6
    op_o, op_s = kda_recurrence(*args)
    np.testing.assert_allclose(o, op_o.numpy(), rtol=0, atol=1e-4)
    np.testing.assert_allclose(s, op_s.numpy(), rtol=0, atol=1e-4)


@pytest.mark.parametrize("chunk", [4, 16])
def test_kda_chunked_kernel_other_chunks_and_strong_decay(kda_lib, chunk):
    """Decays of up to e^-60 a step (γ over a chunk far below float32's range: only differences γ_t − γ_s ≤ 0 are
    exponentiated, so nothing overflows) and a zero decay."""
    b, t, h, k, v = 1, 37, 2, 16, 16
    args = list(_inputs(b, t, h, k, v, seed=chunk, decay=60.0))
    args[3][:, 3:9] = 0.0
    want_o, want_s = kda_recurrent(*args)
    o, s = _run(kda_lib(h, k, v, "chunked", chunk), args, b, t, h, k, v)
    assert np.isfinite(o).all() and np.isfinite(s).all()
    np.testing.assert_allclose(o, want_o.numpy(), rtol=0, atol=1e-5)  # fp32, as above
    np.testing.assert_allclose(s, want_s.numpy(), rtol=0, atol=1e-5)


@pytest.mark.parametrize("t", [5, 11])  # no whole chunk (the first step reads the input state); a chunk and a tail
@pytest.mark.parametrize("form", ["chunked", "recurrent"])
def test_kda_kernel_leaves_its_input_state_alone(kda_lib, form, t):
    args = _inputs(1, t, 2, 8, 8, seed=3)
    s0 = tvm.runtime.tensor(args[-1].numpy())
    out = [tvm.runtime.empty((1, t, 2, 8), "float32"), tvm.runtime.empty((1, 2, 8, 8), "float32")]
    kda_lib(2, 8, 8, form)["main"](*[tvm.runtime.tensor(x.numpy()) for x in args[:-1]], s0, *out)
    assert np.array_equal(s0.numpy(), args[-1].numpy())


@pytest.mark.parametrize("form,t", [("chunked", 7), ("recurrent", 12)])
def test_kda_tokens_one_call_at_a_time_are_the_same_bits_as_in_one_call(kda_lib, form, t):
    """Decode feeds a call's state to the next: stepping the tokens one call at a time (each step from its call's
    input state) gives the bits of one call over all of them (the first step from the input state, the rest on
    the state in place), below a whole chunk for the chunked kernel and for any length for the recurrent one."""
    b, h, k, v = 2, 2, 16, 24
    args = _inputs(b, t, h, k, v, seed=11)
    lib = kda_lib(h, k, v, form)
    o_all, s_all = _run(lib, args, b, t, h, k, v)
    state, outs = args[-1], []
    for i in range(t):
        o, s = _run(lib, [x[:, i:i + 1] for x in args[:-1]] + [state], b, 1, h, k, v)
        state = torch.from_numpy(s)
        outs.append(o)
    assert np.concatenate(outs, axis=1).tobytes() == o_all.tobytes()
    assert s.tobytes() == s_all.tobytes()


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


def test_kda_kernel_keeps_its_scratch_buffers_on_the_stack(kda_lib):
    """At 16 x 16 heads every scratch buffer of the chunked kernel (the chunk's rows, the register blocks, the pair
    sums, e and o of a token's step) is under 1 KiB: a stack slot, never an allocation from TVM's workspace pool per
    (batch, head) task, as each was in TVM's "local" scope (docs/toolchain.md, "Scratch buffers")."""
    from cpu_code import workspace_allocations

    assert workspace_allocations(kda_lib(2, 16, 16)) == 0


def test_pass_lowers_static_kda_calls_and_leaves_the_rest():
    from k3compile.passes import run_phases
    from k3compile.passes.lower_k3_calls import declined

    mod = run_phases(_module(2), upto="lower-k3-calls")
    lowered = str(mod["main"])
    assert 'call_dps_packed("k3.kda_recurrence"' not in lowered and "k3_kda_recurrence_2_8_8" in lowered
    assert 'call_dps_packed("k3.unknown"' in lowered  # no kernel: stays extern, and says so (the build refuses it)
    assert declined(mod) == {"k3.unknown": ["no kernel is written for this op"]}
    mod = run_phases(_module(tvm.tirx.Var("h", "int64")), upto="lower-k3-calls")
    assert 'call_dps_packed("k3.kda_recurrence"' in str(mod["main"])  # a head count that is not static: left alone
    assert declined(mod)["k3.kda_recurrence"] == ["the head count and widths (H, K, V) = (h, 8, 8) are not all static"]


# ---- the MoE dispatch with MXFP4 experts ----------------------------------------------------------------------------

def _moe_inputs(n, d, i, e, k, high, seed):
    from k3compile.quant.mx import quantize_mxfp4

    gen = torch.Generator().manual_seed(seed)
    z = torch.randn(n, d, generator=gen)
    idx = torch.randint(0, high, (n, k), generator=gen)
    w = torch.rand(n, k, generator=gen)
    (w13, s13), (w2, s2) = (quantize_mxfp4(torch.randn(e, 2 * i, d, generator=gen) * 0.1),
                            quantize_mxfp4(torch.randn(e, d, i, generator=gen) * 0.1))
    return [z, idx, w, w13, w2, s13, s2]


def _run_moe(args, e, i, d, offset, activation, act_quant="none", target=None):
    from k3compile.targets import resolve

    from k3compile.kernels.moe import expert_tiles, moe_kernel

    mx = len(args) == 7
    f = moe_kernel(e, i, d, offset, activation == "situ", 4.0, 25.0, act_quant, mx, target).with_attr(
        "global_symbol", "main")
    y = tvm.runtime.empty((args[0].shape[0], d), "float32")
    # the kernel reads the CPU target's column tiles: [E, out, in] -> [E, out / t, in, t]
    feeds = [x.numpy() for x in args[:3]] + [expert_tiles(x.numpy()) for x in args[3:]]
    if not mx:
        feeds += [np.zeros((1, 1, 1, 1), np.uint8)] * 2  # the scale placeholders
    tvm.compile(tvm.IRModule({"main": f}), target=resolve().tvm())["main"](*map(tvm.runtime.tensor, feeds), y)
    return y.numpy()


@pytest.mark.parametrize("n,d,i,e,k,offset,activation", [
    (1, 32, 32, 8, 2, 0, "situ"),     # one decoded token
    (5, 32, 64, 16, 2, 0, "situ"),    # 10 pairs, 16 experts: per-pair GEMVs
    (3, 64, 32, 12, 3, 2, "silu"),    # a slice [2, 14): tokens routed to 0, 1, 14, 15 weigh zero
    (25, 32, 32, 4, 2, 1, "situ"),    # 12 pairs an expert or more: grouped by expert (prefill, larger batches)
    (40, 96, 64, 5, 3, 2, "silu"),    # grouped, a slice [2, 7) with tokens outside it; 96 = three 32-blocks
])
def test_moe_kernel_equals_the_op(n, d, i, e, k, offset, activation):
    from k3compile.ops.latent_moe_dispatch import latent_moe_dispatch

    args = _moe_inputs(n, d, i, e, k, high=offset + e + 2, seed=n + offset)
    want = latent_moe_dispatch(*args, offset, activation, 4.0, 25.0, "none").numpy()
    # fp32; the same decoded weights, products summed in another order (observed ~2e-7)
    np.testing.assert_allclose(_run_moe(args, e, i, d, offset, activation), want, rtol=0, atol=1e-5)


@pytest.mark.parametrize("act_quant", ["e4m3", "e5m2"])
@pytest.mark.parametrize("n", [1, 24])  # per-pair GEMVs; grouped by expert
def test_moe_kernel_with_mxfp8_activations_equals_the_op(n, act_quant):
    from k3compile.ops.latent_moe_dispatch import latent_moe_dispatch

    d, i, e, k, offset = 64, 64, 4, 2, 1
    args = _moe_inputs(n, d, i, e, k, high=offset + e + 1, seed=n)
    args[0] = args[0] * torch.logspace(-3, 3, d)  # blocks of very different scales
    want = latent_moe_dispatch(*args, offset, "situ", 4.0, 25.0, act_quant).numpy()
    plain = latent_moe_dispatch(*args, offset, "situ", 4.0, 25.0, "none").numpy()
    assert np.abs(want - plain).max() > 1e-3  # the quantization shows in the output
    # fp32: the quantized activations are bit-exact (tests/unit/test_mx_kernels.py); products summed in another order
    np.testing.assert_allclose(_run_moe(args, e, i, d, offset, "situ", act_quant), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("n,act_quant", [(2, "none"), (30, "none"), (1, "e4m3"), (31, "e5m2")])
def test_moe_kernel_with_float_experts_equals_the_op(n, act_quant):
    from k3compile.ops.latent_moe_dispatch import latent_moe_dispatch

    d, i, e, k, offset = 64, 32, 5, 2, 2
    z, idx, w, *_ = _moe_inputs(n, d, i, e, k, high=offset + e + 2, seed=30 + n)
    gen = torch.Generator().manual_seed(n)
    w13, w2 = torch.randn(e, 2 * i, d, generator=gen) * 0.1, torch.randn(e, d, i, generator=gen) * 0.1
    args = [z, idx, w, w13, w2]
    want = latent_moe_dispatch(*args, None, None, offset, "situ", 4.0, 25.0, act_quant).numpy()
    # fp32, products summed in another order (the quantized activations bit-exact)
    np.testing.assert_allclose(_run_moe(args, e, i, d, offset, "situ", act_quant), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("n,d,i,e,k,offset,activation,act_quant", [
    (1, 32, 32, 8, 2, 0, "situ", "none"),    # gate-up tiles of 64 columns, down tiles of 32; per-pair GEMVs
    (4, 64, 64, 2, 2, 0, "situ", "none"),    # 64 and 64, per-pair GEMVs, two pairs of an expert a task: with
    # vpermps both GEMVs run in word order (kernels/mx.py: fp4_twice_words)
    (12, 64, 32, 3, 3, 2, "silu", "none"),   # 64 and 64, a slice [2, 5); grouped by expert
    (20, 96, 64, 5, 3, 2, "situ", "e4m3"),   # 64 and 32 (96 = three 32-blocks), MXFP8 activations; grouped
])
@pytest.mark.parametrize("lookup", ["vpermps", "pshufb"])
def test_moe_decode_looks_codes_up_in_a_register_bit_for_bit(n, d, i, e, k, offset, activation, act_quant, lookup,
                                                              monkeypatch):
    """On a CPU with a register lookup (kernels/mx.py: vpermps with AVX-512F, else PSHUFB's byte shuffles), the GEMVs
    and the grouped tiles look the E2M1 codes up; the output is the arithmetic decode's bit for bit (twice the
    values, half the scale: powers of two) and the op's within fp32 summation order. A NaN scale block still poisons
    its token. "pshufb" builds the kernel as for a CPU without AVX-512F (the 32-column tiles then take the byte
    shuffle, 64-column ones the bit operations)."""
    from k3compile.targets import resolve

    from k3compile.kernels import mx
    from k3compile.kernels.moe import column_tile
    from k3compile.ops.latent_moe_dispatch import latent_moe_dispatch

    cpu = resolve()
    if lookup == "vpermps" and not mx.fp4_permps(cpu):
        pytest.skip("this CPU has no AVX-512F")
    if lookup == "pshufb":
        monkeypatch.setattr(mx, "fp4_permps", lambda target: False)
    lanes = [mx.fp4_table_lanes(cpu, column_tile(t)) for t in (2 * i, d)]
    if not any(lanes):
        pytest.skip(f"{lookup}: no column tile of this case is looked up on this CPU")
    args = _moe_inputs(n, d, i, e, k, high=offset + e + 1, seed=50 + n)
    args[5] = args[5].clone()
    args[5][0, 0, 0] = 0xFF  # a NaN block in expert 0's first gate row
    table = _run_moe(args, e, i, d, offset, activation, act_quant, target=cpu)
    arithmetic = _run_moe(args, e, i, d, offset, activation, act_quant)
    assert table.tobytes() == arithmetic.tobytes()
    want = latent_moe_dispatch(*args, offset, activation, 4.0, 25.0, act_quant).numpy()
    np.testing.assert_array_equal(np.isnan(table), np.isnan(want))
    # fp32; the same decoded weights, products summed in another order (observed ~2e-7)
    np.testing.assert_allclose(table, want, rtol=1e-5, atol=1e-5)


@pytest.fixture(scope="module")
def moe_pairs_lib():
    """The CPU target's MXFP4 kernel (its lookup and prefetches) for 8 experts in the slice [1, 9), 64 x 32, top-2;
    N symbolic, so one build serves every batch."""
    from k3compile.targets import resolve

    from k3compile.kernels.moe import moe_kernel

    cpu = resolve()
    f = moe_kernel(8, 32, 64, 1, True, 4.0, 25.0, target=cpu).with_attr("global_symbol", "main")
    return tvm.compile(tvm.IRModule({"main": f}), target=cpu.tvm())["main"]


def _routed(lib, routes, seed):
    """moe_pairs_lib's inputs for tokens routed by `routes` (top-2 over ids 0-9, the slice [1, 9)), and run(rows):
    the kernel's output for those rows of the batch, in that order."""
    from k3compile.kernels.moe import expert_tiles

    args = _moe_inputs(len(routes), 64, 32, 8, 2, high=10, seed=seed)
    args[1] = torch.tensor(routes)
    tiles = [tvm.runtime.tensor(expert_tiles(x.numpy())) for x in args[3:]]

    def run(rows):
        y = tvm.runtime.empty((len(rows), 64), "float32")
        lib(*(tvm.runtime.tensor(x[rows].numpy()) for x in args[:3]), *tiles, y)
        return y.numpy()

    return args, run


@settings(max_examples=25, deadline=None)
@given(routes=st.lists(st.lists(st.integers(0, 9), min_size=2, max_size=2), min_size=1, max_size=9),
       seed=st.integers(0, 2**16))
def test_pairs_in_expert_order_give_each_token_its_own_bits(moe_pairs_lib, routes, seed):
    """Decode's per-pair path (below 10 tokens here) runs the pairs in expert order, two pairs of one expert in one
    task (each row decoded once for both): tokens sharing experts, routed outside the slice (0 and 9), or repeating
    one expert in both slots, each get the bits they get alone (neither the order of the tasks nor a second pair
    beside its own enters a token's sums), and the op's output within fp32 summation order."""
    from k3compile.kernels.moe import grouped
    from k3compile.ops.latent_moe_dispatch import latent_moe_dispatch

    n = len(routes)
    assert not grouped(n, 2, 8)
    args, run = _routed(moe_pairs_lib, routes, seed)
    together = run(list(range(n)))
    for t in range(n):
        assert together[t].tobytes() == run([t])[0].tobytes()
    want = latent_moe_dispatch(*args, 1, "situ", 4.0, 25.0, "none").numpy()
    # fp32; the same decoded weights, products summed in another order (observed ~2e-7)
    np.testing.assert_allclose(together, want, rtol=0, atol=1e-5)


@settings(max_examples=20, deadline=None)
@given(data=st.data(), n=st.integers(48, 60), seed=st.integers(0, 2**16))
def test_grouped_pairs_give_each_token_its_bits_in_any_batch_order(moe_pairs_lib, data, n, seed):
    """The grouped path (48 tokens and more here) multiplies each decoded tile by GROUP_PAIRS pairs of an expert at
    once and by the rest one at a time: which pairs share a group follows the batch's order, a token's bits do not
    (each pair's sums are the same expressions in the same order), and the output is the op's within fp32
    summation order."""
    from k3compile.kernels.moe import GROUP_PAIRS, grouped
    from k3compile.ops.latent_moe_dispatch import latent_moe_dispatch

    assert grouped(n, 2, 8) and GROUP_PAIRS > 1
    routes = data.draw(st.lists(st.lists(st.integers(0, 9), min_size=2, max_size=2), min_size=n, max_size=n))
    order = data.draw(st.permutations(range(n)))
    args, run = _routed(moe_pairs_lib, routes, seed)
    together, shuffled = run(list(range(n))), run(order)
    for i, t in enumerate(order):
        assert shuffled[i].tobytes() == together[t].tobytes()
    want = latent_moe_dispatch(*args, 1, "situ", 4.0, 25.0, "none").numpy()
    # fp32; the same decoded weights, products summed in another order (observed ~2e-7)
    np.testing.assert_allclose(together, want, rtol=0, atol=1e-5)


def test_the_cases_above_cover_both_kernel_paths():
    from k3compile.kernels.moe import grouped

    # (n, k, experts): test_moe_kernel_equals_the_op's, the MXFP8 and float-expert tests', the table test's
    assert [grouped(n, k, e) for n, k, e in [(1, 2, 8), (5, 2, 16), (3, 3, 12), (25, 2, 4), (40, 3, 5)]] == [
        False, False, False, True, True]
    assert [grouped(n, 2, 4) for n in (1, 24)] == [False, True]
    assert [grouped(n, 2, 5) for n in (2, 30, 1, 31)] == [False, True, False, True]
    assert [grouped(n, k, e) for n, k, e in [(1, 2, 8), (12, 3, 3), (20, 3, 5)]] == [False, True, True]


def test_moe_kernel_decodes_a_nan_scale_as_the_op_does():
    from k3compile.ops.latent_moe_dispatch import latent_moe_dispatch

    args = _moe_inputs(2, 32, 32, 2, 2, high=2, seed=7)
    args[1] = torch.tensor([[0, 1], [1, 1]])
    args[5] = args[5].clone()
    args[5][0, 0, 0] = 0xFF  # expert 0's first gate row: a NaN block
    got = _run_moe(args, 2, 32, 32, 0, "situ")
    want = latent_moe_dispatch(*args, 0, "situ", 4.0, 25.0, "none").numpy()
    assert np.isnan(got[0]).all() and np.isnan(want[0]).all()  # token 0 uses expert 0
    np.testing.assert_allclose(got[1], want[1], rtol=0, atol=1e-5)  # token 1 does not


def test_pass_lowers_the_moe_with_and_without_quantized_activations():
    from k3compile.passes import run_phases
    from tvm import relax

    def module(act_quant):
        n = tvm.tirx.Var("n", "int64")
        ts = [("z", [n, 32], "float32"), ("idx", [n, 2], "int64"), ("w", [n, 2], "float32"),
              ("w13", [4, 64, 16], "uint8"), ("w2", [4, 32, 16], "uint8"), ("s13", [4, 64, 1], "uint8"),
              ("s2", [4, 32, 1], "uint8")]
        ps = [relax.Var(name, relax.TensorType(shape, dt)) for name, shape, dt in ts]
        attrs = [relax.prim_value(tvm.tirx.IntImm("int64", 0)), tvm.ir.StringImm("situ"),
                 relax.prim_value(tvm.tirx.FloatImm("float64", 4.0)),
                 relax.prim_value(tvm.tirx.FloatImm("float64", 25.0)), tvm.ir.StringImm(act_quant)]
        bb = relax.BlockBuilder()
        with bb.function("main", ps):
            with bb.dataflow():
                out = bb.emit(relax.call_dps_packed("k3.latent_moe_dispatch_mxfp4", [*ps, *attrs],
                                                    relax.TensorType([n, 32], "float32")))
                gv = bb.emit_output(out)
            bb.emit_func_output(gv)
        return str(run_phases(bb.get(), upto="lower-k3-calls")["main"])

    for act_quant in ("none", "e4m3"):
        lowered = module(act_quant)
        assert "call_dps_packed" not in lowered
        assert f"k3_latent_moe_dispatch_mxfp4_4_32_32_0_situ_4p0_25p0_{act_quant}" in lowered
