"""`k3.mxfp4_matmul` as a TIR kernel for CPU targets: x [M, K] times a packed MXFP4 weight, dequantized in the
kernel (docs/mx.md; the layout: docs/toolchain.md, "CPU schedules").

The weight comes in the "kn" layout the CPU target stores (phase 1 transposes the op's [N, K/2] codes and [N, K/32]
scales, phase 2 lifts that to compile time): w [K/2, N], scales [K/32, N] (uint8) -> y [M, N] fp32. In parallel over
tiles of output columns, each 32-row block of the tile is decoded once into a local buffer (integer and bit
operations, kernels/mx.py) and applied to every row of x; y's tile accumulates block by block, so the weight is read
once whatever M is. With `act_quant` ("e4m3" / "e5m2") x is first fake-quantized to MXFP8 in 32-wide blocks along
K, bit-exact with the op's torch arithmetic. M is symbolic (one kernel for every row count); K and N are static.
"""

from __future__ import annotations


def mxfp4_matmul_kernel(k: int, n: int, act_quant: str = "none"):
    from tvm.script import tirx as T

    from k3compile.kernels.moe import column_tile
    from k3compile.kernels.mx import e8m0, fake_quant_block, fp4

    tn, kblk = column_tile(n), k // 32
    ntiles = n // tn
    quantize = act_quant != "none"
    quant = fake_quant_block(act_quant) if quantize else None

    @T.prim_func(private=True)
    def mxfp4_matmul(x: T.handle, w: T.handle, s: T.handle, y: T.handle):
        T.func_attr({"tirx.noalias": True, "tirx.is_scheduled": True})
        M = T.int64()
        X = T.match_buffer(x, (M, k), "float32")
        W = T.match_buffer(w, (k // 2, n), "uint8")
        S = T.match_buffer(s, (kblk, n), "uint8")
        Y = T.match_buffer(y, (M, n), "float32")
        Xq = T.alloc_buffer((M, k) if quantize else (1,), "float32")
        if quantize:
            for mb in T.parallel(M * kblk):
                quant(X, Xq, mb // kblk, mb % kblk * 32)
        Xs = T.meta_var(Xq if quantize else X)
        for nt in T.parallel(ntiles):
            tile = T.alloc_buffer((32, tn), "float32")
            acc = T.alloc_buffer((tn,), "float32")
            for m in range(M):
                for v in T.vectorized(tn):
                    Y[m, nt * tn + v] = T.float32(0)
            for b in range(kblk):
                for p in range(16):
                    for v in T.vectorized(tn):
                        tile[2 * p, v] = fp4(W[b * 16 + p, nt * tn + v], 0) * e8m0(S[b, nt * tn + v])
                        tile[2 * p + 1, v] = fp4(W[b * 16 + p, nt * tn + v], 1) * e8m0(S[b, nt * tn + v])
                for m in range(M):
                    for v in T.vectorized(tn):
                        acc[v] = T.float32(0)
                    for c in range(32):
                        for v in T.vectorized(tn):
                            acc[v] = acc[v] + Xs[m, b * 32 + c] * tile[c, v]
                    for v in T.vectorized(tn):
                        Y[m, nt * tn + v] = Y[m, nt * tn + v] + acc[v]

    return mxfp4_matmul
