"""`k3::kda_recurrence`: the Kimi Delta Attention core (gated delta rule, per-key-channel decay), docs/model.md, "Kimi
Delta Attention".

Inputs (all [B, T, H, ·], fp32 compute): q̂ (l2-normalized and scaled by K^-1/2), k̂ (l2-normalized), v,
g (log-space decay per key channel, <= 0), β [B, T, H], and the past state S [B, H, K, V].
Outputs: o [B, T, H, V] and the present state [B, H, K, V], both fp32.

Per token and head: S <- S * exp(g)[:, None]; S <- S + β k̂ ⊗ (v - k̂ᵀ S); o = Sᵀ q̂.
Two eager forms: `kda_recurrent` (token by token; decode) and `kda_chunked` (WY/UT form over chunks; prefill).
A padded position carries g = 0 and β = 0, which leaves S exactly unchanged.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from k3compile.ops.spec import OpSpec

DEFAULT_CHUNK = 64


def kda_recurrent(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, state: Tensor) -> tuple[Tensor, Tensor]:
    """Token-by-token recurrence. Shapes as in the module docstring."""
    q, k, v, g, beta = (t.float() for t in (q, k, v, g, beta))
    s = state.float().clone()
    outs = []
    for t in range(q.shape[1]):
        s = s * g[:, t].exp().unsqueeze(-1)  # decay rows (key channels)
        kt = k[:, t]
        pred = torch.einsum("bhk,bhkv->bhv", kt, s)
        s = s + (beta[:, t, :, None, None] * kt.unsqueeze(-1)) * (v[:, t] - pred).unsqueeze(-2)
        outs.append(torch.einsum("bhk,bhkv->bhv", q[:, t], s))
    o = torch.stack(outs, dim=1) if outs else v.new_zeros(v.shape)
    return o, s


def kda_chunked(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, state: Tensor, chunk_size: int = DEFAULT_CHUNK
) -> tuple[Tensor, Tensor]:
    """Chunked form (docs/model.md, "Kimi Delta Attention"): exact to ~1e-6 against `kda_recurrent`; any T, last chunk
    may be short."""
    q, k, v, g, beta = (t.float().transpose(1, 2) for t in (q, k, v, g, beta))  # [B, H, T, ·]
    s = state.float()
    outs = []
    for c0 in range(0, q.shape[2], chunk_size):
        qc, kc, vc, gc = (t[:, :, c0 : c0 + chunk_size] for t in (q, k, v, g))
        bc = beta[:, :, c0 : c0 + chunk_size]  # [B, H, C]
        n = qc.shape[2]
        cum = gc.cumsum(dim=2)  # G_r = Σ_{s<=r} g_s, [B, H, C, K]
        # exp(G_r - G_c) only where c <= r (else -inf -> 0): the difference never exceeds 0, so it cannot overflow.
        diff = cum.unsqueeze(3) - cum.unsqueeze(2)  # [B, H, r, c, K]
        incl = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
        decay = diff.masked_fill(~incl[:, :, None], float("-inf")).exp()
        kk = torch.einsum("bhrd,bhcd,bhrcd->bhrc", kc, kc, decay)
        strict = torch.ones(n, n, dtype=torch.bool, device=q.device).tril(-1)
        lower = (bc.unsqueeze(-1) * kk).masked_fill(~strict, 0.0)  # L[r, c], c < r
        eye = torch.eye(n, dtype=q.dtype, device=q.device)
        # T = (I + L)^-1 Diag(β): one unit-lower triangular solve.
        tmat = torch.linalg.solve_triangular(eye + lower, torch.diag_embed(bc), upper=False, unitriangular=True)
        w = tmat @ (cum.exp() * kc)
        u = tmat @ vc
        vn = u - w @ s
        attn = torch.einsum("bhrd,bhcd,bhrcd->bhrc", qc, kc, decay)  # diagonal included
        outs.append((qc * cum.exp()) @ s + attn @ vn)
        last = cum[:, :, -1:]  # G_last [B, H, 1, K]
        s = last.squeeze(2).exp().unsqueeze(-1) * s + ((last - cum).exp() * kc).transpose(-1, -2) @ vn
    o = torch.cat(outs, dim=2) if outs else v.new_zeros(v.shape)
    return o.transpose(1, 2).contiguous(), s


@torch.library.custom_op("k3::kda_recurrence", mutates_args=())
def kda_recurrence(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    initial_state: Optional[Tensor] = None,
    chunk_size: int = DEFAULT_CHUNK,
) -> tuple[Tensor, Tensor]:
    """One node: the recurrent form for a single token (decode), the chunked form for prefill. A missing
    initial state is zero."""
    if initial_state is None:
        b, _, h, dk = k.shape
        initial_state = torch.zeros(b, h, dk, v.shape[-1], dtype=torch.float32, device=k.device)
    if q.shape[1] == 1:
        return kda_recurrent(q, k, v, g, beta, initial_state)
    o, s = kda_chunked(q, k, v, g, beta, initial_state, chunk_size)
    return o, s.clone() if s is initial_state else s


@kda_recurrence.register_fake
def _(q, k, v, g, beta, initial_state=None, chunk_size=DEFAULT_CHUNK):
    b, t, h, dk = q.shape
    return (
        q.new_empty((b, t, h, v.shape[-1]), dtype=torch.float32),
        q.new_empty((b, h, dk, v.shape[-1]), dtype=torch.float32),
    )


# ---- ONNX: k3.KDARecurrence(q, k, v, g, beta, state) -> (o, present), attribute num_heads --------------------------
# The body is the standard opset-27 LinearAttention(update_rule="gated_delta"): decay, erase against the DECAYED
# state, write — exactly this recurrence, with per-key-channel decay, on 3-D packed [B, T, H*D] inputs.
ONNX_NAME = "KDARecurrence"
MIN_OPSET = 27


def onnx_schema():
    from k3compile.ops.onnx_body import schema

    return schema(
        ONNX_NAME,
        [("q", "T", False), ("k", "T", False), ("v", "T", False), ("g", "T", False), ("beta", "T", False),
         ("state", "T", True)],
        [("o", "T"), ("present", "T")], {"num_heads": int}, {"T": ["tensor(float)"]},
        "Kimi Delta Attention recurrence: q̂, k̂ (normalized, q̂ scaled) [B,T,H,K], v [B,T,H,V], log-space decay g "
        "[B,T,H,K], beta [B,T,H], state [B,H,K,V] -> o [B,T,H,V], present [B,H,K,V] (fp32).",
    )


def onnx_function(opset: int):
    import numpy as np
    from onnx import AttributeProto, helper

    from k3compile.ops.onnx_body import Body

    b = Body()
    packed = b.const([0, 0, -1], np.int64)
    q, k, v, g = (b.op("Reshape", x, packed) for x in ("q", "k", "v", "g"))
    o3 = b.op("LinearAttention", q, k, v, "state", g, "beta", outputs=2, update_rule="gated_delta", scale=1.0)
    node = b.nodes[-1]
    node.output[1] = "present"
    for a in ("q_num_heads", "kv_num_heads"):
        node.attribute.append(helper.make_attribute_ref(a, AttributeProto.INT, ref_attr_name="num_heads"))
    b.op("Reshape", o3[0], b.op("Shape", "v"), name="o")
    return b.function(ONNX_NAME, ["q", "k", "v", "g", "beta", "state"], ["o", "present"], ["num_heads"], opset,
                      onnx_schema().doc)


def onnx_translation(q, k, v, g, beta, initial_state=None, chunk_size=DEFAULT_CHUNK):
    from onnxscript.values import Opset

    return getattr(Opset("k3", 1), ONNX_NAME)(q, k, v, g, beta, initial_state, num_heads=int(q.shape[2]),
                                               _outputs=2)


# ---- TVM: the node becomes a call of the extern `k3.kda_recurrence` (o [B,T,H,V], present [B,H,K,V]) --------------
TVM_SYMBOL = "k3.kda_recurrence"


def tvm_convert(bb, inputs, attrs):
    from tvm import relax

    q, k, v, g, beta, state = (list(inputs) + [None] * 6)[:6]
    if state is None:  # the optional initial state: zeros [B, H, K, V]
        qs, vs = q.ty.shape, v.ty.shape
        state = bb.normalize(relax.op.zeros(relax.ShapeExpr([qs[0], qs[2], qs[3], vs[3]]), "float32"))
    return relax.call_dps_packed(TVM_SYMBOL, [q, k, v, g, beta, state], [v.ty, state.ty])


def tvm_reference(q, k, v, g, beta, state, o, present):
    """The eager op behind the extern symbol (destination-passing: writes o and present)."""
    out, s = kda_recurrence(*(torch.from_dlpack(t) for t in (q, k, v, g, beta, state)))
    torch.from_dlpack(o).copy_(out)
    torch.from_dlpack(present).copy_(s)


SPEC = OpSpec("k3::kda_recurrence", lambda: [onnx_schema()], {ONNX_NAME: onnx_function}, onnx_translation,
              tvm_converters={ONNX_NAME: tvm_convert}, tvm_references={TVM_SYMBOL: tvm_reference})
