"""The three k3 ops as thread-bound TIR kernels for the GPU targets (docs/architecture.md, "GPU targets"; the MX
arithmetic: docs/mx.md).

Each kernel binds its own threads (`blockIdx.x/y`, `threadIdx.x`; never `blockIdx.z`, which WebGPU lacks) and is
marked scheduled, so dlight leaves it alone. Every thread computes whole outputs: no shared memory, no cross-thread
reduction, so the same source is right on any workgroup size; the column axis is split into workgroups of `THREADS`
threads and a guard drops the threads past the end, so sizes need not divide the workgroup. The reductions run over
whole 32-blocks: phase 1 zero-pads float experts to them, and the matmul's N to a multiple of 4 for its scale words
(passes/lower_k3_calls.py; docs/architecture.md, "GPU targets").

The MXFP4 weights come in the GPU word layout (phase 1 repacks the op's uint8 arrays, phase 3 lifts that to compile
time): for an output column c and an input index k, the E2M1 code is nibble k % 8 of word [k / 8, c] and the E8M0
scale byte c % 4 of word [k / 32, c / 4], so the threads of a workgroup (consecutive columns) read consecutive words
and WGSL, which has no 8-bit integers, reads them as u32. Inside a 32-element block the products are summed first and
the sum multiplied by the scale, in the order of the CPU kernels (kernels/moe.py), so both builds agree to rounding.
exp / tanh / sigmoid are kernels/vector_math.py's arithmetic, the same as the CPU build's.

- `kda_gpu_kernel`: the KDA recurrence, one thread per state column (batch x head on blockIdx.x, column tiles on
  blockIdx.y); the thread holds its column S[:, j] in registers across all the tokens: decay, erase, write, read.
- `moe_up_gpu_kernel` / `moe_down_gpu_kernel`: the latent-MoE dispatch in two kernels, h[n, j] = act(W13[idx] z)
  for every routed (token, slot) pair (zero outside the expert slice), then y[n] = Σ_j w[n, j] W2[idx] h[n, j] over
  the slots in the slice, slot by slot.
- `mxfp4_matmul_gpu_kernel`: y = x · W for a packed weight, one thread per output element.
- `mxfp8_quant_gpu_kernel`: MXFP8 fake quantization of a [M, W] tensor's 32-wide blocks, one thread per block
  (kernels/mx.py's macro, bit-exact with the op's torch arithmetic); the MoE and matmul kernels read its output.
"""

from __future__ import annotations

THREADS = 64  # threads of a workgroup along the output columns


def _tiles(n: int, threads: int) -> int:
    return (n + threads - 1) // threads


def kda_gpu_kernel(heads: int, dk: int, dv: int, threads: int = THREADS):
    """q̂, k̂, g [B, T, H, K], v [B, T, H, V], β [B, T, H], state [B, H, K, V] -> o [B, T, H, V], present; the
    layout of the CPU kernel (kernels/kda.py)."""
    from tvm.script import tirx as T

    from k3compile.kernels.vector_math import exp_f32

    tiles = _tiles(dv, threads)

    @T.prim_func(private=True)
    def kda_gpu(q: T.handle, k: T.handle, v: T.handle, g: T.handle, beta: T.handle, state: T.handle,
                o: T.handle, present: T.handle):
        T.func_attr({"tirx.noalias": True, "tirx.is_scheduled": True})
        B, L = T.int64(), T.int64()
        Q = T.match_buffer(q, (B, L, heads, dk), "float32")
        K = T.match_buffer(k, (B, L, heads, dk), "float32")
        V = T.match_buffer(v, (B, L, heads, dv), "float32")
        G = T.match_buffer(g, (B, L, heads, dk), "float32")
        Beta = T.match_buffer(beta, (B, L, heads), "float32")
        S0 = T.match_buffer(state, (B, heads, dk, dv), "float32")
        Out = T.match_buffer(o, (B, L, heads, dv), "float32")
        S1 = T.match_buffer(present, (B, heads, dk, dv), "float32")
        for bh in T.thread_binding(B * heads, thread="blockIdx.x"):
            for jt in T.thread_binding(tiles, thread="blockIdx.y"):
                for jj in T.thread_binding(threads, thread="threadIdx.x"):
                    S = T.alloc_buffer((dk,), "float32", scope="local")
                    acc = T.alloc_buffer((1,), "float32", scope="local")
                    if jt * threads + jj < dv:
                        for i in range(dk):
                            S[i] = S0[bh // heads, bh % heads, i, jt * threads + jj]
                        for t in range(L):
                            acc[0] = T.float32(0)
                            for i in range(dk):  # decay the key rows, and e = k̂ᵀ S
                                S[i] = S[i] * exp_f32(G[bh // heads, t, bh % heads, i])
                                acc[0] = acc[0] + K[bh // heads, t, bh % heads, i] * S[i]
                            acc[0] = Beta[bh // heads, t, bh % heads] * (
                                V[bh // heads, t, bh % heads, jt * threads + jj] - acc[0])
                            for i in range(dk):  # write k̂ ⊗ u
                                S[i] = S[i] + K[bh // heads, t, bh % heads, i] * acc[0]
                            acc[0] = T.float32(0)
                            for i in range(dk):  # read Sᵀ q̂
                                acc[0] = acc[0] + S[i] * Q[bh // heads, t, bh % heads, i]
                            Out[bh // heads, t, bh % heads, jt * threads + jj] = acc[0]
                        for i in range(dk):
                            S1[bh // heads, bh % heads, i, jt * threads + jj] = S[i]

    return kda_gpu


def _weights(mx: bool):
    """(element, scale): the TIR reading the weight of expert `e` at input index 32 b + 8 w + p, column c."""
    from tvm import tirx

    from k3compile.kernels.mx import e8m0_word, fp4_word

    def element(W, e, b, w, p, c):
        return fp4_word(W[e, b * 4 + w, c], p) if mx else W[e, b * 32 + w * 8 + p, c]

    def scale(S, e, b, c):
        if not mx:
            return tirx.const(1.0, "float32")
        return e8m0_word(S[e, b, c // 4], c % 4)

    return element, scale


def moe_up_gpu_kernel(experts: int, inter: int, width: int, offset: int, situ: bool, beta: float,
                      linear_beta: float, mx: bool = True, threads: int = THREADS):
    """z [N, D], idx [N, k] int32, W13 [E, D/8, 2I] uint32 words + scales [E, D/32, 2I/4] (or float32 [E, D, 2I]
    and 1-word placeholders) -> h [N, k, I]: act(gate, up) of each routed pair, 0 for an expert outside
    [offset, offset + E)."""
    from tvm import tirx
    from tvm.script import tirx as T

    from k3compile.kernels.vector_math import sigmoid_f32, tanh_f32

    element, scale = _weights(mx)
    wtype, rows = ("uint32", width // 8) if mx else ("float32", width)
    dblk, tiles = width // 32, _tiles(inter, threads)

    def act(gate, up):
        if situ:  # ops/activations.py
            return tirx.const(beta, "float32") * tanh_f32(gate / tirx.const(beta, "float32")) * sigmoid_f32(gate) * (
                tirx.const(linear_beta, "float32") * tanh_f32(up / tirx.const(linear_beta, "float32")))
        return gate * sigmoid_f32(gate) * up

    @T.prim_func(private=True)
    def moe_up(z: T.handle, idx: T.handle, w13: T.handle, s13: T.handle, h: T.handle):
        T.func_attr({"tirx.noalias": True, "tirx.is_scheduled": True})
        N, K = T.int64(), T.int64()
        Z = T.match_buffer(z, (N, width), "float32")
        Idx = T.match_buffer(idx, (N, K), "int32")
        W13 = T.match_buffer(w13, (experts, rows, 2 * inter), wtype)
        S13 = T.match_buffer(s13, (experts, dblk, 2 * inter // 4) if mx else (1, 1, 1), "uint32")
        H = T.match_buffer(h, (N, K, inter), "float32")
        for nj in T.thread_binding(N * K, thread="blockIdx.x"):
            for ct in T.thread_binding(tiles, thread="blockIdx.y"):
                for cc in T.thread_binding(threads, thread="threadIdx.x"):
                    acc = T.alloc_buffer((2,), "float32", scope="local")  # gate, up
                    blk = T.alloc_buffer((2,), "float32", scope="local")
                    if ct * threads + cc < inter:
                        acc[0] = T.float32(0)
                        acc[1] = T.float32(0)
                        if Idx[nj // K, nj % K] >= offset and Idx[nj // K, nj % K] < offset + experts:
                            for b in range(dblk):
                                blk[0] = T.float32(0)
                                blk[1] = T.float32(0)
                                for w, p in T.grid(4, 4):
                                    for part in range(2):
                                        blk[part] = blk[part] + element(
                                            W13, Idx[nj // K, nj % K] - offset, b, w, 2 * p,
                                            part * inter + ct * threads + cc) * Z[nj // K, b * 32 + w * 8 + 2 * p] \
                                            + element(W13, Idx[nj // K, nj % K] - offset, b, w, 2 * p + 1,
                                                      part * inter + ct * threads + cc) * Z[
                                                nj // K, b * 32 + w * 8 + 2 * p + 1]
                                for part in range(2):
                                    acc[part] = acc[part] + blk[part] * scale(
                                        S13, Idx[nj // K, nj % K] - offset, b, part * inter + ct * threads + cc)
                            H[nj // K, nj % K, ct * threads + cc] = act(acc[0], acc[1])
                        else:
                            H[nj // K, nj % K, ct * threads + cc] = T.float32(0)

    return moe_up


def moe_down_gpu_kernel(experts: int, inter: int, width: int, offset: int, mx: bool = True,
                        threads: int = THREADS):
    """h [N, k, I], idx [N, k] int32, w [N, k], W2 [E, I/8, D] uint32 words + scales [E, I/32, D/4] (or float32
    [E, I, D]) -> y [N, D] = Σ over the slots in the slice of w · W2[idx] h, slot by slot."""
    from tvm.script import tirx as T

    element, scale = _weights(mx)
    wtype, rows = ("uint32", inter // 8) if mx else ("float32", inter)
    iblk, tiles = inter // 32, _tiles(width, threads)

    @T.prim_func(private=True)
    def moe_down(h: T.handle, idx: T.handle, wt: T.handle, w2: T.handle, s2: T.handle, y: T.handle):
        T.func_attr({"tirx.noalias": True, "tirx.is_scheduled": True})
        N, K = T.int64(), T.int64()
        H = T.match_buffer(h, (N, K, inter), "float32")
        Idx = T.match_buffer(idx, (N, K), "int32")
        Wt = T.match_buffer(wt, (N, K), "float32")
        W2 = T.match_buffer(w2, (experts, rows, width), wtype)
        S2 = T.match_buffer(s2, (experts, iblk, width // 4) if mx else (1, 1, 1), "uint32")
        Y = T.match_buffer(y, (N, width), "float32")
        for n in T.thread_binding(N, thread="blockIdx.x"):
            for ct in T.thread_binding(tiles, thread="blockIdx.y"):
                for cc in T.thread_binding(threads, thread="threadIdx.x"):
                    acc = T.alloc_buffer((1,), "float32", scope="local")
                    blk = T.alloc_buffer((1,), "float32", scope="local")
                    out = T.alloc_buffer((1,), "float32", scope="local")
                    if ct * threads + cc < width:
                        out[0] = T.float32(0)
                        for j in range(K):
                            if Idx[n, j] >= offset and Idx[n, j] < offset + experts:
                                acc[0] = T.float32(0)
                                for b in range(iblk):
                                    blk[0] = T.float32(0)
                                    for w, p in T.grid(4, 4):
                                        blk[0] = blk[0] + element(
                                            W2, Idx[n, j] - offset, b, w, 2 * p, ct * threads + cc) * H[
                                            n, j, b * 32 + w * 8 + 2 * p] + element(
                                            W2, Idx[n, j] - offset, b, w, 2 * p + 1, ct * threads + cc) * H[
                                            n, j, b * 32 + w * 8 + 2 * p + 1]
                                    acc[0] = acc[0] + blk[0] * scale(S2, Idx[n, j] - offset, b, ct * threads + cc)
                                out[0] = out[0] + Wt[n, j] * acc[0]
                        Y[n, ct * threads + cc] = out[0]

    return moe_down


def mxfp4_matmul_gpu_kernel(k: int, n: int, threads: int = THREADS):
    """x [M, K], w [K/8, N] uint32 words, scales [K/32, N/4] uint32 -> y [M, N]."""
    from tvm.script import tirx as T

    element, scale = _weights(True)
    kblk, tiles = k // 32, _tiles(n, threads)

    @T.prim_func(private=True)
    def mxfp4_matmul_gpu(x: T.handle, w: T.handle, s: T.handle, y: T.handle):
        T.func_attr({"tirx.noalias": True, "tirx.is_scheduled": True})
        M = T.int64()
        X = T.match_buffer(x, (M, k), "float32")
        W = T.match_buffer(w, (1, k // 8, n), "uint32")
        S = T.match_buffer(s, (1, kblk, n // 4), "uint32")
        Y = T.match_buffer(y, (M, n), "float32")
        for m in T.thread_binding(M, thread="blockIdx.x"):
            for ct in T.thread_binding(tiles, thread="blockIdx.y"):
                for cc in T.thread_binding(threads, thread="threadIdx.x"):
                    acc = T.alloc_buffer((1,), "float32", scope="local")
                    blk = T.alloc_buffer((1,), "float32", scope="local")
                    if ct * threads + cc < n:
                        acc[0] = T.float32(0)
                        for b in range(kblk):
                            blk[0] = T.float32(0)
                            for w, p in T.grid(4, 8):
                                blk[0] = blk[0] + X[m, b * 32 + w * 8 + p] * element(W, 0, b, w, p, ct * threads + cc)
                            acc[0] = acc[0] + blk[0] * scale(S, 0, b, ct * threads + cc)
                        Y[m, ct * threads + cc] = acc[0]

    return mxfp4_matmul_gpu


def mxfp8_quant_gpu_kernel(width: int, fmt: str, threads: int = THREADS):
    """x [M, W] -> the MXFP8 (`fmt`: "e4m3" / "e5m2") quantize-dequantize of its 32-wide blocks along W."""
    from tvm.script import tirx as T

    from k3compile.kernels.mx import fake_quant_block

    quant = fake_quant_block(fmt, vector=False)
    blocks = width // 32

    @T.prim_func(private=True)
    def mxfp8_quant(x: T.handle, xq: T.handle):
        T.func_attr({"tirx.noalias": True, "tirx.is_scheduled": True})
        M = T.int64()
        X = T.match_buffer(x, (M, width), "float32")
        Xq = T.match_buffer(xq, (M, width), "float32")
        for bt in T.thread_binding((M * blocks + threads - 1) // threads, thread="blockIdx.x"):
            for bb in T.thread_binding(threads, thread="threadIdx.x"):
                if bt * threads + bb < M * blocks:
                    quant(X, Xq, (bt * threads + bb) // blocks, (bt * threads + bb) % blocks * 32)

    return mxfp8_quant
