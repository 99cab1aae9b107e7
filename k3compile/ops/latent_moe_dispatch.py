"""`k3::latent_moe_dispatch`: the routed-expert sum of (Latent)MoE over ONE contiguous slice of experts.

    y[n] = Σ_j [idx[n, j] in slice] · w[n, j] · E_idx[n,j](z[n])          fp32 accumulation, [N, D_lat]
    E(z) = W2 · act(W1 z, W3 z)         W13 = [W1; W3] stacked as [E_slice, 2I, D_lat], W2 [E_slice, D_lat, I]

The slice is experts [expert_offset, expert_offset + E_slice). Expert parallelism gives each rank its slice and
reduces the partial sums in latent space (before the latent RMSNorm): summing this op over a partition of the
experts equals the op over all of them. Tokens routed outside the slice contribute zero.

Weights are either float (scales None) or MXFP4: uint8 packed [E, 2I, D/2] / [E, D, I/2] with E8M0 scales
[E, 2I, D/32] / [E, D, I/32]. `act_quant` fake-quantizes both expert-matmul inputs to MXFP8 ("e4m3"/"e5m2") in
blocks of 32, so it needs D and I to be multiples of 32: other widths are a ConfigError, never a cut block (one
line at export, from the parity run; not from the fake op, whose errors torch.onnx wraps in its own traceback).
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from k3compile.config import ConfigError
from k3compile.modes import Activation, ActQuant
from k3compile.ops import mxfp4_matmul
from k3compile.ops.activations import glu
from k3compile.ops.mxfp4_matmul import mxfp4_matmul_eager, quantize_activation
from k3compile.ops.spec import OpSpec
from k3compile.quant.mx import BLOCK


def _expert_linear(x: Tensor, w: Tensor, scale: Optional[Tensor], act_quant: str) -> Tensor:
    if scale is not None:
        return mxfp4_matmul_eager(x, w, scale, act_quant)
    return quantize_activation(x, act_quant) @ w.float().t()


def check_act_quant(z: Tensor, w13: Tensor, act_quant: str) -> None:
    """MXFP8 activations quantize 32-blocks of z [N, D] and of the activation [N, I]: whole blocks only."""
    width, inter = z.shape[-1], w13.shape[1] // 2
    if act_quant != ActQuant.NONE.value and (width % BLOCK or inter % BLOCK):
        raise ConfigError(f"MXFP8 activations ({act_quant}) quantize blocks of {BLOCK} along the expert widths, but "
                          f"the expert input width (hidden_size, or routed_expert_hidden_size) is {width} and "
                          f"moe_intermediate_size {inter}: both must be multiples of {BLOCK} "
                          "(or export with --activations none)")


def latent_moe_dispatch_eager(
    z: Tensor,
    topk_idx: Tensor,
    topk_w: Tensor,
    w13: Tensor,
    w2: Tensor,
    w13_scale: Optional[Tensor] = None,
    w2_scale: Optional[Tensor] = None,
    expert_offset: int = 0,
    activation: str = Activation.SITU.value,
    situ_beta: float = 4.0,
    situ_linear_beta: float = 25.0,
    act_quant: str = ActQuant.NONE.value,
) -> Tensor:
    check_act_quant(z, w13, act_quant)
    n_local = w13.shape[0]
    out = torch.zeros(z.shape[0], w2.shape[1], dtype=torch.float32, device=z.device)
    local = topk_idx.long() - expert_offset
    hit = (local >= 0) & (local < n_local)
    for e in torch.unique(local[hit]).tolist():
        tok, slot = torch.nonzero(local == e, as_tuple=True)
        h = _expert_linear(z[tok], w13[e], None if w13_scale is None else w13_scale[e], act_quant)
        gate, up = h.chunk(2, dim=-1)
        a = glu(gate, up, activation, situ_beta, situ_linear_beta)
        y = _expert_linear(a, w2[e], None if w2_scale is None else w2_scale[e], act_quant)
        out.index_add_(0, tok, y * topk_w[tok, slot].float().unsqueeze(-1))
    return out


# The op's schema is the eager function's signature; the eager function stays callable on its own.
latent_moe_dispatch = torch.library.custom_op("k3::latent_moe_dispatch", latent_moe_dispatch_eager, mutates_args=())


@latent_moe_dispatch.register_fake
def _(z, topk_idx, topk_w, w13, w2, w13_scale=None, w2_scale=None, expert_offset=0, activation=Activation.SITU.value,
      situ_beta=4.0, situ_linear_beta=25.0, act_quant=ActQuant.NONE.value):
    return z.new_empty((z.shape[0], w2.shape[1]), dtype=torch.float32)


# ---- ONNX ---------------------------------------------------------------------------------------------------------
# k3.LatentMoEDispatch (float experts) and k3.LatentMoEDispatchMXFP4 (packed experts; its body calls
# k3.MXFP4MatMul): z [N, D], idx [N, k] int64, w [N, k], stacked slice weights -> y [N, D] fp32.
# The body is a dense reference: every local expert on every token, combined with the routing weights scattered
# to [N, E_slice] (tokens routed outside the slice weigh zero). Compiled targets lower the node to a real kernel.
ONNX_NAME = "LatentMoEDispatch"
ONNX_NAME_MXFP4 = "LatentMoEDispatchMXFP4"
ATTRIBUTES = {"expert_offset": int, "activation": int, "situ_beta": float, "situ_linear_beta": float,
              "act_quant": int}


def onnx_schemas():
    from k3compile.ops.onnx_body import schema

    doc = ("Routed-expert sum over a contiguous expert slice [expert_offset, expert_offset + E): "
           "y = sum_j w_j * W2 act(W1 z, W3 z) for the experts idx_j in the slice (activation 0 SiLU, 1 SiTU; "
           "act_quant 1/2: MXFP8 E4M3/E5M2 activations).")
    common = [("z", "T", False), ("topk_idx", "I", False), ("topk_w", "T", False)]
    return [
        schema(ONNX_NAME, common + [("w13", "T", False), ("w2", "T", False)], [("y", "T")], ATTRIBUTES,
               {"T": ["tensor(float)"], "I": ["tensor(int64)"]}, doc),
        schema(ONNX_NAME_MXFP4, common + [("w13", "U", False), ("w2", "U", False), ("w13_scale", "U", False),
                                          ("w2_scale", "U", False)], [("y", "T")], ATTRIBUTES,
               {"T": ["tensor(float)"], "I": ["tensor(int64)"], "U": ["tensor(uint8)"]}, doc + " MXFP4 weights."),
    ]


def _activation(b, gate: str, up: str) -> str:
    import numpy as np

    from k3compile.ops.onnx_body import select

    def silu(s):
        return s.op("Mul", s.op("Mul", gate, s.op("Sigmoid", gate)), up)

    def situ_(s):
        beta, lin = s.attr("situ_beta", float), s.attr("situ_linear_beta", float)
        g = s.op("Mul", s.op("Mul", beta, s.op("Tanh", s.op("Div", gate, beta))), s.op("Sigmoid", gate))
        return s.op("Mul", g, s.op("Mul", lin, s.op("Tanh", s.op("Div", up, lin))))

    return select(b, b.op("Equal", b.attr("activation", int), b.const(1, np.int64)), situ_, silu, "act")


def onnx_function(opset: int, mxfp4: bool):
    import numpy as np
    from onnx import AttributeProto, helper

    from k3compile.ops.mx_onnx import maybe_fake_quant
    from k3compile.ops.onnx_body import DOMAIN, Body, matmul_transposed

    b = Body()

    def expert_matmul(x: str, w: str) -> str:
        """x [1 or E, N, K] times every local expert's weight [E, M, K] -> [E, N, M]."""
        if mxfp4:  # the packed matmul is its own k3 node, passing act_quant through
            out = b.op(mxfp4_matmul.ONNX_NAME, x, w, f"{w}_scale", domain=DOMAIN)
            b.nodes[-1].attribute.append(helper.make_attribute_ref("act_quant", AttributeProto.INT))
            return out
        return matmul_transposed(b, maybe_fake_quant(b, x), w)

    z1 = b.op("Unsqueeze", "z", b.const([0], np.int64))  # [1, N, D]: broadcast over the expert axis
    gate, up = b.op("Split", expert_matmul(z1, "w13"), axis=-1, num_outputs=2, outputs=2)  # [E, N, I] each
    y = expert_matmul(_activation(b, gate, up), "w2")  # [E, N, D]
    n_local = b.op("Squeeze", b.op("Shape", "w13", start=0, end=1))  # E, a scalar (OneHot depth)
    local = b.op("Sub", "topk_idx", b.attr("expert_offset", int))
    inside = b.op("And", b.op("GreaterOrEqual", local, b.const(0, np.int64)), b.op("Less", local, n_local))
    local = b.op("Where", inside, local, n_local)  # out of the slice -> index E -> an all-zero one-hot row
    onehot = b.op("OneHot", local, n_local, b.const([0.0, 1.0]), axis=-1)  # [N, k, E]
    route = b.op("ReduceSum", b.op("Mul", onehot, b.op("Unsqueeze", "topk_w", b.const([-1], np.int64))),
                 b.const([1], np.int64), keepdims=0)  # [N, E]
    b.op("Einsum", route, y, equation="ne,end->nd", name="y")
    name = ONNX_NAME_MXFP4 if mxfp4 else ONNX_NAME
    inputs = ["z", "topk_idx", "topk_w", "w13", "w2"] + (["w13_scale", "w2_scale"] if mxfp4 else [])
    return b.function(name, inputs, ["y"], list(ATTRIBUTES), opset, onnx_schemas()[int(mxfp4)].doc)


def onnx_translation(z, topk_idx, topk_w, w13, w2, w13_scale=None, w2_scale=None, expert_offset=0,
                     activation=Activation.SITU.value, situ_beta=4.0, situ_linear_beta=25.0,
                     act_quant=ActQuant.NONE.value):
    from onnxscript.values import Opset

    from k3compile.ops.onnx_body import ACT_QUANT_CODES, ACTIVATION_CODES

    k3 = Opset("k3", 1)
    attrs = dict(expert_offset=int(expert_offset), activation=ACTIVATION_CODES[activation],
                 situ_beta=float(situ_beta), situ_linear_beta=float(situ_linear_beta),
                 act_quant=ACT_QUANT_CODES[act_quant])
    if w13_scale is not None:
        return getattr(k3, ONNX_NAME_MXFP4)(z, topk_idx, topk_w, w13, w2, w13_scale, w2_scale, **attrs)
    return getattr(k3, ONNX_NAME)(z, topk_idx, topk_w, w13, w2, **attrs)


# ---- TVM: the node becomes a call of the extern `k3.latent_moe_dispatch` (y [N, D]) with its attributes ----------
TVM_SYMBOL = "k3.latent_moe_dispatch"


def tvm_convert(bb, inputs, attrs):
    import tvm
    from tvm import relax

    from k3compile.ops.onnx_body import ACT_QUANT_CODES, ACTIVATION_CODES

    act = {c: name for name, c in ACTIVATION_CODES.items()}
    aq = {c: name for name, c in ACT_QUANT_CODES.items()}
    z, idx, w, w13, w2 = inputs[:5]
    scales = list(inputs[5:7]) if len(inputs) >= 7 else []
    args = [z, idx, w, w13, w2, *scales,
            relax.prim_value(tvm.tirx.IntImm("int64", int(attrs["expert_offset"]))),
            tvm.ir.StringImm(act[int(attrs["activation"])]),
            relax.prim_value(tvm.tirx.FloatImm("float64", float(attrs["situ_beta"]))),
            relax.prim_value(tvm.tirx.FloatImm("float64", float(attrs["situ_linear_beta"]))),
            tvm.ir.StringImm(aq[int(attrs["act_quant"])])]
    out = relax.TensorType([z.ty.shape[0], w2.ty.shape[1]], "float32")
    return relax.call_dps_packed(TVM_SYMBOL + ("_mxfp4" if scales else ""), args, out)


def _tvm_reference(mxfp4: bool):
    def run(*args):
        t = [torch.from_dlpack(a) for a in args[:7 if mxfp4 else 5]]
        offset, activation, beta, lin, act_quant, y = args[7 if mxfp4 else 5:]
        w13_scale, w2_scale = (t[5], t[6]) if mxfp4 else (None, None)
        torch.from_dlpack(y).copy_(latent_moe_dispatch(*t[:5], w13_scale, w2_scale, offset, activation, beta, lin,
                                                       act_quant))

    return run


SPEC = OpSpec(
    "k3::latent_moe_dispatch", onnx_schemas,
    {ONNX_NAME: lambda opset: onnx_function(opset, mxfp4=False),
     ONNX_NAME_MXFP4: lambda opset: onnx_function(opset, mxfp4=True)},
    onnx_translation, calls={ONNX_NAME_MXFP4: (mxfp4_matmul.ONNX_NAME,)},
    tvm_converters={ONNX_NAME: tvm_convert, ONNX_NAME_MXFP4: tvm_convert},
    tvm_references={TVM_SYMBOL: _tvm_reference(False), TVM_SYMBOL + "_mxfp4": _tvm_reference(True)},
)
