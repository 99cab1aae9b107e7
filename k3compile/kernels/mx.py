"""MX arithmetic as TIR expressions and macros for the CPU kernels (docs/mx.md): E2M1 nibbles and E8M0 scale bytes
decoded with integer and bit operations (never TVM's fp4/fp8 casts, wrong on llvm), and MXFP8 fake quantization of
a 32-element block, bit-exact with k3compile.quant.mx.fake_quant_mx (the FLOOR scale rule, round half to even,
saturation, a block with a non-finite element all NaN).
"""

from __future__ import annotations

from k3compile.kernels.vector_math import pow2
from k3compile.quant.mx import BLOCK, element_format


def fp4(byte, high: int):
    """The E2M1 value of the low (high=0) or high (high=1) nibble of `byte` (a uint8 expression): of the magnitude code
    m = nib & 7, m/2 for m < 2 and otherwise the float whose bits are (m << 22) + (126 << 23) (1, 1.5, 2, 3, 4, 6);
    the sign is nib & 8."""
    from tvm import tirx

    nib = tirx.bitwise_and(tirx.shift_right(byte, tirx.const(4 * high, "uint8")), tirx.const(15, "uint8"))
    mag = tirx.bitwise_and(nib, tirx.const(7, "uint8"))
    value = tirx.Select(
        mag < tirx.const(2, "uint8"), tirx.Cast("float32", mag) * tirx.const(0.5, "float32"),
        tirx.reinterpret("float32", tirx.shift_left(tirx.Cast("uint32", mag), tirx.const(22, "uint32"))
                         + tirx.const(126 << 23, "uint32")))
    sign = tirx.shift_left(tirx.Cast("uint32", tirx.bitwise_and(nib, tirx.const(8, "uint8"))),
                           tirx.const(28, "uint32"))
    return tirx.reinterpret("float32", tirx.bitwise_or(tirx.reinterpret("uint32", value), sign))


def e8m0(s):
    """2^(s-127) of an E8M0 byte expression: s in a float's exponent bits; 0 -> 2^-127, 255 -> NaN."""
    from tvm import tirx

    return tirx.Select(s == tirx.const(255, "uint8"), tirx.const(float("nan"), "float32"), tirx.Select(
        s == tirx.const(0, "uint8"), tirx.reinterpret("float32", tirx.const(0x00400000, "uint32")),
        tirx.reinterpret("float32", tirx.shift_left(tirx.Cast("uint32", s), tirx.const(23, "uint32")))))


def _exponent(x):
    """floor(log2 |x|) of a finite normal float32 expression from its exponent bits (a subnormal or 0 gives -127,
    inf and NaN 128; read from the bits because TVM's simplifier may fold a NaN test such as x != x)."""
    from tvm import tirx

    bits = tirx.bitwise_and(tirx.shift_right(tirx.reinterpret("int32", x), tirx.const(23, "int32")),
                            tirx.const(255, "int32"))
    return bits - tirx.const(127, "int32")


def fake_quant_block(fmt_name: str):
    """A T.macro(src, dst, row, col): dst[row, col : col + 32] = the MXFP8 (`fmt_name`: "e4m3" / "e5m2")
    quantize-dequantize of src[row, col : col + 32]. dst may be src (in place).

    Scale: 2^s with s = clamp(floor(log2 amax) − emax, −127, 127), exact as a product (a power of two); an amax that
    is 0 or an fp32 subnormal gives s = −127 either way, where every element rounds as in fake_quant_mx. Elements:
    m = |x| / 2^s, rounded to a multiple of 2^(max(floor(log2 m), emin) − mbits) (round half to even), clamped to the
    format's largest normal, signed as x."""
    from tvm import tirx
    from tvm.script import tirx as T

    fmt = element_format(fmt_name)

    @T.macro
    def quant(src, dst, row, col):
        amax = T.alloc_buffer((1,), "float32", scope="local")
        bad = T.alloc_buffer((1,), "int32", scope="local")
        amax[0] = T.float32(0)
        bad[0] = 0
        for i in range(BLOCK):
            amax[0] = T.max(amax[0], T.abs(src[row, col + i]))
            if _exponent(src[row, col + i]) == 128:  # inf or NaN (exponent bits all ones)
                bad[0] = 1
        shared = T.meta_var(T.max(T.min(_exponent(amax[0]) - fmt.emax, 127), -127))
        inv = T.meta_var(tirx.Select(shared == -127, T.float32(2.0**127), pow2(0 - shared)))
        scale = T.meta_var(tirx.Select(shared == -127, T.float32(2.0**-127), pow2(shared)))
        for i in T.vectorized(BLOCK):
            dst[row, col + i] = T.if_then_else(bad[0] == 1, T.float32(float("nan")), T.copysign(T.min(
                T.nearbyint(T.abs(src[row, col + i]) * inv * pow2(fmt.mbits - T.max(
                    _exponent(T.abs(src[row, col + i]) * inv), fmt.emin))) * pow2(T.max(
                        _exponent(T.abs(src[row, col + i]) * inv), fmt.emin) - fmt.mbits),
                T.float32(fmt.max_normal)), src[row, col + i]) * scale)

    return quant
