"""MX formats in standard ONNX ops, for the k3 function bodies (docs/mx.md).

- `dequant_mxfp4`: packed uint8 nibbles + E8M0 bytes -> fp32, by integer nibble split (int32 `& 15`, `/ 16`),
  a 16-entry table and 2^(b-127) scales (Pow(2, integer) is exact in onnxruntime and onnx.reference).
- `fake_quant`: MXFP8/MXFP4 quantize-dequantize with float ops only (Abs, ReduceMax, Log/Floor with an exact ±1
  correction, Pow, Round = RNE, Min, Sign): bit-exact against the torch implementation for finite inputs with
  normal block maxima (onnxruntime has no FLOAT4E2M1/E8M0-scaled kernels, and TVM's fp8 casts are wrong).
"""

from __future__ import annotations

import numpy as np
from onnx import TensorProto

from k3compile.ops.onnx_body import NAN, Body, select
from k3compile.quant.mx import BLOCK, FP4_VALUES, element_format


def _lead_shape(b: Body, x: str) -> str:
    return b.op("Shape", x, end=-1)


def dequant_mxfp4(b: Body, packed: str, scale: str) -> str:
    """packed [..., K/2] uint8, scale [..., K/32] uint8 -> fp32 [..., K]."""
    lut = b.const(list(FP4_VALUES) + [-v for v in FP4_VALUES])
    i = b.op("Cast", packed, to=TensorProto.INT32)
    lo = b.op("BitwiseAnd", i, b.const(15, np.int32))
    hi = b.op("Div", i, b.const(16, np.int32))
    last = b.const([-1], np.int64)
    codes = b.op("Concat", b.op("Unsqueeze", lo, last), b.op("Unsqueeze", hi, last), axis=-1)  # [..., K/2, 2]
    vals = b.op("Gather", lut, codes)
    lead = _lead_shape(b, packed)
    blocks = b.op("Reshape", vals, b.op("Concat", lead, b.const([-1, BLOCK], np.int64), axis=0))
    s = b.op("Cast", scale, to=TensorProto.INT32)
    exp = b.op("Cast", b.op("Sub", s, b.const(127, np.int32)), to=TensorProto.FLOAT)
    sf = b.op("Pow", b.const(2.0), exp)
    sf = b.op("Where", b.op("Equal", s, b.const(255, np.int32)), b.const(NAN), sf)  # E8M0 255 is NaN
    w = b.op("Mul", blocks, b.op("Unsqueeze", sf, last))
    return b.op("Reshape", w, b.op("Concat", lead, last, axis=0))


def _floor_log2(b: Body, x: str) -> str:
    """Exact floor(log2 x) for normal fp32 x > 0: Floor(Log(x)/ln 2), then ±1 by exact powers of two."""
    two = b.const(2.0)
    e0 = b.op("Floor", b.op("Div", b.op("Log", x), b.const(np.log(2.0))))
    p0 = b.op("Pow", two, e0)
    too_big = b.op("Cast", b.op("Greater", p0, x), to=TensorProto.FLOAT)
    too_small = b.op("Cast", b.op("LessOrEqual", b.op("Mul", p0, two), x), to=TensorProto.FLOAT)
    return b.op("Add", b.op("Sub", e0, too_big), too_small)


def fake_quant(b: Body, x: str, fmt_name: str) -> str:
    """MX quantize-dequantize of x [..., K] along K in blocks of 32 (the OCP FLOOR rule, RNE, saturating)."""
    fmt = element_format(fmt_name)
    two = b.const(2.0)
    shape = b.op("Shape", x)
    xb = b.op("Reshape", x, b.op("Concat", _lead_shape(b, x), b.const([-1, BLOCK], np.int64), axis=0))
    amax = b.op("ReduceMax", b.op("Abs", xb), b.const([-1], np.int64), keepdims=1)
    amax = b.op("Max", amax, b.const(2.0**-126))  # all-zero blocks quantize to zero under any scale
    shared = b.op("Max", b.op("Sub", _floor_log2(b, amax), b.const(float(fmt.emax))), b.const(-127.0))
    scale = b.op("Pow", two, shared)
    y = b.op("Div", xb, scale)
    a = b.op("Abs", y)
    e = _floor_log2(b, b.op("Max", a, b.const(2.0**fmt.emin)))  # subnormals share the smallest normal's ulp
    ulp = b.op("Pow", two, b.op("Sub", e, b.const(float(fmt.mbits))))
    q = b.op("Min", b.op("Mul", b.op("Round", b.op("Div", a, ulp)), ulp), b.const(fmt.max_normal))
    q = b.op("Mul", q, b.op("Sign", y))
    return b.op("Reshape", b.op("Mul", q, scale), shape)


def maybe_fake_quant(b: Body, x: str) -> str:
    """MXFP8 fake quantization of x chosen by the calling node's `act_quant` attribute (0 none, 1 e4m3, 2 e5m2)."""
    aq = b.attr("act_quant", int)
    return select(
        b, b.op("Equal", aq, b.const(0, np.int64)), lambda s: x,
        lambda s: select(s, s.op("Equal", aq, s.const(1, np.int64)), lambda t: fake_quant(t, x, "e4m3"),
                         lambda t: fake_quant(t, x, "e5m2"), "e5m2"),
        "actq",
    )
