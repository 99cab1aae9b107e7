"""`k3::mxfp4_matmul`: activation x [..., K] times a packed MXFP4 weight [N, K/2] (+ E8M0 scales [N, K/32]).

Dequantization is fused into the op (the weight never exists unpacked outside it). `act_quant` optionally
fake-quantizes the activation to MXFP8 along K first ("e4m3" or "e5m2"; "none" keeps it as it is).
Accumulation is fp32; the result is fp32.
"""

from __future__ import annotations

import torch
from torch import Tensor

from k3compile.modes import ActQuant
from k3compile.ops.spec import OpSpec
from k3compile.quant.mx import dequantize_mxfp4, fake_quant_mx

ACT_QUANT = tuple(q.value for q in ActQuant)  # none, e4m3, e5m2


def quantize_activation(x: Tensor, act_quant: str) -> Tensor:
    if act_quant == ActQuant.NONE:
        return x.float()
    if act_quant not in ACT_QUANT:
        raise ValueError(f"act_quant must be one of {ACT_QUANT}, got {act_quant!r}")
    return fake_quant_mx(x.float(), act_quant)


def mxfp4_matmul_eager(x: Tensor, w_packed: Tensor, w_scale: Tensor, act_quant: str = ActQuant.NONE.value) -> Tensor:
    return quantize_activation(x, act_quant) @ dequantize_mxfp4(w_packed, w_scale).t()


mxfp4_matmul = torch.library.custom_op("k3::mxfp4_matmul", mxfp4_matmul_eager, mutates_args=())


@mxfp4_matmul.register_fake
def _(x, w_packed, w_scale, act_quant=ActQuant.NONE.value):
    return x.new_empty((*x.shape[:-1], w_packed.shape[0]), dtype=torch.float32)


# ---- ONNX: k3.MXFP4MatMul(x [..., M, K], packed [..., N, K/2], scale [..., N, K/32]) -> [..., M, N] ----------------
# Leading dims broadcast (the MoE body passes stacked experts [E, N, K/2] with x [1, M, K]).
ONNX_NAME = "MXFP4MatMul"


def onnx_schema():
    from k3compile.ops.onnx_body import schema

    return schema(
        ONNX_NAME, [("x", "T", False), ("w_packed", "U", False), ("w_scale", "U", False)], [("y", "T")],
        {"act_quant": int}, {"T": ["tensor(float)"], "U": ["tensor(uint8)"]},
        "x times a packed MXFP4 weight (E2M1 nibbles, element 2i low; E8M0 scales per 32 along K), fused "
        "dequantization; act_quant 1/2 fake-quantizes x to MXFP8 E4M3/E5M2 first.",
    )


def onnx_function(opset: int):
    from k3compile.ops.mx_onnx import dequant_mxfp4, maybe_fake_quant
    from k3compile.ops.onnx_body import Body, matmul_transposed

    b = Body()
    w = dequant_mxfp4(b, "w_packed", "w_scale")
    b.op("Identity", matmul_transposed(b, maybe_fake_quant(b, "x"), w), name="y")
    return b.function(ONNX_NAME, ["x", "w_packed", "w_scale"], ["y"], ["act_quant"], opset, onnx_schema().doc)


def onnx_translation(x, w_packed, w_scale, act_quant=ActQuant.NONE.value):
    from onnxscript.values import Opset

    from k3compile.ops.onnx_body import ACT_QUANT_CODES

    return getattr(Opset("k3", 1), ONNX_NAME)(x, w_packed, w_scale, act_quant=ACT_QUANT_CODES[act_quant])


# ---- TVM: the node becomes a call of the extern `k3.mxfp4_matmul` (y [..., M, N]) -----------------------------------
TVM_SYMBOL = "k3.mxfp4_matmul"


def tvm_convert(bb, inputs, attrs):
    import tvm
    from tvm import relax

    from k3compile.ops.onnx_body import ACT_QUANT_CODES

    x, packed, scale = inputs
    if len(packed.ty.shape) != 2:
        raise NotImplementedError("MXFP4MatMul with a stacked (rank > 2) weight has no TVM converter yet")
    codes = {c: name for name, c in ACT_QUANT_CODES.items()}
    xs = x.ty.shape  # a ShapeExpr indexes but does not slice
    out = relax.TensorType([xs[i] for i in range(len(xs) - 1)] + [packed.ty.shape[0]], "float32")
    return relax.call_dps_packed(TVM_SYMBOL, [x, packed, scale, tvm.ir.StringImm(codes[attrs.get("act_quant", 0)])],
                                 out)


def tvm_reference(x, packed, scale, act_quant, y):
    torch.from_dlpack(y).copy_(mxfp4_matmul(torch.from_dlpack(x), torch.from_dlpack(packed),
                                            torch.from_dlpack(scale), act_quant))


SPEC = OpSpec("k3::mxfp4_matmul", lambda: [onnx_schema()], {ONNX_NAME: onnx_function}, onnx_translation,
              tvm_converters={ONNX_NAME: tvm_convert}, tvm_references={TVM_SYMBOL: tvm_reference})
