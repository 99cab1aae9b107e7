"""Gated NoPE Multi-head Latent Attention (docs/model.md, "Gated NoPE MLA"), the full-attention layers.

The cache holds the normalized latent c [B, P, C] and the shared key part k_r [B, P, R] (no rotation: NoPE).
Two equal forms: `naive` expands the whole cache through kv_b_proj into per-head keys and values; `absorbed`
(decode) folds W_UK into the query and W_UV after the weighted sum, attending in latent space.
With the K3 output gate, W_UV cannot be folded into o_proj (the gate sits between them). With tensor parallelism a
module holds its rank's heads (the latent cache whole) and `reduce` sums o_proj's partial output over the tp group.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor, nn

from k3compile.config import K3Config
from k3compile.model.norms import RMSNorm
from k3compile.modes import MLAForm

MLA_NORM_EPS = 1e-6  # q_a_layernorm / kv_a_layernorm, as in the HF code


class GatedMLA(nn.Module):
    def __init__(self, cfg: K3Config) -> None:
        super().__init__()
        d, h = cfg.hidden_size, cfg.num_attention_heads
        self.num_heads, self.dn, self.dr, self.dv = h, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
        self.rank = cfg.kv_lora_rank
        self.scale = (self.dn + self.dr) ** -0.5
        if cfg.q_lora_rank:
            self.q_a_proj = nn.Linear(d, cfg.q_lora_rank, bias=False)
            self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, MLA_NORM_EPS)
            self.q_b_proj = nn.Linear(cfg.q_lora_rank, h * (self.dn + self.dr), bias=False)
        else:
            self.q_proj = nn.Linear(d, h * (self.dn + self.dr), bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(d, self.rank + self.dr, bias=False)
        self.kv_a_layernorm = RMSNorm(self.rank, MLA_NORM_EPS)
        self.kv_b_proj = nn.Linear(self.rank, h * (self.dn + self.dv), bias=False)
        self.o_proj = nn.Linear(h * self.dv, d, bias=False)
        if cfg.mla_use_output_gate:
            self.g_proj = nn.Linear(d, h * self.dv, bias=False)
        self.reduce: Callable[[Tensor], Tensor] | None = None  # tensor parallelism: the heads' partial sum -> all

    def query(self, x: Tensor) -> Tensor:
        q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x))) if hasattr(self, "q_a_proj") else self.q_proj(x)
        return q.view(*x.shape[:2], self.num_heads, self.dn + self.dr)

    def forward(
        self, x: Tensor, state: tuple[Tensor, Tensor], key_valid: Tensor | None = None,
        form: MLAForm = MLAForm.AUTO,
    ) -> tuple[Tensor, tuple[Tensor, Tensor]]:
        """x [B, T, D]; state (latent [B, P, C], k_rope [B, P, R]); key_valid [B, P+T] bool over cache + new.
        `form`: AUTO is absorbed for one decoded token with a cache, naive otherwise (modes.MLAForm)."""
        b, t, _ = x.shape
        q = self.query(x).float()
        c_raw, k_r = self.kv_a_proj_with_mqa(x).split([self.rank, self.dr], dim=-1)
        latent = torch.cat([state[0], self.kv_a_layernorm(c_raw)], dim=1)  # [B, S, C], S = P + T
        k_rope = torch.cat([state[1], k_r], dim=1)  # [B, S, R]
        s = latent.shape[1]
        # Causal over absolute positions (new token i sits at P + i) and masked where the key is padding.
        allowed = torch.ones(t, s, dtype=torch.bool, device=x.device).tril(s - t).unsqueeze(0)
        if key_valid is not None:
            allowed = allowed & key_valid[:, None, :].bool()
        if form == MLAForm.AUTO:
            form = MLAForm.ABSORBED if t == 1 and s > 1 else MLAForm.NAIVE
        attend = self._absorbed if form == MLAForm.ABSORBED else self._naive
        o = attend(q, latent.float(), k_rope.float(), allowed.unsqueeze(1))  # [B, T, H, Dv]
        o = o.reshape(b, t, self.num_heads * self.dv)
        if hasattr(self, "g_proj"):
            o = o * torch.sigmoid(self.g_proj(x).float())
        out = self.o_proj(o.to(x.dtype))
        return (out if self.reduce is None else self.reduce(out)), (latent, k_rope)

    def _softmax(self, scores: Tensor, allowed: Tensor) -> Tensor:
        # A fully padded query row (left padding) gets finite garbage, never NaN; its output is never used.
        scores = scores.masked_fill(~allowed, torch.finfo(scores.dtype).min)
        return torch.softmax(scores, dim=-1)

    def _naive(self, q: Tensor, latent: Tensor, k_rope: Tensor, allowed: Tensor) -> Tensor:
        b, s, _ = latent.shape
        kv = (latent @ self.kv_b_proj.weight.float().t()).view(b, s, self.num_heads, self.dn + self.dv)
        k_nope, v = kv.split([self.dn, self.dv], dim=-1)
        q_nope, q_r = q.split([self.dn, self.dr], dim=-1)
        scores = torch.einsum("bthn,bshn->bhts", q_nope, k_nope) + torch.einsum("bthr,bsr->bhts", q_r, k_rope)
        p = self._softmax(scores * self.scale, allowed)
        return torch.einsum("bhts,bshv->bthv", p, v)

    def _absorbed(self, q: Tensor, latent: Tensor, k_rope: Tensor, allowed: Tensor) -> Tensor:
        w = self.kv_b_proj.weight.float().view(self.num_heads, self.dn + self.dv, self.rank)
        w_uk, w_uv = w.split([self.dn, self.dv], dim=1)  # [H, Dn, C], [H, Dv, C]
        q_nope, q_r = q.split([self.dn, self.dr], dim=-1)
        q_lat = torch.einsum("bthn,hnc->bthc", q_nope, w_uk)  # the query in latent space
        scores = torch.einsum("bthc,bsc->bhts", q_lat, latent) + torch.einsum("bthr,bsr->bhts", q_r, k_rope)
        p = self._softmax(scores * self.scale, allowed)
        o_lat = torch.einsum("bhts,bsc->bthc", p, latent)
        return torch.einsum("bthc,hvc->bthv", o_lat, w_uv)
