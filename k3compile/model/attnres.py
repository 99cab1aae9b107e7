"""Block Attention Residuals (docs/model.md, "Block Attention Residuals"): each sub-layer input is a learned softmax
mix over block summaries.

mix(bank, prefix): V = [bank..., prefix] in fp32 [.., N+1, D];
score_i = Σ_d rmsnorm(V_i)_d · norm.weight_d · q_d   (q: the learned query vector `proj.weight[0]`, no 1/sqrt(D));
result = Σ_i softmax(score)_i V_i.
The checkpoint holds, per mixing point, `*_res_proj.weight` [1, D] and `*_res_norm.weight` [D].
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from k3compile.model.norms import RMSNorm, rms_normalize


def attn_res_mix(bank: list[Tensor], prefix: Tensor, proj: nn.Linear, norm: RMSNorm) -> Tensor:
    v = torch.stack([*bank, prefix], dim=-2).float()  # [B, T, N+1, D]
    q = norm.weight.float() * proj.weight[0].float()
    score = (rms_normalize(v, norm.eps) * q).sum(-1)  # [B, T, N+1]
    p = torch.softmax(score, dim=-1)
    return (p.unsqueeze(-1) * v).sum(-2).to(prefix.dtype)
