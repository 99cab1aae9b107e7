"""The latent-MoE dispatch with MXFP4 experts as a TIR kernel for CPU targets (docs/model.md, "Router and latent MoE";
docs/mx.md).

Layout as the k3 node has it: z [N, D], idx [N, k] int64, w [N, k], w13 packed [E, 2I, D/2] + scales [E, 2I, D/32],
w2 packed [E, D, I/2] + scales [E, D, I/32] (uint8) -> y [N, D] fp32, the pre-norm latent partial sum of the expert
slice [offset, offset + E). Per token, in parallel: for each of its k routed experts that lies in the slice, a GEMV
through W13 (gate and up), the activation, a GEMV through W2, weighted by the routing weight and accumulated; an
expert outside the slice weighs zero. Only the k selected experts are read (the sparse decode path); prefill runs the
same per-token GEMVs.

MXFP4 is decoded in the kernel from the integer codes, never with TVM's fp4/fp8 casts (wrong on llvm): a nibble
(element 2i low) indexes the 16 E2M1 values, and the E8M0 byte b gives 2^(b−127) by placing b in a float's exponent
bits (b = 0 is the fp32 subnormal 2^−127, b = 255 NaN). Activation quantization (MXFP8) is not in this kernel: such
calls stay with the reference implementation.
"""

from __future__ import annotations

from k3compile.quant.mx import FP4_VALUES


def moe_mxfp4_kernel(experts: int, inter: int, width: int, offset: int, situ: bool, beta: float, linear_beta: float):
    from tvm.script import tirx as T

    lut_values = [*FP4_VALUES, *(-v for v in FP4_VALUES)]
    d2, i2, dblk, iblk = width // 2, inter // 2, width // 32, inter // 32

    @T.prim_func(private=True)
    def moe_mxfp4(z: T.handle, idx: T.handle, w: T.handle, w13: T.handle, w2: T.handle, s13: T.handle,
                  s2: T.handle, y: T.handle):
        T.func_attr({"tirx.noalias": True})
        N, K = T.int64(), T.int64()
        Z = T.match_buffer(z, (N, width), "float32")
        Idx = T.match_buffer(idx, (N, K), "int64")
        Wt = T.match_buffer(w, (N, K), "float32")
        W13 = T.match_buffer(w13, (experts, 2 * inter, d2), "uint8")
        W2 = T.match_buffer(w2, (experts, width, i2), "uint8")
        S13 = T.match_buffer(s13, (experts, 2 * inter, dblk), "uint8")
        S2 = T.match_buffer(s2, (experts, width, iblk), "uint8")
        Y = T.match_buffer(y, (N, width), "float32")
        for n in T.parallel(N):
            lut = T.alloc_buffer((16,), "float32", scope="local")
            h = T.alloc_buffer((2 * inter,), "float32", scope="local")
            acc = T.alloc_buffer((1,), "float32", scope="local")
            lut[0] = T.float32(lut_values[0])
            lut[1] = T.float32(lut_values[1])
            lut[2] = T.float32(lut_values[2])
            lut[3] = T.float32(lut_values[3])
            lut[4] = T.float32(lut_values[4])
            lut[5] = T.float32(lut_values[5])
            lut[6] = T.float32(lut_values[6])
            lut[7] = T.float32(lut_values[7])
            lut[8] = T.float32(lut_values[8])
            lut[9] = T.float32(lut_values[9])
            lut[10] = T.float32(lut_values[10])
            lut[11] = T.float32(lut_values[11])
            lut[12] = T.float32(lut_values[12])
            lut[13] = T.float32(lut_values[13])
            lut[14] = T.float32(lut_values[14])
            lut[15] = T.float32(lut_values[15])
            for d in range(width):
                Y[n, d] = T.float32(0)
            for j in range(K):
                if Idx[n, j] >= offset and Idx[n, j] < offset + experts:
                    for r in range(2 * inter):  # h = W13[e] · z, dequantized block by block
                        h[r] = T.float32(0)
                        for blk in range(dblk):
                            for c in range(32):
                                h[r] = h[r] + lut[T.bitwise_and(T.shift_right(
                                    W13[Idx[n, j] - offset, r, blk * 16 + c // 2], T.uint8(4 * (c % 2))),
                                    T.uint8(15))] * Z[n, blk * 32 + c] * T.Select(
                                    S13[Idx[n, j] - offset, r, blk] == T.uint8(255), T.float32("nan"),
                                    T.Select(S13[Idx[n, j] - offset, r, blk] == T.uint8(0),
                                             T.reinterpret("float32", T.uint32(0x00400000)),
                                             T.reinterpret("float32", T.shift_left(
                                                 T.Cast("uint32", S13[Idx[n, j] - offset, r, blk]), T.uint32(23)))))
                    for r in range(inter):  # the activation, in place in the gate half
                        if situ:
                            h[r] = (T.float32(beta) * T.tanh(h[r] / T.float32(beta)) * T.sigmoid(h[r])) * (
                                T.float32(linear_beta) * T.tanh(h[inter + r] / T.float32(linear_beta)))
                        else:
                            h[r] = h[r] * T.sigmoid(h[r]) * h[inter + r]
                    for d in range(width):  # y += w · W2[e] · act
                        acc[0] = T.float32(0)
                        for blk in range(iblk):
                            for c in range(32):
                                acc[0] = acc[0] + lut[T.bitwise_and(T.shift_right(
                                    W2[Idx[n, j] - offset, d, blk * 16 + c // 2], T.uint8(4 * (c % 2))),
                                    T.uint8(15))] * h[blk * 32 + c] * T.Select(
                                    S2[Idx[n, j] - offset, d, blk] == T.uint8(255), T.float32("nan"),
                                    T.Select(S2[Idx[n, j] - offset, d, blk] == T.uint8(0),
                                             T.reinterpret("float32", T.uint32(0x00400000)),
                                             T.reinterpret("float32", T.shift_left(
                                                 T.Cast("uint32", S2[Idx[n, j] - offset, d, blk]), T.uint32(23)))))
                        Y[n, d] = Y[n, d] + Wt[n, j] * acc[0]

    return moe_mxfp4
