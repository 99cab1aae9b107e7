"""The latent-MoE dispatch with MXFP4 (or float32) experts as a TIR kernel for CPU targets (docs/model.md, "Router and
latent MoE"; docs/mx.md; the layout choice: docs/toolchain.md, "CPU schedules").

Inputs: z [N, D], idx [N, k] int64, w [N, k], and the packed experts in the column-tiled layout the CPU target
stores (`expert_tiles`: phase 1 rearranges the k3 node's [E, rows, cols/2] arrays, phase 3 lifts that to compile
time): w13 [E, 2I/ta, D/2, ta] + scales [E, 2I/ta, D/32, ta], w2 [E, D/td, I/2, td] + scales [E, D/td, I/32, td]
(uint8; ta, td = `column_tile` of 2I and D, 64 for the presets) -> y [N, D] fp32, the pre-norm latent partial sum of
the expert slice [offset, offset + E). A tile's output columns are contiguous across a packed row, so each GEMV runs
over 64 output columns at a time as one vector, and a tile's rows follow each other, so a GEMV streams each tile
from memory in order (the transposed "kn" layout this replaced put a row's 64 bytes 1 KiB apart: 1.75x slower at
decode with the weights out of cache; docs/toolchain.md, "CPU schedules").

The kernel first lists the routed (token, slot) pairs by expert (a counting sort of idx: offsets per expert, then
the pairs in order; a pair routed outside the slice is in no list and weighs zero). With few pairs (decode), each
pair's expert runs two GEMVs:
    h        = W13[e] · z[n]                             (gate and up)
    h[:I]    = act(h[:I], h[I:])                         (SiTU or SiLU, in place)
    o[pair]  = w[n, j] · W2[e] · h[:I]
as parallel tasks over the pairs in expert order: a task runs its pair and, when the next pair is of the same
expert, that one too, decoding each packed row once for both (the decode costs more instructions than the FMAs);
the task of a pair so taken does nothing. Each pair's sums are the same expressions in the same order either way,
so a token's bits do not depend on what else is in the batch. Only the k selected experts' weights are read (the
sparse path). The outputs are then summed per token in slot order. When
there are at least GROUPED_AT times as many pairs as experts in the slice (`grouped`: prefill, larger batches;
pairs then share experts) it runs instead, in parallel over experts x column tiles, each 32-row weight block of an
expert that has pairs decoded once into a local tile (from the table where there is one, as the GEMVs) and applied
to every pair of the expert, GROUP_PAIRS pairs at a time (each tile row read once for them; the rest one by one),
each pair's block sum times the block's scale; the slot outputs are then summed per token in slot order. An
expert without pairs is not decoded. Every GEMV over MXFP4 codes asks the memory for the packed rows PREFETCH_ROWS
ahead as it decodes (the experts are cold at decode: each layer's are read once a step).

MXFP4 is decoded in the kernel from the integer codes, never with TVM's fp4/fp8 casts (wrong on llvm): of a nibble
(element 2p low, 2p+1 high), the magnitude code m = nib & 7 is m/2 for m < 2 and otherwise the float whose bits are
(m << 22) + (126 << 23) (1, 1.5, 2, 3, 4, 6), the sign bit is nib & 8; the E8M0 byte b gives 2^(b−127) by placing
b in a float's exponent bits (b = 0 is the fp32 subnormal 2^−127, b = 255 NaN). A block's 32 products are summed
first and multiplied by the block's scale once (kernels/mx.py). With MXFP8 activations (`act_quant` "e4m3" / "e5m2")
the kernel fake-quantizes z into a buffer first and the activation in place after SiTU / SiLU, in 32-wide blocks,
bit-exact with the op's torch arithmetic. Float32 experts (w13 [E, D, 2I], w2 [E, I, D] in the same layout) take
the same loops, a float read where a nibble is decoded and no scale.

D and I are whole 32-blocks (the reductions step by blocks): MXFP4 and MXFP8 are by their format, and phase 1
zero-pads float experts of other widths, z and y around the call (passes/lower_k3_calls.py; docs/architecture.md,
"The compile path").
"""

from __future__ import annotations

# Packed rows ahead of the one being decoded that a GEMV asks the memory for (8 KiB at 64-column tiles, the GEMMs'
# distance: targets/bf16_gemm.c). Without it the cold experts of a decode step streamed at ~8 GB/s on k3-small's
# shapes (docs/toolchain.md, "CPU schedules"); 64 and 256 rows measured as 128 did.
PREFETCH_ROWS = 128
# Pairs of one expert the grouped path multiplies by a decoded tile at once: their 3 x 4 accumulators in registers,
# each row of the tile read once for the three (k3-small's shapes, docs/toolchain.md "CPU schedules": 128 tokens
# 1.17x, 512 tokens 1.25x, 2048 tokens 1.27x against one pair at a time; 2 and 4 pairs slower than 3 at 512).
GROUP_PAIRS = 3
GROUPED_AT = 12  # pairs an expert (on average) from which the kernel groups them (`grouped`)


def grouped(tokens, top_k, experts):
    """Whether the kernel groups the routed pairs by expert (each weight block decoded once for all its pairs): when
    there are at least GROUPED_AT times as many pairs as experts in the slice. Measured on k3-small's shapes (32
    experts, top-4, 512 x 512, weights out of cache, 2 threads, docs/toolchain.md "CPU schedules") with the
    per-pair path's word-order decode and stack accumulators and the grouped path's GROUP_PAIRS, on the AMD EPYC
    (each path forced at every size, interleaved medians of 9, ms, per pair / grouped): 8 tokens 0.52 / 0.98, 32
    tokens 1.58 / 2.20, 48 tokens 2.28 / 2.77, 96 tokens 4.33 / 4.35, 128 tokens 5.77 / 5.19, 192 tokens 8.87 /
    8.27, 512 tokens 22.9 / 20.7: even at ~12 pairs an expert (5 before those changes: 40 tokens). Also the
    kernel's own branch (the sizes then TIR expressions)."""
    return tokens * top_k >= GROUPED_AT * experts


def column_tile(n: int) -> int:
    """The widest of 64, 32, ... 1 output columns that divides n (one vector run of a GEMV)."""
    return next(t for t in (64, 32, 16, 8, 4, 2, 1) if n % t == 0)


def expert_tiles(a):
    """An expert array in the op's orientation, [E, out, in] (numpy; packed codes, scales or float weights), as the
    CPU kernel reads it: [E, out/t, in, t], column tile t = `column_tile(out)` (module docstring). The pass builds
    the same rearrangement as Relax ops (passes/lower_k3_calls.py: `_expert_tiles`)."""
    import numpy as np

    e, out, inner = a.shape
    t = column_tile(out)
    return np.ascontiguousarray(a.reshape(e, out // t, t, inner).transpose(0, 1, 3, 2))


def moe_kernel(experts: int, inter: int, width: int, offset: int, situ: bool, beta: float, linear_beta: float,
               act_quant: str = "none", mx: bool = True, target=None):
    """The kernel for the sizes and attributes of one call; `mx`: MXFP4 experts, else float32 experts
    [E, 2I, D] / [E, D, I] (the two scale arguments then one-byte placeholders, never read); both in column tiles
    (`expert_tiles`). `target` (a CPU Target): where it can look E2M1 codes up in a register (kernels/mx.py: vpermps,
    else PSHUFB), the GEMVs and the grouped tiles do, a column tile at a time; the result is the same bit for bit."""
    from tvm import tirx
    from tvm.script import tirx as T

    from k3compile.kernels.mx import (
        e8m0,
        e8m0_words,
        fake_quant_block,
        fp4,
        fp4_permps,
        fp4_table,
        fp4_table_lanes,
        fp4_twice,
        fp4_twice_words,
        fp4_twice_x,
        from_words,
    )
    from k3compile.kernels.vector_math import sigmoid_f32, tanh_f32

    d2, i2, dblk, iblk = width // 2, inter // 2, width // 32, inter // 32
    ta, tb, td = column_tile(2 * inter), column_tile(inter), column_tile(width)  # column tiles of the three loops
    na, nb, nd = 2 * inter // ta, inter // tb, width // td
    la, ld = (fp4_table_lanes(target, t) if mx else 0 for t in (ta, td))  # lookup lanes of the two GEMVs (0: none)
    table_a, table_d = la > 0, ld > 0  # (the script's static conditions must be Python booleans)
    half_a, half_d = (0.5 if table else 1.0 for table in (table_a, table_d))  # a table holds twice the E2M1 values
    permps = fp4_permps(target)  # the table: 16 fp32 (vpermps) or 64 int8 (pshufb)
    words_a, words_d = (permps and lanes == 64 for lanes in (la, ld))  # GEMVs over 64-column tiles: word order
    entries, table_dtype = fp4_table(permps)

    wtype = "uint8" if mx else "float32"

    def looked(W, Tab, e, row, col0, lanes: int, high: int, words: bool = False):
        """Twice the E2M1 values of row `row` of expert e, columns [col0, col0 + lanes) (within one tile), from the
        table; `words`: the 64 columns of a tile in kernels/mx.py's WORD_ORDER (fp4_twice_words)."""
        tw = W.shape[3]
        codes = W[e, col0 // tw, row, tirx.Ramp(col0 % tw, 1, lanes)]
        if words:
            return fp4_twice_words(codes, Tab[tirx.Ramp(0, 1, 16)], high)
        return fp4_twice_x(codes, Tab[tirx.Ramp(0, 1, 16 if permps else lanes)], lanes, high, permps)

    def ahead(W, e, tile, row):
        """Asks the memory for the cache line PREFETCH_ROWS packed rows past row `row` of tile `tile` of expert e (a
        prefetch past the array's end is dropped, never a fault)."""
        return tirx.call_llvm_intrin("void", "llvm.prefetch.p0", tirx.address_of(W[e, tile, row + PREFETCH_ROWS, 0]),
                                     tirx.const(0, "int32"), tirx.const(3, "int32"), tirx.const(1, "int32"))

    def elem(W, e, b, p, col, high: int):
        """Row 32 b + 2 p + high of expert e's weight (a column of the output): an E2M1 nibble, or a float."""
        tw = W.shape[3]
        return fp4(W[e, col // tw, b * 16 + p, col % tw], high) if mx else W[e, col // tw, b * 32 + 2 * p + high,
                                                                              col % tw]

    def scale(S, e, b, col):
        return e8m0(S[e, col // S.shape[3], b, col % S.shape[3]]) if mx else tirx.const(1.0, "float32")

    def act(gate, up):
        """SiTU: β tanh(gate / β) σ(gate) · β_lin tanh(up / β_lin); else SiLU(gate) · up (ops/activations.py)."""
        if situ:
            return tirx.const(beta, "float32") * tanh_f32(gate / tirx.const(beta, "float32")) * sigmoid_f32(gate) * (
                tirx.const(linear_beta, "float32") * tanh_f32(up / tirx.const(linear_beta, "float32")))
        return gate * sigmoid_f32(gate) * up

    @T.macro
    def block_pairs(X, xdiv, Y, S, e, b, col0, tw, half, tile, acc, order, r, rows):
        """Y[f, col0 : col0 + tw] += (sum over c of X[f // xdiv, 32 b + c] · tile[c]) · the block's scale for the
        `rows` pairs f = order[r], order[r + 1], ...: each tile row read once for all of them, each pair's sum in c
        order whatever pairs run beside it."""
        for q in T.unroll(rows):
            for v in T.vectorized(tw):
                acc[q, v] = T.float32(0)
        for c in range(32):
            for q in T.unroll(rows):
                for v in T.vectorized(tw):
                    acc[q, v] = acc[q, v] + X[order[r + q] // xdiv, b * 32 + c] * tile[c, v]
        for q in T.unroll(rows):
            for v in T.vectorized(tw):
                Y[order[r + q], col0 + v] = Y[order[r + q], col0 + v] + acc[q, v] * (
                    scale(S, e, b, col0 + v) * T.float32(half))

    @T.macro
    def grouped_gemv(W, S, X, xdiv, Y, e, col0, tw, lanes, table, half, blocks, cnt, order, Tab):
        """Y[f, col0 : col0 + tw] = W[e] · X[f // xdiv] for every pair f routed to expert e (the grouped path): each
        32-row block of the tile decoded once (from the table when `table`: twice the values, `half` the scale's
        factor) and applied to GROUP_PAIRS pairs at a time (the rest one by one), each pair's block sum times the
        block's scale."""
        tile = T.alloc_buffer((32, tw), "float32")
        acc = T.alloc_buffer((GROUP_PAIRS, tw), "float32")  # under 1 KiB: on the stack (docs/toolchain.md)
        for r in range(cnt[e], cnt[e + 1]):
            for v in T.vectorized(tw):
                Y[order[r], col0 + v] = T.float32(0)
        for b in range(blocks):
            for p in range(16):
                if mx:
                    T.evaluate(ahead(W, e, col0 // tw, b * 16 + p))
                if table:
                    tile[2 * p, T.Ramp(0, 1, lanes)] = looked(W, Tab, e, b * 16 + p, col0, lanes, 0)
                    tile[2 * p + 1, T.Ramp(0, 1, lanes)] = looked(W, Tab, e, b * 16 + p, col0, lanes, 1)
                else:
                    for v in T.vectorized(tw):
                        tile[2 * p, v] = elem(W, e, b, p, col0 + v, 0)
                        tile[2 * p + 1, v] = elem(W, e, b, p, col0 + v, 1)
            whole = T.Bind((cnt[e + 1] - cnt[e]) // GROUP_PAIRS)
            for g in range(whole):
                block_pairs(X, xdiv, Y, S, e, b, col0, tw, half, tile, acc, order, cnt[e] + g * GROUP_PAIRS,
                            GROUP_PAIRS)
            for r in range(cnt[e] + whole * GROUP_PAIRS, cnt[e + 1]):
                block_pairs(X, xdiv, Y, S, e, b, col0, tw, half, tile, acc, order, r, 1)

    quantize = act_quant != "none"
    quant = fake_quant_block(act_quant) if quantize else None

    @T.macro
    def gemv(W, S, X, xdiv, Y, weighted, e, order, r, rows, tiles, tw, blocks, lanes, table, Tab, Wt, words):
        """Y[f] = W[e] · X[f // xdiv] (times the pair's weight Wt[f] when `weighted`) for the `rows` pairs f =
        order[r], order[r + 1], ... (all of expert e): each packed row decoded once for all of them; tile of tw
        columns, each block's sum times its scale (from the table when `table`: twice the values, the scale
        halved), a packed row added as (acc + lo · x0) + hi · x1, the arithmetic decode's order. A pair's sums are
        the same expressions in the same order whatever pair runs beside it (tests/unit/test_kernels.py: a token's
        bits do not depend on the batch). `words` (a 64-column tile looked up with vpermps): the sums run in
        kernels/mx.py's WORD_ORDER, the block's scales put in that order and the tile's result put back in column
        order when it is written: each column's arithmetic is the same, only its lane moves."""
        for t in range(tiles):
            acc = T.alloc_buffer((rows, tw), "float32")
            blk = T.alloc_buffer((rows, tw), "float32")
            for q in T.unroll(rows):
                for v in T.vectorized(tw):
                    acc[q, v] = T.float32(0)
            for b in range(blocks):
                for q in T.unroll(rows):
                    for v in T.vectorized(tw):
                        blk[q, v] = T.float32(0)
                if table:
                    for p in range(16):
                        T.evaluate(ahead(W, e, t, b * 16 + p))
                        lo = T.Bind(looked(W, Tab, e, b * 16 + p, t * tw, lanes, 0, words))
                        hi = T.Bind(looked(W, Tab, e, b * 16 + p, t * tw, lanes, 1, words))
                        for q in T.unroll(rows):
                            blk[q, T.Ramp(0, 1, lanes)] = blk[q, T.Ramp(0, 1, lanes)] + lo * T.Broadcast(
                                X[order[r + q] // xdiv, b * 32 + 2 * p], lanes) + hi * T.Broadcast(
                                X[order[r + q] // xdiv, b * 32 + 2 * p + 1], lanes)
                    if words:  # the block's scales read in word order as the codes were
                        sc = T.Bind(e8m0_words(S[e, t, b, T.Ramp(0, 1, tw)]) * T.Broadcast(T.float32(0.5), tw))
                        for q in T.unroll(rows):
                            acc[q, T.Ramp(0, 1, tw)] = acc[q, T.Ramp(0, 1, tw)] + blk[q, T.Ramp(0, 1, tw)] * sc
                    else:
                        for q in T.unroll(rows):
                            for v in T.vectorized(tw):
                                acc[q, v] = acc[q, v] + blk[q, v] * (scale(S, e, b, t * tw + v) * T.float32(0.5))
                else:
                    for p in range(16):
                        if mx:
                            T.evaluate(ahead(W, e, t, b * 16 + p))
                        for q in T.unroll(rows):
                            for v in T.vectorized(tw):
                                blk[q, v] = blk[q, v] + elem(W, e, b, p, t * tw + v, 0) * X[
                                    order[r + q] // xdiv, b * 32 + 2 * p] + elem(W, e, b, p, t * tw + v, 1) * X[
                                    order[r + q] // xdiv, b * 32 + 2 * p + 1]
                    for q in T.unroll(rows):
                        for v in T.vectorized(tw):
                            acc[q, v] = acc[q, v] + blk[q, v] * scale(S, e, b, t * tw + v)
            if words:  # the tile's result back in column order
                for q in T.unroll(rows):
                    if weighted:
                        for v in T.vectorized(tw):
                            acc[q, v] = Wt[order[r + q] // Wt.shape[1], order[r + q] % Wt.shape[1]] * acc[q, v]
                    Y[order[r + q], T.Ramp(t * tw, 1, tw)] = from_words(acc[q, T.Ramp(0, 1, tw)])
            else:
                for q in T.unroll(rows):
                    if weighted:
                        for v in T.vectorized(tw):
                            Y[order[r + q], t * tw + v] = Wt[order[r + q] // Wt.shape[1], order[r + q] % Wt.shape[
                                1]] * acc[q, v]
                    else:
                        for v in T.vectorized(tw):
                            Y[order[r + q], t * tw + v] = acc[q, v]

    @T.macro
    def activate(H, f):
        """Pair f's activation, in place in the gate half of H[f] (and its MXFP8 fake quantization, 32-wide blocks
        along I)."""
        for t in range(nb):
            for v in T.vectorized(tb):
                H[f, t * tb + v] = act(H[f, t * tb + v], H[f, inter + t * tb + v])
        if quantize:
            for hb in range(iblk):
                quant(H, H, f, hb * 32)

    @T.prim_func(private=True)
    def moe(z: T.handle, idx: T.handle, w: T.handle, w13: T.handle, w2: T.handle, s13: T.handle,
                  s2: T.handle, y: T.handle):
        T.func_attr({"tirx.noalias": True, "tirx.is_scheduled": True})
        N, K = T.int64(), T.int64()
        Z = T.match_buffer(z, (N, width), "float32")
        Idx = T.match_buffer(idx, (N, K), "int64")
        Wt = T.match_buffer(w, (N, K), "float32")
        W13 = T.match_buffer(w13, (experts, na, d2 if mx else width, ta), wtype)  # column tiles (expert_tiles)
        W2 = T.match_buffer(w2, (experts, nd, i2 if mx else inter, td), wtype)
        S13 = T.match_buffer(s13, (experts, na, dblk, ta) if mx else (1, 1, 1, 1), "uint8")
        S2 = T.match_buffer(s2, (experts, nd, iblk, td) if mx else (1, 1, 1, 1), "uint8")
        Y = T.match_buffer(y, (N, width), "float32")
        Zq = T.alloc_buffer((N, width) if quantize else (1,), "float32")
        if quantize:  # MXFP8 fake quantization of the expert input, 32-wide blocks along D
            for zb in T.parallel(N * dblk):
                quant(Z, Zq, zb // dblk, zb % dblk * 32)
        Zs = T.meta_var(Zq if quantize else Z)
        Tab = T.alloc_buffer((entries,), table_dtype)  # the E2M1 lookup table (fp4_twice), for the loops that use it
        if table_a or table_d:
            for i in range(entries):
                Tab[i] = fp4_twice(i, permps)
        cnt = T.alloc_buffer((experts + 1,), "int64")
        pos = T.alloc_buffer((experts,), "int64")
        order = T.alloc_buffer((N * K,), "int64")
        for e in range(experts + 1):
            cnt[e] = T.int64(0)
        for f in range(N * K):  # counting sort by expert: cnt = offsets, order = pairs n * K + j
            if Idx[f // K, f % K] >= offset and Idx[f // K, f % K] < offset + experts:
                cnt[Idx[f // K, f % K] - offset + 1] = cnt[Idx[f // K, f % K] - offset + 1] + T.int64(1)
        for e in range(experts):
            cnt[e + 1] = cnt[e + 1] + cnt[e]
            pos[e] = cnt[e]
        for f in range(N * K):
            if Idx[f // K, f % K] >= offset and Idx[f // K, f % K] < offset + experts:
                order[pos[Idx[f // K, f % K] - offset]] = f
                pos[Idx[f // K, f % K] - offset] = pos[Idx[f // K, f % K] - offset] + T.int64(1)
        if tirx.Not(grouped(N, K, experts)):  # few pairs: the routed pairs' two GEMVs on their experts
            H = T.alloc_buffer((N * K, 2 * inter), "float32")
            Po = T.alloc_buffer((N * K, width), "float32")  # each pair's weighted output
            for r in T.parallel(N * K):  # the pairs in expert order; a task runs pair r and, when the next pair is of
                if r < cnt[experts]:  # the same expert, that one too (each weight row decoded once for both); a
                    f = T.Bind(order[r])  # task whose pair the task before ran does nothing
                    e = T.Bind(Idx[f // K, f % K] - offset)
                    if (r - cnt[e]) % 2 == 0:
                        if r + 1 < cnt[e + 1]:  # h = W13[e] · z, h[:I] = act(h[:I], h[I:]), o = w · W2[e] · h[:I]
                            gemv(W13, S13, Zs, K, H, False, e, order, r, 2, na, ta, dblk, la, table_a, Tab, Wt, words_a)
                            activate(H, f)
                            activate(H, order[r + 1])
                            gemv(W2, S2, H, 1, Po, True, e, order, r, 2, nd, td, iblk, ld, table_d, Tab, Wt, words_d)
                        else:
                            gemv(W13, S13, Zs, K, H, False, e, order, r, 1, na, ta, dblk, la, table_a, Tab, Wt, words_a)
                            activate(H, f)
                            gemv(W2, S2, H, 1, Po, True, e, order, r, 1, nd, td, iblk, ld, table_d, Tab, Wt, words_d)
            for nt in T.parallel(N * nd):  # y = the pairs' outputs summed in slot order (outside the slice: none)
                for v in T.vectorized(td):
                    Y[nt // nd, nt % nd * td + v] = T.float32(0)
                for j in range(K):
                    if Idx[nt // nd, j] >= offset and Idx[nt // nd, j] < offset + experts:
                        for v in T.vectorized(td):
                            Y[nt // nd, nt % nd * td + v] = Y[nt // nd, nt % nd * td + v] + Po[
                                nt // nd * K + j, nt % nd * td + v]

        else:  # the routed (token, slot) pairs grouped by expert, each weight block decoded once
            G = T.alloc_buffer((N * K, 2 * inter), "float32")
            Out = T.alloc_buffer((N * K, width), "float32")
            for et in T.parallel(experts * na):  # g = W13[e] · z for every pair routed to e, tile of ta columns
                if cnt[et // na + 1] > cnt[et // na]:  # an expert no pair is routed to: nothing decoded
                    grouped_gemv(W13, S13, Zs, K, G, et // na, et % na * ta, ta, la, table_a, half_a, dblk, cnt, order,
                                 Tab)
            for rt in T.parallel(N * K * nb):  # the activation, in place (rows of pairs outside the slice unused)
                for v in T.vectorized(tb):
                    G[rt // nb, rt % nb * tb + v] = act(G[rt // nb, rt % nb * tb + v],
                                                        G[rt // nb, inter + rt % nb * tb + v])
            if quantize:
                for rb in T.parallel(N * K * iblk):
                    quant(G, G, rb // iblk, rb % iblk * 32)
            for et in T.parallel(experts * nd):  # o = w · W2[e] · act for every pair routed to e
                if cnt[et // nd + 1] > cnt[et // nd]:
                    grouped_gemv(W2, S2, G, 1, Out, et // nd, et % nd * td, td, ld, table_d, half_d, iblk, cnt, order,
                                 Tab)
            for nt in T.parallel(N * nd):  # y = sum over the slots in the slice, in slot order
                for v in T.vectorized(td):
                    Y[nt // nd, nt % nd * td + v] = T.float32(0)
                for j in range(K):
                    if Idx[nt // nd, j] >= offset and Idx[nt // nd, j] < offset + experts:
                        for v in T.vectorized(td):
                            Y[nt // nd, nt % nd * td + v] = Y[nt // nd, nt % nd * td + v] + Wt[
                                nt // nd, j] * Out[nt // nd * K + j, nt % nd * td + v]

    return moe
