"""`k3::mxfp4_matmul`: activation x [..., K] times a packed MXFP4 weight [N, K/2] (+ E8M0 scales [N, K/32]).

Dequantization is fused into the op (the weight never exists unpacked outside it). `act_quant` optionally
fake-quantizes the activation to MXFP8 along K first ("e4m3" or "e5m2"; "none" keeps it as it is).
Accumulation is fp32; the result is fp32.
"""

from __future__ import annotations

import torch
from torch import Tensor

from k3compile.quant.mx import dequantize_mxfp4, fake_quant_mx

ACT_QUANT = ("none", "e4m3", "e5m2")


def quantize_activation(x: Tensor, act_quant: str) -> Tensor:
    if act_quant == "none":
        return x.float()
    if act_quant not in ACT_QUANT:
        raise ValueError(f"act_quant must be one of {ACT_QUANT}, got {act_quant!r}")
    return fake_quant_mx(x.float(), act_quant)


def mxfp4_matmul_eager(x: Tensor, w_packed: Tensor, w_scale: Tensor, act_quant: str = "none") -> Tensor:
    return quantize_activation(x, act_quant) @ dequantize_mxfp4(w_packed, w_scale).t()


mxfp4_matmul = torch.library.custom_op("k3::mxfp4_matmul", mxfp4_matmul_eager, mutates_args=())


@mxfp4_matmul.register_fake
def _(x, w_packed, w_scale, act_quant="none"):
    return x.new_empty((*x.shape[:-1], w_packed.shape[0]), dtype=torch.float32)
