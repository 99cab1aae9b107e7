"""MLA's attention contractions as TIR kernels for CPU targets (docs/toolchain.md, "CPU schedules"; the phases that
place them: passes/lower_attention.py and, for decode caches kept in place, passes/inplace_caches.py).

MLA's absorbed form scores every query head against the shared latent cache, `einsum("bthc,bsc->bhts", q, k)`, and
the RoPE part the same way over its own width (`"bthr,bsr->bhts"`): a dot product over c (the latent width 128 /
512, the RoPE width 32 / 64) for every (token, head, position). TVM's generic schedule leaves that dot scalar (the
reduction is the innermost index of both operands, so no output dim is contiguous to vectorize over), which made it
a third of a 2048-token prefill. `scores_kernel` keeps a register tile of R heads × J cache positions, each a
16-lane partial sum along c, so every step loads R + J vectors for R · J fused multiply-adds; the lanes are summed
once at the end, all R · J vectors at once when they are 16 (`lane_sums`). Cache positions past the end (the last
tile) read the last row and are not stored. Parallel over batch × tokens × runs of TILES position tiles (a task's
indices divided out once, not per tile), every head group of a tile against the same J rows
(docs/toolchain.md, "CPU schedules"). k3-small, one layer at T = S = 2048: 2.1 s with TVM's schedule,
0.30 s with this one (the sum order along c differs: partial sums of 16 strided lanes, then the lanes). From
TRANSPOSE_AT tokens (a prefill) the lane sums cost about half as much as the FMAs (8 steps of 16 FMAs, then 15
shuffle pairs and adds for 16 outputs; at the RoPE width 2 steps), so such a call first copies the cache's rows
transposed ([B, width, S]: `transpose_rows`) and scores SPAN positions of R heads a task (`span_sums`): each step
along the width one broadcast of q per head times SPAN / 16 vectors of positions, R × SPAN / 16 accumulators and no
lane sums, each score summed in c order (other bits than the tiles', the same in both score kernels).
`masked_scores_kernel` is both score contractions, the scale and the mask in one pass (what MLA's softmax reads;
passes/lower_attention.py: fuse_masked_scores), skipping tiles the mask covers. `pv_kernel` is the weighted sum
that follows the softmax, `einsum("bhts,bsc->bthc", p, k)`: a register tile of R
heads × a few vectors of c, one broadcast weight per head and position.

Every kernel that reads the cache takes its length S as a scalar argument (a PrimValue after the tensors) and the cache
as a buffer of any capacity C >= S, of which it reads rows [0, S): the functional graph passes its concatenated
cache (C = S), the in-place function its preallocated buffer (docs/architecture.md, "In-place decode caches").
`write_rows_kernel` is that function's write: the T new rows at positions [P, P + T) of the buffer, in place.
"""

from __future__ import annotations

LANES = 16  # fp32 lanes of one partial sum (one AVX-512 register, two AVX2 ones)
POSITIONS = 4  # cache positions per register tile (J)
TILE_REGISTERS = 16  # accumulators a register tile may hold
TILES = 16  # register tiles of positions a task of the scores kernel runs in turn
# From this many tokens a call (prefill) scores against a transposed copy of the cache ([B, width, S]: a position's
# values a column), SPAN positions of R heads at a time, each step a broadcast of q times vectors of positions (a
# GEMM tile, no lane sums); fewer tokens (decode, short chunks) keep the tiles above, which read the cache as it is.
# The copy is a strided scalar pass over the cache, so few tokens against a long cache lose by it: masked scores of
# k3-small's 8 heads (128 + 32 wide), kernel alone, ms, tiles / transposed: T x S = 16 x 2048 0.92 / 1.33, 32 x 4096
# 3.57 / 3.88, 64 x 64 0.06 / 0.07, 96 x 96 0.14 / 0.15, 64 x 2048 5.64 / 5.03, 128 x 2048 11.0 / 8.8, 256 x 256
# 0.96 / 0.67, 1024 x 1024 15.9 / 10.8, 2048 x 2048 74.3 / 40.9.
TRANSPOSE_AT = 64
SPAN = 64  # positions of a transposed tile: two halves of 2 vectors (R x 2 accumulators each, under 1 KiB)


def lanes_of(width: int) -> int:
    """The vector of a kernel over `width` values: 16 lanes, or the largest power of two dividing width."""
    return next(n for n in (LANES, 8, 4, 2, 1) if width % n == 0)


def head_tile(heads: int) -> int:
    """R: the heads of a register tile (R · J accumulators, at most 16 registers with R + J loads a step)."""
    return next(r for r in (4, 2, 1) if heads % r == 0)


def lane_sums(acc, rows: int, cols: int, lanes: int):
    """One vector whose lane i is the sum of the lanes of acc[i // cols, i % cols, :] (rows · cols = lanes vectors):
    pairs of vectors halved and interleaved, log2(lanes) levels of two shuffles and an add each, where summing each
    vector alone takes log2(lanes) folds of it and a scalar store per sum. At level w (w lanes per partial sum) a
    vector holds lanes / w consecutive partial sums; a pair gives one vector of twice as many sums of w / 2 lanes."""
    from tvm import tirx

    level = [tirx.BufferLoad(acc, [tirx.const(i // cols, "int32"), tirx.const(i % cols, "int32"),
                                   tirx.Ramp(tirx.const(0, "int32"), 1, lanes)]) for i in range(rows * cols)]
    w = lanes
    while len(level) > 1:
        half, sums = w // 2, lanes // w
        lo = [v * lanes + g * w + x for v in (0, 1) for g in range(sums) for x in range(half)]
        hi = [i + half for i in lo]
        level = [tirx.Shuffle([a, b], [tirx.const(i, "int32") for i in lo])
                 + tirx.Shuffle([a, b], [tirx.const(i, "int32") for i in hi]) for a, b in zip(level[0::2], level[1::2])]
        w = half
    return level[0]


def tile_sums_macro(r_tile: int, j_tile: int):
    """A TVMScript macro, tile_sums(acc, sums, Q, K, b, t, g, s0, S, lanes, steps, transposed): for the R heads of
    group g and the J positions from s0, sums[r · J + j] = q[b, t, g · R + r, :] · k[b, s0 + j, :] as 16-lane
    partial sums along the width (acc, R × J × lanes), then their lanes: all at once (lane_sums) when `transposed`
    (R · J = lanes), else each vector folded in halves. The score kernels' one dot product (scores_kernel, and
    masked_scores_kernel's two parts), so their sums have the same order and the same bits."""
    from tvm.script import tirx as T

    tile = r_tile * j_tile

    @T.macro
    def tile_sums(acc, sums, Q, K, b, t, g, s0, S, lanes, steps, transposed):
        """sums[r · J + j] = q[b, t, g · R + r, :] · k[b, s0 + j, :] for the tile, as scores_kernel sums it:
        16-lane partial sums along the width, then the lanes (lane_sums, or each vector folded in halves)."""
        for r in T.unroll(r_tile):
            for j in T.unroll(j_tile):
                for v in T.vectorized(lanes):
                    acc[r, j, v] = T.float32(0)
        for c in range(steps):
            for r in T.unroll(r_tile):
                for j in T.unroll(j_tile):
                    for v in T.vectorized(lanes):
                        acc[r, j, v] = acc[r, j, v] + Q[b, t, g * r_tile + r, c * lanes + v] * K[
                            b, T.min(s0 + j, S - 1), c * lanes + v]
        if transposed:
            sums[T.Ramp(0, 1, tile)] = lane_sums(acc, r_tile, j_tile, lanes)
        else:
            for r in T.unroll(r_tile):
                for j in T.unroll(j_tile):
                    if lanes >= 16:
                        for v in T.vectorized(8):
                            acc[r, j, v] = acc[r, j, v] + acc[r, j, v + 8]
                    if lanes >= 8:
                        for v in T.vectorized(4):
                            acc[r, j, v] = acc[r, j, v] + acc[r, j, v + 4]
                    if lanes >= 4:
                        for v in T.vectorized(2):
                            acc[r, j, v] = acc[r, j, v] + acc[r, j, v + 2]
                    if lanes >= 2:
                        acc[r, j, 0] = acc[r, j, 0] + acc[r, j, 1]
                    sums[r * j_tile + j] = acc[r, j, 0]

    return tile_sums


def span_sums_macro(r_tile: int):
    """A TVMScript macro, span_sums(acc_a, acc_b, sums_a, sums_b, Q, KT, b, t, g, s0, width): for the R heads of
    group g and the SPAN positions from s0, sums_a[r, i] (first half) and sums_b[r, i] (second) = sum_c
    q[b, t, g · R + r, c] · kt[b, c, s0 + i] (kt the transposed cache: transpose_rows), the sum in c order, one lane
    per position: each step R broadcasts of q and SPAN / 16 vectors of kt for R · SPAN / 16 FMAs (acc_a, acc_b: R × 2
    vectors each, under 1 KiB apiece so that they stay in registers). The score kernels' prefill dot product
    (scores_kernel, masked_scores_kernel's two parts): the same bits in both."""
    from tvm.script import tirx as T

    vecs = SPAN // 2 // LANES

    @T.macro
    def span_sums(acc_a, acc_b, sums_a, sums_b, Q, KT, b, t, g, s0, width):
        for r in T.unroll(r_tile):
            for j in T.unroll(vecs):
                for v in T.vectorized(LANES):
                    acc_a[r, j, v] = T.float32(0)
                    acc_b[r, j, v] = T.float32(0)
        for c in range(width):
            for r in T.unroll(r_tile):
                for j in T.unroll(vecs):
                    for v in T.vectorized(LANES):
                        acc_a[r, j, v] = acc_a[r, j, v] + Q[b, t, g * r_tile + r, c] * KT[b, c, s0 + j * LANES + v]
                        acc_b[r, j, v] = acc_b[r, j, v] + Q[b, t, g * r_tile + r, c] * KT[
                            b, c, s0 + SPAN // 2 + j * LANES + v]
        for r in T.unroll(r_tile):
            for j in T.unroll(vecs):
                for v in T.vectorized(LANES):
                    sums_a[r, j * LANES + v] = acc_a[r, j, v]
                    sums_b[r, j * LANES + v] = acc_b[r, j, v]

    return span_sums


def transpose_rows_macro(width: int):
    """A TVMScript macro, transpose_rows(KT, K, b, s0, S): kt[b, c, s0 + i] = k[b, min(s0 + i, S − 1), c] for the SPAN
    positions from s0 (past the length: the last row, never stored from)."""
    from tvm.script import tirx as T

    @T.macro
    def transpose_rows(KT, K, b, s0, S):
        for i in range(SPAN):
            for c in range(width):
                KT[b, c, s0 + i] = K[b, T.min(s0 + i, S - 1), c]

    return transpose_rows


def scores_kernel(heads: int, width: int):
    """out[b, h, t, s] = sum_c q[b, t, h, c] · k[b, s, c] for s < S (the scalar argument), `heads` heads of `width`,
    batch, tokens, S and k's capacity C >= S symbolic."""
    from tvm.script import tirx as T

    r_tile, j_tile, lanes = head_tile(heads), POSITIONS, lanes_of(width)
    groups, steps = heads // r_tile, width // lanes
    transposed = r_tile * j_tile == lanes  # the tile's partial sums fill one vector of sums (lane_sums)
    tile_sums = tile_sums_macro(r_tile, j_tile)
    span_sums, transpose_rows = span_sums_macro(r_tile), transpose_rows_macro(width)

    @T.prim_func(private=True)
    def scores(q: T.handle, k: T.handle, S: T.int64, o: T.handle):
        T.func_attr({"tirx.noalias": True, "tirx.is_scheduled": True})
        B, Tn, C = T.int64(), T.int64(), T.int64()
        Q = T.match_buffer(q, (B, Tn, heads, width), "float32")
        K = T.match_buffer(k, (B, C, width), "float32")
        Out = T.match_buffer(o, (B, heads, Tn, S), "float32")
        assert S <= C, "attention scores: the cache holds fewer rows than its length"
        if Tn >= TRANSPOSE_AT:  # prefill: against the transposed cache, SPAN positions a task
            spans = T.meta_var((S + SPAN - 1) // SPAN)
            KT = T.alloc_buffer((B, width, spans * SPAN), "float32")
            for bs in T.parallel(B * spans):
                transpose_rows(KT, K, bs // spans, bs % spans * SPAN, S)
            for task in T.parallel(B * Tn * spans):
                acc_a = T.alloc_buffer((r_tile, SPAN // 2 // LANES, LANES), "float32")
                acc_b = T.alloc_buffer((r_tile, SPAN // 2 // LANES, LANES), "float32")
                sums_a = T.alloc_buffer((r_tile, SPAN // 2), "float32")
                sums_b = T.alloc_buffer((r_tile, SPAN // 2), "float32")
                b = T.meta_var(task // (Tn * spans))
                t = T.meta_var(task // spans % Tn)
                s0 = T.meta_var(task % spans * SPAN)
                for g in range(groups):
                    span_sums(acc_a, acc_b, sums_a, sums_b, Q, KT, b, t, g, s0, width)
                    for r in T.unroll(r_tile):
                        for i in range(SPAN // 2):
                            if s0 + i < S:
                                Out[b, g * r_tile + r, t, s0 + i] = sums_a[r, i]
                        for i in range(SPAN // 2):
                            if s0 + SPAN // 2 + i < S:
                                Out[b, g * r_tile + r, t, s0 + SPAN // 2 + i] = sums_b[r, i]
        else:
            for task in T.parallel(B * Tn * ((S + j_tile * TILES - 1) // (j_tile * TILES))):
                acc = T.alloc_buffer((r_tile, j_tile, lanes), "float32")
                sums = T.alloc_buffer((max(lanes, r_tile * j_tile),), "float32")
                chunks = T.meta_var((S + j_tile * TILES - 1) // (j_tile * TILES))
                b = T.meta_var(task // (Tn * chunks))
                t = T.meta_var(task // chunks % Tn)
                for tile in range(TILES):  # TILES tiles of J positions a task: its indices divided out once
                    s0 = T.meta_var((task % chunks * TILES + tile) * j_tile)
                    if s0 < S:
                        for g in range(groups):  # every head group against the same J rows of k (read once)
                            tile_sums(acc, sums, Q, K, b, t, g, s0, S, lanes, steps, transposed)
                            if transposed and s0 + j_tile <= S:  # the R · J sums one vector: R stores of J lanes
                                for r in T.unroll(r_tile):
                                    Out[b, g * r_tile + r, t, T.Ramp(s0, 1, j_tile)] = sums[
                                        T.Ramp(r * j_tile, 1, j_tile)]
                            else:
                                for r in T.unroll(r_tile):
                                    for j in T.unroll(j_tile):
                                        if s0 + j < S:
                                            Out[b, g * r_tile + r, t, s0 + j] = sums[r * j_tile + j]

    return scores


def masked_scores_kernel(heads: int, width: int, rope_width: int):
    """MLA's whole pre-softmax score in one pass: out[b, h, t, s] = fill where masked[b, 0, t, s], else
    (sum_c q[b, t, h, c] · k[b, s, c] + sum_r qr[b, t, h, r] · kr[b, s, r]) · scale, for s < S (the scalar
    argument; both caches of any capacity >= S), scale and fill 0-d tensors. What `scores_kernel` twice, then an add,
    a multiply and a where computed (passes/lower_attention.py: fuse_masked_scores rewrites that chain), with the
    same sums in the same order (so the same bits), written once instead of four passes over [B, H, T, S], and no
    product computed for a tile of J positions the mask covers entirely: in a causal prefill, the upper half."""
    from tvm.script import tirx as T

    r_tile, j_tile = head_tile(heads), POSITIONS
    lanes, lanes_r = lanes_of(width), lanes_of(rope_width)
    groups, steps, steps_r = heads // r_tile, width // lanes, rope_width // lanes_r
    tile = r_tile * j_tile
    transposed, transposed_r = tile == lanes, tile == lanes_r  # as scores_kernel decides, per part

    tile_sums = tile_sums_macro(r_tile, j_tile)
    span_sums = span_sums_macro(r_tile)
    transpose_rows, transpose_rope = transpose_rows_macro(width), transpose_rows_macro(rope_width)

    @T.prim_func(private=True)
    def masked_scores(q: T.handle, k: T.handle, qr: T.handle, kr: T.handle, m: T.handle, sc: T.handle,
                      fl: T.handle, S: T.int64, o: T.handle):
        T.func_attr({"tirx.noalias": True, "tirx.is_scheduled": True})
        B, Tn, C, CR = T.int64(), T.int64(), T.int64(), T.int64()
        Q = T.match_buffer(q, (B, Tn, heads, width), "float32")
        K = T.match_buffer(k, (B, C, width), "float32")
        QR = T.match_buffer(qr, (B, Tn, heads, rope_width), "float32")
        KR = T.match_buffer(kr, (B, CR, rope_width), "float32")
        Masked = T.match_buffer(m, (B, 1, Tn, S), "bool")
        Scale = T.match_buffer(sc, (), "float32")
        Fill = T.match_buffer(fl, (), "float32")
        Out = T.match_buffer(o, (B, heads, Tn, S), "float32")
        assert S <= C and S <= CR, "attention scores: a cache holds fewer rows than its length"
        if Tn >= TRANSPOSE_AT:  # prefill: against the transposed caches, SPAN positions a task
            spans = T.meta_var((S + SPAN - 1) // SPAN)
            KT = T.alloc_buffer((B, width, spans * SPAN), "float32")
            KRT = T.alloc_buffer((B, rope_width, spans * SPAN), "float32")
            for bs in T.parallel(B * spans):
                transpose_rows(KT, K, bs // spans, bs % spans * SPAN, S)
                transpose_rope(KRT, KR, bs // spans, bs % spans * SPAN, S)
            for task in T.parallel(B * Tn * spans):
                acc_a = T.alloc_buffer((r_tile, SPAN // 2 // LANES, LANES), "float32")
                acc_b = T.alloc_buffer((r_tile, SPAN // 2 // LANES, LANES), "float32")
                sums_a = T.alloc_buffer((r_tile, SPAN // 2), "float32")
                sums_b = T.alloc_buffer((r_tile, SPAN // 2), "float32")
                rope_a = T.alloc_buffer((r_tile, SPAN // 2), "float32")
                rope_b = T.alloc_buffer((r_tile, SPAN // 2), "float32")
                seen = T.alloc_buffer((1,), "int32")
                b = T.meta_var(task // (Tn * spans))
                t = T.meta_var(balanced(task // spans % Tn, Tn))
                s0 = T.meta_var(task % spans * SPAN)
                seen[0] = 0  # a position of the span the mask leaves open
                for i in range(SPAN):
                    if s0 + i < S:
                        if not Masked[b, 0, t, s0 + i]:
                            seen[0] = 1
                if seen[0] == 0:
                    for h in range(heads):
                        for i in range(SPAN):
                            if s0 + i < S:
                                Out[b, h, t, s0 + i] = Fill[()]
                else:
                    for g in range(groups):
                        span_sums(acc_a, acc_b, sums_a, sums_b, Q, KT, b, t, g, s0, width)
                        span_sums(acc_a, acc_b, rope_a, rope_b, QR, KRT, b, t, g, s0, rope_width)
                        for r in T.unroll(r_tile):
                            for i in range(SPAN // 2):
                                if s0 + i < S:
                                    Out[b, g * r_tile + r, t, s0 + i] = T.Select(
                                        Masked[b, 0, t, s0 + i], Fill[()], (sums_a[r, i] + rope_a[r, i]) * Scale[()])
                            for i in range(SPAN // 2):
                                if s0 + SPAN // 2 + i < S:
                                    Out[b, g * r_tile + r, t, s0 + SPAN // 2 + i] = T.Select(
                                        Masked[b, 0, t, s0 + SPAN // 2 + i], Fill[()],
                                        (sums_b[r, i] + rope_b[r, i]) * Scale[()])
        else:
            for task in T.parallel(B * Tn * ((S + j_tile * TILES - 1) // (j_tile * TILES))):
                acc = T.alloc_buffer((r_tile, j_tile, lanes), "float32")
                acc_r = T.alloc_buffer((r_tile, j_tile, lanes_r), "float32")
                sums = T.alloc_buffer((tile,), "float32")
                sums_r = T.alloc_buffer((tile,), "float32")
                chunks = T.meta_var((S + j_tile * TILES - 1) // (j_tile * TILES))
                b = T.meta_var(task // (Tn * chunks))
                t = T.meta_var(balanced(task // chunks % Tn, Tn))
                for tl in range(TILES):
                    s0 = T.meta_var((task % chunks * TILES + tl) * j_tile)
                    if s0 < S:
                        if tile_masked(Masked, b, t, s0, S, j_tile):
                            for h in range(heads):
                                for j in T.unroll(j_tile):
                                    if s0 + j < S:
                                        Out[b, h, t, s0 + j] = Fill[()]
                        else:
                            for g in range(groups):
                                tile_sums(acc, sums, Q, K, b, t, g, s0, S, lanes, steps, transposed)
                                tile_sums(acc_r, sums_r, QR, KR, b, t, g, s0, S, lanes_r, steps_r, transposed_r)
                                for r in T.unroll(r_tile):
                                    for j in T.unroll(j_tile):
                                        if s0 + j < S:
                                            Out[b, g * r_tile + r, t, s0 + j] = T.Select(
                                                Masked[b, 0, t, s0 + j], Fill[()],
                                                (sums[r * j_tile + j] + sums_r[r * j_tile + j]) * Scale[()])

    return masked_scores


def balanced(i, n):
    """The token a causal kernel's i-th row of tasks works on: 0, n − 1, 1, n − 2, ... TVM's parallel loop gives
    each thread a contiguous run of tasks, and a causal row's work grows with its token (the positions before it),
    so in token order the last thread got the most (~3:1 of two threads' work in a prefill); in this order every run
    of tasks pairs tokens from both ends and the threads' shares are even."""
    from tvm import tirx

    return tirx.Select(i % 2 == 0, i // 2, n - 1 - i // 2)


def tile_masked(masked, b, t, s0, length, positions: int):
    """Whether masked[b, 0, t, s] holds for every position s0 + j (j < positions) inside the length."""
    from tvm import tirx

    cond = None
    for j in range(positions):
        pos = s0 + j
        one = tirx.Or(pos >= length, tirx.BufferLoad(masked, [b, tirx.const(0, "int64"), t,
                                                              tirx.min(pos, length - 1)]))
        cond = one if cond is None else tirx.And(cond, one)
    return cond


def all_zero(p, b, h0, t, s, heads: int):
    """Whether the weights p[b, h0 + r, t, s] of the `heads` heads r of a tile are all exactly zero."""
    from tvm import tirx

    cond = p[b, h0, t, s] == tirx.const(0, "float32")
    for r in range(1, heads):
        cond = tirx.And(cond, p[b, h0 + r, t, s] == tirx.const(0, "float32"))
    return cond


def pv_kernel(heads: int, width: int):
    """out[b, t, h, c] = sum_{s < S} p[b, h, t, s] · k[b, s, c] (S the scalar argument; k of capacity C >= S), the
    sum in position order. A task holds R heads × V vectors of c in registers; each position loads V vectors of k
    and R weights. The sum stops after the last position where one of the R weights is not zero: a softmax over a
    causal mask gives exact zeros to every later position (e^(min − max) underflows), so a prefill's token t sums
    t + 1 positions, not S, and the result is the same bits (what is skipped adds +0 · k = +0 to the sum; the cache
    rows are finite). A fully padded row's weights are uniform, none zero: it sums every position, as before."""
    from tvm.script import tirx as T

    r_tile, lanes = head_tile(heads), lanes_of(width)
    vecs = width // lanes
    v_tile = next(v for v in range(min(vecs, TILE_REGISTERS // r_tile), 0, -1) if vecs % v == 0)
    groups, chunks = heads // r_tile, vecs // v_tile

    @T.prim_func(private=True)
    def pv(p: T.handle, k: T.handle, S: T.int64, o: T.handle):
        T.func_attr({"tirx.noalias": True, "tirx.is_scheduled": True})
        B, Tn, C = T.int64(), T.int64(), T.int64()
        P = T.match_buffer(p, (B, heads, Tn, S), "float32")
        K = T.match_buffer(k, (B, C, width), "float32")
        Out = T.match_buffer(o, (B, Tn, heads, width), "float32")
        assert S <= C, "attention output: the cache holds fewer rows than its length"
        for task in T.parallel(B * Tn * groups * chunks):
            acc = T.alloc_buffer((r_tile, v_tile, lanes), "float32")
            b = T.meta_var(task // (Tn * groups * chunks))
            t = T.meta_var(balanced(task // (groups * chunks) % Tn, Tn))
            h0 = T.meta_var(task // chunks % groups * r_tile)
            c0 = T.meta_var(task % chunks * v_tile * lanes)
            end = T.alloc_buffer((1,), "int64")
            for r in T.unroll(r_tile):
                for j in T.unroll(v_tile):
                    for v in T.vectorized(lanes):
                        acc[r, j, v] = T.float32(0)
            end[0] = S  # past the last position any of the R heads weighs: a causal row's zeros are not summed
            while T.if_then_else(end[0] > 0, all_zero(P, b, h0, t, end[0] - 1, r_tile), False):  # lazy: no P[-1]
                end[0] = end[0] - 1
            for s in range(end[0]):
                for r in T.unroll(r_tile):
                    for j in T.unroll(v_tile):
                        for v in T.vectorized(lanes):
                            acc[r, j, v] = acc[r, j, v] + P[b, h0 + r, t, s] * K[b, s, c0 + j * lanes + v]
            for r in T.unroll(r_tile):
                for j in T.unroll(v_tile):
                    for v in T.vectorized(lanes):
                        Out[b, t, h0 + r, c0 + j * lanes + v] = acc[r, j, v]

    return pv


def write_rows_kernel(width: int):
    """cache[b, P + t, :] = new[b, t, :] for the T new rows, in place (`call_tir_inplace`, the cache its output); P
    the scalar argument, refused at run time unless P + T <= the cache's capacity."""
    from tvm.script import tirx as T

    lanes = lanes_of(width)

    @T.prim_func(private=True)
    def write_rows(cache: T.handle, new: T.handle, P: T.int64):
        T.func_attr({"tirx.noalias": True, "tirx.is_scheduled": True})
        B, C, Tn = T.int64(), T.int64(), T.int64()
        Cache = T.match_buffer(cache, (B, C, width), "float32")
        New = T.match_buffer(new, (B, Tn, width), "float32")
        assert P + Tn <= C, "decode cache: the new rows do not fit its capacity"
        for row in T.parallel(B * Tn):
            for c in range(width // lanes):
                for v in T.vectorized(lanes):
                    Cache[row // Tn, P + row % Tn, c * lanes + v] = New[row // Tn, row % Tn, c * lanes + v]

    return write_rows


def softmax_kernel():
    """out[b, h, t, :] = softmax(x[b, h, t, :]) over the last (symbolic) axis, as TVM's softmax computes it: the row's
    max, e^(x − max) (kernels/vector_math.exp_f32, the exp every llvm build uses), their sum, the quotient; a row
    of −inf gives NaN as there. One row per task, 16 lanes at a time with a scalar tail: TVM's generic schedule of
    its four reductions ran serial per row, 17 % of a 2048-token prefill of k3-small (25 ns per element)."""
    from tvm.script import tirx as T

    from k3compile.kernels.vector_math import exp_f32

    lanes = LANES

    # A root block: TVM's RewriteDataflowReshape asks every kernel with one input of its output's size whether it is a
    # reshape, and that question reads the root block, which a kernel written without blocks lacks. The tirx
    # verifier does not know blocks (TE's kernels, which have them, are not verified either).
    @T.prim_func(private=True, check_well_formed=False)
    def softmax(x: T.handle, o: T.handle):
        T.func_attr({"tirx.noalias": True, "tirx.is_scheduled": True})
        B, H, Tn, S = T.int64(), T.int64(), T.int64(), T.int64()
        X = T.match_buffer(x, (B, H, Tn, S), "float32")
        Y = T.match_buffer(o, (B, H, Tn, S), "float32")
        with T.sblock("root"):
            for row in T.parallel(B * H * Tn):
                part = T.alloc_buffer((lanes,), "float32")
                total = T.alloc_buffer((1,), "float32")
                b = T.meta_var(row // (H * Tn))
                h = T.meta_var(row // Tn % H)
                t = T.meta_var(row % Tn)
                whole = T.meta_var(S // lanes * lanes)
                for v in T.vectorized(lanes):  # the max: lane-wise over whole vectors, then the lanes and the tail
                    part[v] = X[b, h, t, 0]
                for c in range(S // lanes):
                    for v in T.vectorized(lanes):
                        part[v] = T.max(part[v], X[b, h, t, c * lanes + v])
                total[0] = X[b, h, t, 0]
                for v in range(lanes):
                    total[0] = T.max(total[0], part[v])
                for i in range(S - whole):
                    total[0] = T.max(total[0], X[b, h, t, whole + i])
                for c in range(S // lanes):  # e^(x - max), kept in the output
                    for v in T.vectorized(lanes):
                        Y[b, h, t, c * lanes + v] = exp_f32(X[b, h, t, c * lanes + v] - total[0])
                for i in range(S - whole):
                    Y[b, h, t, whole + i] = exp_f32(X[b, h, t, whole + i] - total[0])
                for v in T.vectorized(lanes):  # their sum
                    part[v] = T.float32(0)
                for c in range(S // lanes):
                    for v in T.vectorized(lanes):
                        part[v] = part[v] + Y[b, h, t, c * lanes + v]
                total[0] = T.float32(0)
                for v in range(lanes):
                    total[0] = total[0] + part[v]
                for i in range(S - whole):
                    total[0] = total[0] + Y[b, h, t, whole + i]
                for c in range(S // lanes):  # the quotient
                    for v in T.vectorized(lanes):
                        Y[b, h, t, c * lanes + v] = Y[b, h, t, c * lanes + v] / total[0]
                for i in range(S - whole):
                    Y[b, h, t, whole + i] = Y[b, h, t, whole + i] / total[0]

    return softmax
