"""exp, tanh and sigmoid for float32 as plain TIR arithmetic, and the rewrite that puts them in place of TVM's
(docs/toolchain.md, "CPU schedules").

On llvm, TVM's `exp` becomes one libm call per vector lane (2.6 ns an element here against 0.4 for `exp_f32`, which
vectorizes), and its `tanh` is (e^2x − 1) / (e^2x + 1), which loses the relative precision of small results (4e-5
relative error measured; torch's is ~6e-8). That error is harmless next to a 1e-4 tolerance until a result is
rounded to a coarse format: MXFP8 activations round SiTU's output to 3 mantissa bits, and a 4e-5 difference moves
values across rounding boundaries, one quantum (~6 %) at a time. The kernels call the functions below directly;
inside `lowering()` (the llvm target's builds) TVM's lowering of every float32 exp, tanh and sigmoid uses them.
"""

from __future__ import annotations

import contextlib
import threading

LN2_HI, LN2_LO = 0.693145751953125, 1.428606765330187e-06  # ln 2 split: n · LN2_HI is exact for |n| < 2^9
EXP_MAX = 88.72283935546875  # the largest float32 x with e^x finite
EXP_MIN = -104.0  # below it e^x rounds to 0 in float32
TANH_SERIES_MAX = 0.5  # below it tanh is its Taylor series (to x^15: truncation < 5e-9)
# tanh x = x + x^3 · Σ c_i x^(2i): the Taylor coefficients -1/3, 2/15, -17/315, 62/2835, -1382/155925,
# 21844/6081075, -929569/638512875
TANH_SERIES = (-1 / 3, 2 / 15, -17 / 315, 62 / 2835, -1382 / 155925, 21844 / 6081075, -929569 / 638512875)


def _types(x) -> tuple[str, str]:
    """(float type, int type) of x: "float32" / "int32", or with lanes ("float32x16" / "int32x16") when the rule
    runs on code already vectorized."""
    ty = str(x.ty)
    return ty, ty.replace("float", "int")


def _is_nan(x, it):
    """x is NaN, from the bits: TVM's simplifier may fold a float test such as x != x."""
    from tvm import tirx

    return tirx.bitwise_and(tirx.reinterpret(it, x), tirx.const(0x7FFFFFFF, it)) > tirx.const(0x7F800000, it)


def pow2(n, ft: str = "float32", it: str = "int32"):
    """2^n as a float (type ft) for an integer expression n (type it) in [-126, 127], from the exponent bits."""
    from tvm import tirx

    return tirx.reinterpret(ft, tirx.shift_left(n + tirx.const(127, it), tirx.const(23, it)))


def exp_f32(x):
    """e^x: 2^n · p(r) with n = round(x / ln 2), r = x − n ln 2 (|r| ≤ ln 2 / 2) and p the degree-7 Taylor
    polynomial (relative error ~1e-7); 2^n applied as two factors so that results down to the subnormals and up to
    FLT_MAX come out. NaN stays NaN, x > 88.72 gives inf, x < −104 (and −inf) 0."""
    from tvm import tirx

    ft, it = _types(x)

    def f(v):
        return tirx.const(v, ft)

    xc = tirx.max(tirx.min(x, f(EXP_MAX)), f(EXP_MIN))
    # n = floor(xc / ln 2 + 1/2) by truncation of a positive number (no floor call: a lowering rule's result is not
    # lowered again, and the code generator has no floor of its own)
    ni = tirx.Cast(it, xc * f(1.4426950408889634) + f(0.5 + 256)) - tirx.const(256, it)
    n = tirx.Cast(ft, ni)
    r = xc - n * f(LN2_HI) - n * f(LN2_LO)
    p = f(1 / 5040)
    for c in (1 / 720, 1 / 120, 1 / 24, 1 / 6, 0.5, 1.0, 1.0):
        p = p * r + f(c)
    half = tirx.shift_right(ni, tirx.const(1, it))  # floor(n / 2): both factors stay normal floats
    value = p * pow2(half, ft, it) * pow2(ni - half, ft, it)
    # inf as an overflow at run time (x >= 88.72 times 2^127): a constant inf is text some device languages lack
    # (WGSL has no `inff`), and its bits reinterpreted are code TVM's OpenCL C generator gets wrong
    value = tirx.Select(x > f(EXP_MAX), x * f(2.0**127), value)
    return tirx.Select(_is_nan(x, it), x, value)


def tanh_f32(x):
    """tanh x: the Taylor series for |x| < 0.5, else 1 − 2 / (e^2|x| + 1) (no cancellation there: the result is at
    least 0.46), signed as x; relative error ~2e-7. NaN stays NaN, ±inf gives ±1."""
    from tvm import tirx

    ft, it = _types(x)

    def f(v):
        return tirx.const(v, ft)

    bits = tirx.reinterpret(it, x)
    a = tirx.reinterpret(ft, tirx.bitwise_and(bits, tirx.const(0x7FFFFFFF, it)))  # |x|, and x's sign bit below
    a2 = a * a
    s = f(TANH_SERIES[-1])
    for c in reversed(TANH_SERIES[:-1]):
        s = s * a2 + f(c)
    small = a + a * a2 * s
    large = f(1.0) - f(2.0) / (exp_f32(a + a) + f(1.0))
    value = tirx.Select(a < f(TANH_SERIES_MAX), small, large)
    # x's sign bit as bits ^ (bits & 0x7FFFFFFF): the literal -2^31 is not valid WGSL
    sign = tirx.bitwise_xor(bits, tirx.bitwise_and(bits, tirx.const(0x7FFFFFFF, it)))
    signed = tirx.reinterpret(ft, tirx.bitwise_or(tirx.reinterpret(it, value), sign))
    return tirx.Select(_is_nan(x, it), x, signed)


def sigmoid_f32(x):
    """1 / (1 + e^−x), with exp_f32 (0 at −inf, 1 at +inf, NaN for NaN)."""
    from tvm import tirx

    ft, _ = _types(x)
    return tirx.const(1.0, ft) / (tirx.const(1.0, ft) + exp_f32(tirx.const(0.0, ft) - x))


_RULES = {"tirx.exp": exp_f32, "tirx.tanh": tanh_f32, "tirx.sigmoid": sigmoid_f32}
_active = threading.local()
_registered: list[str] = []


def _register() -> None:
    """Install, once per process, llvm lowering rules for exp, tanh and sigmoid that use the functions above while
    `lowering()` is active and otherwise defer to the rule they replaced (or leave the call as it is)."""
    import tvm
    from tvm.tirx.op import register_intrin_lowering

    for name, make in _RULES.items():
        if name in _registered:
            continue
        previous = tvm.ir.Op.get(name).get_attr("llvm.FLowerIntrinsic")

        def rule(call, make=make, previous=previous):
            if getattr(_active, "on", False) and str(call.args[0].ty).startswith("float32"):
                return make(call.args[0])
            return previous(call) if previous is not None else call

        register_intrin_lowering(name, "llvm", f=rule, level=100)
        _registered.append(name)


@contextlib.contextmanager
def lowering():
    """While active (one thread), TVM builds for llvm lower float32 exp, tanh and sigmoid to exp_f32, tanh_f32 and
    sigmoid_f32 (the module docstring says why)."""
    _register()
    before = getattr(_active, "on", False)
    _active.on = True
    try:
        yield
    finally:
        _active.on = before
