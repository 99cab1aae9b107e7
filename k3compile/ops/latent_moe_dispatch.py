"""`k3::latent_moe_dispatch`: the routed-expert sum of (Latent)MoE over ONE contiguous slice of experts.

    y[n] = Σ_j [idx[n, j] in slice] · w[n, j] · E_idx[n,j](z[n])          fp32 accumulation, [N, D_lat]
    E(z) = W2 · act(W1 z, W3 z)         W13 = [W1; W3] stacked as [E_slice, 2I, D_lat], W2 [E_slice, D_lat, I]

The slice is experts [expert_offset, expert_offset + E_slice). Expert parallelism gives each rank its slice and
reduces the partial sums in latent space (before the latent RMSNorm): summing this op over a partition of the
experts equals the op over all of them. Tokens routed outside the slice contribute zero.

Weights are either float (scales None) or MXFP4: uint8 packed [E, 2I, D/2] / [E, D, I/2] with E8M0 scales
[E, 2I, D/32] / [E, D, I/32]. `act_quant` fake-quantizes both expert-matmul inputs to MXFP8 ("e4m3"/"e5m2").
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from k3compile.model.activations import glu
from k3compile.ops.mxfp4_matmul import mxfp4_matmul_eager, quantize_activation


def _expert_linear(x: Tensor, w: Tensor, scale: Optional[Tensor], act_quant: str) -> Tensor:
    if scale is not None:
        return mxfp4_matmul_eager(x, w, scale, act_quant)
    return quantize_activation(x, act_quant) @ w.float().t()


def latent_moe_dispatch_eager(
    z: Tensor,
    topk_idx: Tensor,
    topk_w: Tensor,
    w13: Tensor,
    w2: Tensor,
    w13_scale: Optional[Tensor] = None,
    w2_scale: Optional[Tensor] = None,
    expert_offset: int = 0,
    activation: str = "situ",
    situ_beta: float = 4.0,
    situ_linear_beta: float = 25.0,
    act_quant: str = "none",
) -> Tensor:
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
def _(z, topk_idx, topk_w, w13, w2, w13_scale=None, w2_scale=None, expert_offset=0, activation="situ",
      situ_beta=4.0, situ_linear_beta=25.0, act_quant="none"):
    return z.new_empty((z.shape[0], w2.shape[1]), dtype=torch.float32)
