"""MX arithmetic as TIR expressions and macros for the kernels (docs/mx.md): E2M1 nibbles and E8M0 scale bytes
decoded with integer and bit operations (never TVM's fp4/fp8 casts, wrong on llvm), and MXFP8 fake quantization of
a 32-element block, bit-exact with k3compile.quant.mx.fake_quant_mx (the FLOOR scale rule, round half to even,
saturation, a block with a non-finite element all NaN).
"""

from __future__ import annotations

from k3compile.kernels.vector_math import pow2
from k3compile.quant.mx import BLOCK, element_format

NAN_BITS = 0x7FC00000  # the quiet NaN, made at run time from a flag (a non-finite constant is not portable)


def _fp4_code(nib):
    """The E2M1 value of a nibble expression (any unsigned integer type, value 0..15): of the magnitude code
    m = nib & 7, m/2 for m < 2 and otherwise the float whose bits are (m << 22) + (126 << 23) (1, 1.5, 2, 3, 4, 6);
    the sign is nib & 8."""
    from tvm import tirx

    it = str(nib.ty)
    mag = tirx.bitwise_and(nib, tirx.const(7, it))
    value = tirx.Select(
        mag < tirx.const(2, it), tirx.Cast("float32", mag) * tirx.const(0.5, "float32"),
        tirx.reinterpret("float32", tirx.shift_left(tirx.Cast("uint32", mag), tirx.const(22, "uint32"))
                         + tirx.const(126 << 23, "uint32")))
    sign = tirx.shift_left(tirx.Cast("uint32", tirx.bitwise_and(nib, tirx.const(8, it))), tirx.const(28, "uint32"))
    return tirx.reinterpret("float32", tirx.bitwise_or(tirx.reinterpret("uint32", value), sign))


def fp4(byte, high: int):
    """The E2M1 value of the low (high=0) or high (high=1) nibble of `byte` (a uint8 expression)."""
    from tvm import tirx

    return _fp4_code(tirx.bitwise_and(tirx.shift_right(byte, tirx.const(4 * high, "uint8")), tirx.const(15, "uint8")))


# In-register lookup of E2M1 codes (docs/mx.md, "Decoding on the CPU"). Twice each E2M1 value is whole ({0, 1, 2,
# 3, 4, 6, 8, 12} and negatives); the halving goes into the block's scale (a power of two: the result is bit for bit
# the arithmetic decode's). With AVX-512F the 16 values sit as fp32 in one register and `vpermps` picks them by each
# 32-bit lane's low 4 bits: a weight byte widened to 32 bits gives its low nibble's value directly, shifted right by
# 4 its high nibble's (no mask, no int8 -> fp32 conversion), 16 columns an instruction. Without it, x86's byte
# shuffle (pshufb) reads an int8 table per 128-bit lane by each byte's low 4 bits, `lanes` codes at once, widened
# to fp32 after; a CPU with neither decodes with the bit operations above (about ten an element).
PERMPS = ("avx512f", "llvm.x86.avx512.permvar.sf.512")  # (LLVM CPU feature, intrinsic)
PSHUFB = {32: ("avx2", "llvm.x86.avx2.pshuf.b"), 16: ("ssse3", "llvm.x86.ssse3.pshuf.b.128")}  # lanes -> same
# (64-lane pshufb is AVX-512BW, which comes with AVX-512F: such a CPU takes vpermps)


def fp4_permps(target) -> bool:
    """Whether `target` (a k3compile Target, or None) looks E2M1 codes up with vpermps (AVX-512F)."""
    return target is not None and target.kind == "llvm" and target.has_feature(PERMPS[0])


def fp4_table_lanes(target, lanes: int) -> int:
    """`lanes` when `target` (a k3compile Target, or None) is a CPU that can look up `lanes` E2M1 codes from a table
    (vpermps: lanes a multiple of 16; else PSHUFB's widths), else 0 (the kernel decodes with bit operations)."""
    if lanes % 16 == 0 and fp4_permps(target):
        return lanes
    if target is None or target.kind != "llvm" or lanes not in PSHUFB:
        return 0
    return lanes if target.has_feature(PSHUFB[lanes][0]) else 0


def fp4_table(permps: bool) -> tuple[int, str]:
    """The lookup table's (entries, dtype): 16 fp32 for vpermps, 64 int8 for pshufb (16 per 128-bit lane)."""
    return (16, "float32") if permps else (64, "int8")


def fp4_twice(i, permps: bool = False):
    """Entry i (an integer expression, 0..63) of the lookup table: twice the E2M1 value of code i % 16, as int8 (as
    fp32 for vpermps)."""
    from tvm import tirx

    code = tirx.Cast("uint8", tirx.floormod(i, 16))
    return tirx.Cast("float32" if permps else "int8", _fp4_code(code) * tirx.const(2.0, "float32"))


def fp4_twice_x(byte_vec, table_vec, lanes: int, high: int, permps: bool = False):
    """Twice the E2M1 values of the low (high=0) or high (high=1) nibbles of `byte_vec` (uint8 x lanes), looked up in
    `table_vec` (`fp4_table`: fp32 x 16 for vpermps, 16 lanes at a time; else int8 x lanes), as float32 x lanes."""
    from tvm import tirx

    if permps:
        parts = []
        for g in range(lanes // 16):
            piece = byte_vec if lanes == 16 else tirx.Shuffle([byte_vec], [tirx.const(16 * g + i, "int32")
                                                                          for i in range(16)])
            index = tirx.Cast("int32x16", piece)  # zero-extended: vpermps reads the low 4 bits
            if high:
                index = tirx.shift_right(index, tirx.Broadcast(tirx.const(4, "int32"), 16))
            parts.append(tirx.call_llvm_pure_intrin("float32x16", PERMPS[1], table_vec, index))
        return parts[0] if lanes == 16 else _lanes(parts, range(lanes))
    if high:
        nib = tirx.shift_right(byte_vec, tirx.Broadcast(tirx.const(4, "uint8"), lanes))
    else:
        nib = tirx.bitwise_and(byte_vec, tirx.Broadcast(tirx.const(15, "uint8"), lanes))
    looked = tirx.call_llvm_pure_intrin(f"int8x{lanes}", PSHUFB[lanes][1], table_vec,
                                        tirx.reinterpret(f"int8x{lanes}", nib))
    return tirx.Cast(f"float32x{lanes}", looked)


# Where the tile is 64 columns, the GEMVs skip even that widening: the row's 64 bytes read as 16 32-bit words, word i
# holding columns 4i .. 4i + 3 (one byte each, low nibble first); shifted right by 8g (+ 4 for the high nibbles) its
# low 4 bits are column 4i + g's code, which vpermps reads. Eight lookups and seven shifts a row where the widening
# took four extracts, four widenings, four shifts and eight lookups; the values come out in WORD_ORDER (position
# 16g + i holds column 4i + g), which the GEMV keeps through its sums and undoes once per tile (kernels/moe.py).
WORD_ORDER = [4 * (j % 16) + j // 16 for j in range(64)]  # position -> the column it holds


def _lanes(vectors, picks):
    """The vector whose lane j is lane picks[j] of `vectors` laid end to end (a TIR Shuffle)."""
    from tvm import tirx

    return tirx.Shuffle(list(vectors), [tirx.const(j, "int32") for j in picks])


def fp4_twice_words(byte_vec, table_vec, high: int):
    """Twice the E2M1 values of the low (high=0) or high (high=1) nibbles of a 64-column packed row (`byte_vec`:
    uint8 x 64) looked up in `table_vec` (fp32 x 16, vpermps), as float32 x 64 in WORD_ORDER."""
    from tvm import tirx

    word = tirx.reinterpret("int32x16", byte_vec)
    parts = []
    for g in range(4):
        shift = 8 * g + 4 * high
        index = word if shift == 0 else tirx.shift_right(word, tirx.Broadcast(tirx.const(shift, "int32"), 16))
        parts.append(tirx.call_llvm_pure_intrin("float32x16", PERMPS[1], table_vec, index))
    return _lanes(parts, range(64))


def e8m0_words(byte_vec):
    """The scales of a 64-column tile's block (`byte_vec`: its 64 E8M0 bytes, uint8 x 64) as float32 x 64 in
    WORD_ORDER, read as fp4_twice_words reads the codes: byte g of word i is column 4i + g's."""
    from tvm import tirx

    word = tirx.reinterpret("uint32x16", byte_vec)
    return _lanes([e8m0_word(word, g) for g in range(4)], range(64))


def from_words(vec):
    """A 64-lane vector in WORD_ORDER put back in column order (lane c of the result: column c)."""
    return _lanes([vec], sorted(range(64), key=WORD_ORDER.__getitem__))


def _u32(value):
    """A uint32 shift amount from a Python int or an integer expression."""
    from tvm import tirx

    return tirx.const(value, "uint32") if isinstance(value, int) else tirx.Cast("uint32", value)


def fp4_word(word, i):
    """The E2M1 value of nibble i (an int or an expression; 0 = lowest bits) of `word`, a uint32 expression holding
    eight codes: the word layout of the GPU targets (docs/mx.md, "Packed layouts"), WGSL having no 8-bit integers."""
    from tvm import tirx

    return _fp4_code(tirx.bitwise_and(tirx.shift_right(word, _u32(4 * i)), tirx.const(15, "uint32")))


def e8m0(s):
    """2^(s-127) of an E8M0 code (a uint8 expression, or a uint32 one in 0..255; scalar or vector): s in a float's
    exponent bits; 0 -> 2^-127, 255 -> NaN."""
    from tvm import tirx

    it = str(s.ty)
    scalar, _, n = it.partition("x")  # a vector's "uint8x16": "uint8", "16"
    lanes = "x" + n if n else ""

    def const(value, dtype):
        c = tirx.const(value, dtype)
        return tirx.Broadcast(c, int(n)) if n else c

    u32 = tirx.Cast("uint32" + lanes, s)
    f32 = "float32" + lanes
    # 255: the quiet NaN made from s at run time (a non-finite constant is not portable: kernels/vector_math.py)
    return tirx.Select(s == const(255, scalar), tirx.reinterpret(f32, tirx.bitwise_or(tirx.shift_left(
        u32, const(23, "uint32")), const(0x400000, "uint32"))), tirx.Select(
        s == const(0, scalar), tirx.reinterpret(f32, const(0x00400000, "uint32")),
        tirx.reinterpret(f32, tirx.shift_left(u32, const(23, "uint32")))))


def e8m0_word(word, i):
    """The scale of byte i (0 = lowest bits) of `word`, a uint32 expression holding four E8M0 codes."""
    from tvm import tirx

    return e8m0(tirx.bitwise_and(tirx.shift_right(word, _u32(8 * i)), tirx.const(255, "uint32")))


def _exponent(x):
    """floor(log2 |x|) of a finite normal float32 expression from its exponent bits (a subnormal or 0 gives -127,
    inf and NaN 128; read from the bits because TVM's simplifier may fold a NaN test such as x != x)."""
    from tvm import tirx

    bits = tirx.bitwise_and(tirx.shift_right(tirx.reinterpret("int32", x), tirx.const(23, "int32")),
                            tirx.const(255, "int32"))
    return bits - tirx.const(127, "int32")


def _signed_as(magnitude, x):
    """`magnitude` (>= 0) with the sign bit of x: copysign from the bits (WGSL has no copysign)."""
    from tvm import tirx

    return tirx.reinterpret("float32", tirx.bitwise_or(tirx.reinterpret("uint32", magnitude), tirx.bitwise_and(
        tirx.reinterpret("uint32", x), tirx.const(0x80000000, "uint32"))))


def fake_quant_block(fmt_name: str, vector: bool = True):
    """A T.macro(src, dst, row, col): dst[row, col : col + 32] = the MXFP8 (`fmt_name`: "e4m3" / "e5m2")
    quantize-dequantize of src[row, col : col + 32]. dst may be src (in place).

    Scale: 2^s with s = clamp(floor(log2 amax) − emax, −127, 127), exact as a product (a power of two); an amax that
    is 0 or an fp32 subnormal gives s = −127 either way, where every element rounds as in fake_quant_mx. Elements:
    m = |x| / 2^s, rounded to a multiple of 2^(max(floor(log2 m), emin) − mbits) (round half to even), clamped to the
    format's largest normal, signed as x. `vector`: the element loop vectorized (CPU); else serial (a GPU thread
    per block)."""
    from tvm import tirx
    from tvm.script import tirx as T

    fmt = element_format(fmt_name)
    lanes = T.vectorized if vector else T.serial
    scope = "global" if vector else "local"  # CPU: a stack slot (docs/toolchain.md, "Scratch buffers"); GPU: local

    @T.macro
    def quant(src, dst, row, col):
        amax = T.alloc_buffer((1,), "float32", scope=scope)
        bad = T.alloc_buffer((1,), "int32", scope=scope)
        amax[0] = T.float32(0)
        bad[0] = 0
        for i in range(BLOCK):
            amax[0] = T.max(amax[0], T.abs(src[row, col + i]))
            if _exponent(src[row, col + i]) == 128:  # inf or NaN (exponent bits all ones)
                bad[0] = 1
        shared = T.meta_var(T.max(T.min(_exponent(amax[0]) - fmt.emax, 127), -127))
        inv = T.meta_var(tirx.Select(shared == -127, T.float32(2.0**127), pow2(0 - shared)))
        scale = T.meta_var(tirx.Select(shared == -127, T.float32(2.0**-127), pow2(shared)))
        for i in lanes(BLOCK):
            dst[row, col + i] = T.if_then_else(bad[0] == 1, T.reinterpret(
                "float32", T.Cast("uint32", bad[0]) * T.uint32(NAN_BITS)), _signed_as(T.min(
                T.nearbyint(T.abs(src[row, col + i]) * inv * pow2(fmt.mbits - T.max(
                    _exponent(T.abs(src[row, col + i]) * inv), fmt.emin))) * pow2(T.max(
                        _exponent(T.abs(src[row, col + i]) * inv), fmt.emin) - fmt.mbits),
                T.float32(fmt.max_normal)), src[row, col + i]) * scale)

    return quant
