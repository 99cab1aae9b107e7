"""Kimi Delta Attention layer (docs/model.md, "Kimi Delta Attention"): projections, short causal conv, gates, the k3
recurrence op, output.

Checkpoint names: {q,k,v}_proj, {q,k,v}_conv1d [H*K, 1, W], f_a_proj [K, D], f_b_proj [H*K, K], dt_bias [H*K],
A_log [H], b_proj [H, D], g_proj [H*V, D] (full rank, K3) or g_a_proj [K, D] + g_b_proj [H*V, K], o_norm [V],
o_proj [D, H*V]. With tensor parallelism a module holds its rank's heads and `reduce` sums o_proj's partial output
over the tp group (docs/architecture.md, "Tensor parallelism").
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from k3compile.config import K3Config
from k3compile.model.norms import RMSNorm, rms_normalize
from k3compile.ops.kda_recurrence import kda_recurrence

QK_L2_EPS = 1e-6  # inside the sqrt, as fla's l2norm


def l2_normalize(x: Tensor) -> Tensor:
    x = x.float()
    return x * torch.rsqrt(x.pow(2).sum(-1, keepdim=True) + QK_L2_EPS)


class KimiDeltaAttention(nn.Module):
    def __init__(self, cfg: K3Config) -> None:
        super().__init__()
        d, h, k, w = cfg.hidden_size, cfg.kda_num_heads, cfg.kda_head_dim, cfg.conv_kernel_size
        self.num_heads, self.head_dim, self.conv_size = h, k, w
        self.gate_lower_bound = cfg.gate_lower_bound
        hk = h * k
        self.q_proj = nn.Linear(d, hk, bias=False)
        self.k_proj = nn.Linear(d, hk, bias=False)
        self.v_proj = nn.Linear(d, hk, bias=False)
        self.q_conv1d = nn.Conv1d(hk, hk, w, groups=hk, bias=False)
        self.k_conv1d = nn.Conv1d(hk, hk, w, groups=hk, bias=False)
        self.v_conv1d = nn.Conv1d(hk, hk, w, groups=hk, bias=False)
        self.f_a_proj = nn.Linear(d, k, bias=False)
        self.f_b_proj = nn.Linear(k, hk, bias=False)
        self.dt_bias = nn.Parameter(torch.zeros(hk))
        self.A_log = nn.Parameter(torch.zeros(h))
        self.b_proj = nn.Linear(d, h, bias=False)
        if cfg.use_full_rank_gate:
            self.g_proj = nn.Linear(d, hk, bias=False)
        else:
            self.g_a_proj = nn.Linear(d, k, bias=False)
            self.g_b_proj = nn.Linear(k, hk, bias=False)
        self.o_norm = RMSNorm(k, cfg.rms_norm_eps)
        self.o_proj = nn.Linear(hk, d, bias=False)
        self.reduce: Callable[[Tensor], Tensor] | None = None  # tensor parallelism: the heads' partial sum -> all

    def decay(self, x: Tensor) -> Tensor:
        """Log-space decay g [B, T, H, K] (< 0) from the layer input x."""
        b, t, _ = x.shape
        a = (self.f_b_proj(self.f_a_proj(x)).float() + self.dt_bias.float()).view(b, t, self.num_heads, -1)
        rate = self.A_log.float().exp().view(1, 1, -1, 1)
        if self.gate_lower_bound is not None:
            return self.gate_lower_bound * torch.sigmoid(rate * a)  # K3: g in (lower_bound, 0)
        return -rate * F.softplus(a)  # Kimi-Linear

    def short_conv(self, qkv: Tensor, conv_state: Tensor) -> tuple[Tensor, Tensor]:
        """The causal depthwise convolution of q, k and v over time (docs/model.md, "Kimi Delta Attention"): qkv
        [B, T, 3HK] after the state's W-1 columns [B, 3HK, W-1] -> ([B, T, 3HK], the new state: the window's last W-1
        columns). out[t] = sum over w of window[t + w] * weight[:, w], w in order: each of the W shifted slices of the
        window turned channels-last and multiplied by its weight column, not a Conv over the window, so a compiled
        graph runs the products as elementwise ops along the static channel axis, vectorized at any rows and tokens
        (docs/toolchain.md, "CPU schedules"). The window itself stays time-innermost: joined channels-last
        ([B, W-1+T, 3HK]), its symbolic axis in the middle failed TVM's GPU scheduling (docs/toolchain.md)."""
        t, w = qkv.shape[1], self.conv_size
        window = torch.cat([conv_state.to(qkv.dtype), qkv.transpose(1, 2)], dim=-1)  # [B, 3HK, W-1+T]
        new_state = window[..., window.shape[-1] - (w - 1):]  # [B, 3HK, W-1]
        weight = torch.cat([self.q_conv1d.weight, self.k_conv1d.weight, self.v_conv1d.weight], dim=0)[:, 0]
        out = window[..., 0:t].transpose(1, 2) * weight[:, 0]
        for i in range(1, w):
            out = out + window[..., i:i + t].transpose(1, 2) * weight[:, i]
        return out, new_state

    def output_gate(self, x: Tensor) -> Tensor:
        if hasattr(self, "g_proj"):
            return self.g_proj(x)
        return self.g_b_proj(self.g_a_proj(x))

    def forward(
        self, x: Tensor, state: tuple[Tensor, Tensor], valid: Tensor | None = None
    ) -> tuple[Tensor, tuple[Tensor, Tensor]]:
        """x [B, T, D]; state (conv [B, 3HK, W-1], S [B, H, K, K]); valid [B, T] bool (False = left padding)."""
        conv_state, rec_state = state
        b, t, _ = x.shape
        h, k = self.num_heads, self.head_dim
        if valid is not None:
            x = x * valid.unsqueeze(-1).to(x.dtype)  # padded tokens project to zero: conv state stays zero
        qkv, new_conv_state = self.short_conv(torch.cat([self.q_proj(x), self.k_proj(x), self.v_proj(x)], dim=-1),
                                              conv_state)
        qkv = F.silu(qkv)  # [B, T, 3HK]
        q, kk, v = (z.reshape(b, t, h, k) for z in qkv.split(h * k, dim=-1))
        q = l2_normalize(q) * k**-0.5
        kk = l2_normalize(kk)
        g = self.decay(x)
        beta = torch.sigmoid(self.b_proj(x).float())
        if valid is not None:
            keep = valid.to(torch.float32)
            g = g * keep[..., None, None]  # g = 0, β = 0: a padded token leaves S exactly as it was
            beta = beta * keep[..., None]
        o, new_rec = kda_recurrence(q, kk, v.float(), g, beta, rec_state)
        z = self.output_gate(x).view(b, t, h, k).float()
        o = rms_normalize(o, self.o_norm.eps) * self.o_norm.weight.float() * torch.sigmoid(z)
        out = self.o_proj(o.reshape(b, t, h * k).to(x.dtype))
        return (out if self.reduce is None else self.reduce(out)), (new_conv_state, new_rec)
