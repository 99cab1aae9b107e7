"""Sigmoid router with score-correction bias, and the (Stable Latent) MoE block (docs/model.md, "Router and latent
MoE").

  s = sigmoid(x W_r^T) (fp32, on the full hidden x); idx = topk(s + bias, k) [within the top groups];
  w = s[idx] (unbiased), renormalized, times routed_scaling_factor.
  Latent MoE (K3):  y = up(RMSNorm(Σ_j w_j E_idx_j(down(x))))   the norm acts on the reduced latent SUM
  Plain MoE:        y = Σ_j w_j E_idx_j(x)
  out = y + shared(x)

Routed experts are stacked: float `w13` [E, 2I, D_e] ([W1; W3]) and `w2` [E, D_e, I], or MXFP4 buffers
`w13_packed`/`w13_scale`/`w2_packed`/`w2_scale` (uint8). The checkpoint adapter maps per-expert w1/w2/w3.

A model may hold a contiguous slice [a, b) of every layer's routed experts (expert parallelism, docs/architecture.md
"Sharding"): the dispatch then sums that slice only, and `MoE.reduce`, when set, turns the slice's partial latent
sum into the sum over all experts (an all-reduce across the ranks holding the other slices) before the latent norm.
`MoE.exchange`, when set instead, replaces the routed sum: it sends the latent tokens to the ranks holding their
experts and sums what comes back (all-to-all dispatch and combine), calling `routed_local` for this rank's slice;
with tensor parallelism it sends only this rank's share of the slots, and `MoE.reduce` then sums the tp group's
shares.
With tensor parallelism a latent MoE's projections hold a rank's share of their input columns (partition.py,
InputSliceLinear): down's partial latent is summed over the tp group inside it, and up's partial output, with the
shared experts' partial output, by `MoE.out_reduce` (one sum of both).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor, nn

from k3compile.config import K3Config
from k3compile.model.mlp import GatedMLP
from k3compile.model.norms import RMSNorm
from k3compile.modes import ActQuant, ExpertFormat
from k3compile.ops.latent_moe_dispatch import latent_moe_dispatch


class Router(nn.Module):
    def __init__(self, cfg: K3Config) -> None:
        super().__init__()
        self.top_k, self.groups, self.topk_group = cfg.num_experts_per_token, cfg.num_expert_group, cfg.topk_group
        self.renormalize, self.scaling = cfg.moe_renormalize, cfg.routed_scaling_factor
        self.weight = nn.Parameter(torch.zeros(cfg.num_experts, cfg.hidden_size))
        self.register_buffer("e_score_correction_bias", torch.zeros(cfg.num_experts))

    def scores(self, x: Tensor) -> Tensor:
        """Router scores s = sigmoid(x W_r^T) in fp32, [N, E]."""
        return torch.sigmoid(x.float() @ self.weight.float().t())

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """x [N, D] -> (top-k expert indices [N, k] int64, routing weights [N, k] fp32)."""
        s = self.scores(x)
        choice = s + self.e_score_correction_bias.float()
        if self.groups > 1:
            n, e = choice.shape
            grouped = choice.view(n, self.groups, e // self.groups)
            group_score = grouped.topk(2, dim=-1).values.sum(-1)
            keep = torch.zeros_like(group_score, dtype=torch.bool)
            keep.scatter_(1, group_score.topk(self.topk_group, dim=-1).indices, True)
            choice = grouped.masked_fill(~keep.unsqueeze(-1), float("-inf")).view(n, e)
        idx = choice.topk(self.top_k, dim=-1).indices
        w = s.gather(1, idx)
        if self.renormalize:
            w = w / (w.sum(-1, keepdim=True) + 1e-20)
        return idx, w * self.scaling


class RoutedExperts(nn.Module):
    """Stacked routed-expert weights of one layer, float or MXFP4-packed."""

    def __init__(self, cfg: K3Config, experts: tuple[int, int] | None = None) -> None:
        super().__init__()
        start, stop = experts or (0, cfg.num_experts)
        e, d, i = stop - start, cfg.latent_size, cfg.moe_intermediate_size
        self.sliced = experts is not None
        if self.sliced:  # a tensor, not a constant: the ranks of a slice size then share one compiled graph
            self.register_buffer("expert_offset", torch.tensor(start, dtype=torch.int32), persistent=False)
        self.mxfp4 = cfg.expert_format == ExpertFormat.MXFP4
        if self.mxfp4:
            self.register_buffer("w13_packed", torch.zeros(e, 2 * i, d // 2, dtype=torch.uint8))
            self.register_buffer("w13_scale", torch.zeros(e, 2 * i, d // 32, dtype=torch.uint8))
            self.register_buffer("w2_packed", torch.zeros(e, d, i // 2, dtype=torch.uint8))
            self.register_buffer("w2_scale", torch.zeros(e, d, i // 32, dtype=torch.uint8))
        else:
            self.w13 = nn.Parameter(torch.zeros(e, 2 * i, d))
            self.w2 = nn.Parameter(torch.zeros(e, d, i))

    def weights(self) -> tuple[Tensor, Tensor, Tensor | None, Tensor | None]:
        """(w13, w2, w13_scale, w2_scale) as the dispatch op takes them."""
        if self.mxfp4:
            return self.w13_packed, self.w2_packed, self.w13_scale, self.w2_scale
        return self.w13, self.w2, None, None


class MoE(nn.Module):
    def __init__(self, cfg: K3Config, experts: tuple[int, int] | None = None) -> None:
        super().__init__()
        self.cfg = cfg
        self.reduce: Callable[[Tensor], Tensor] | None = None  # the partial sum of a slice -> the sum of all
        self.exchange: Callable | None = None  # (moe, z, idx, w, act_quant) -> the routed sum, over all ranks
        self.out_reduce: Callable[[Tensor], Tensor] | None = None  # tensor parallelism: the output's sum over tp
        self.gate = Router(cfg)
        self.experts = RoutedExperts(cfg, experts)
        if cfg.num_shared_experts:
            self.shared_experts = GatedMLP(cfg, cfg.hidden_size, cfg.num_shared_experts * cfg.moe_intermediate_size)
        if cfg.is_latent_moe:
            self.routed_expert_down_proj = nn.Linear(cfg.hidden_size, cfg.latent_size, bias=False)
            self.routed_expert_up_proj = nn.Linear(cfg.latent_size, cfg.hidden_size, bias=False)
            if cfg.latent_moe_use_norm:
                self.routed_expert_norm = RMSNorm(cfg.latent_size, cfg.rms_norm_eps)

    def routed_partial(self, x: Tensor, idx: Tensor, w: Tensor, act_quant: ActQuant = ActQuant.NONE) -> Tensor:
        """The pre-norm latent sum Σ_j w_j E_idx_j(z) [N, D_e] fp32 over the experts this module holds (all of
        them, or a slice). `act_quant`: MXFP8 fake quantization of the activations in front of the expert matmuls."""
        z = self.routed_expert_down_proj(x) if self.cfg.is_latent_moe else x
        if self.exchange is not None:
            return self.exchange(self, z, idx, w, act_quant)
        return self.routed_local(z, idx, w, act_quant)

    def routed_local(self, z: Tensor, idx: Tensor, w: Tensor, act_quant: ActQuant = ActQuant.NONE) -> Tensor:
        """Σ_j w_j E_idx_j(z) over this module's experts (global indices; others contribute zero)."""
        w13, w2, s13, s2 = self.experts.weights()
        if self.experts.sliced:  # indices local to the slice; the dispatch skips those outside [0, E_slice)
            idx = idx - self.experts.expert_offset.to(idx.dtype)
        return latent_moe_dispatch(
            z, idx, w, w13, w2, s13, s2, 0, self.cfg.hidden_act, self.cfg.activation_situ_beta,
            self.cfg.activation_situ_linear_beta, ActQuant(act_quant).value,
        )

    def forward(self, x: Tensor, act_quant: ActQuant = ActQuant.NONE) -> Tensor:
        shape = x.shape
        xf = x.reshape(-1, shape[-1])
        idx, w = self.gate(xf)
        y = self.routed_partial(xf, idx, w, act_quant)
        if self.reduce is not None:
            y = self.reduce(y)
        if self.cfg.is_latent_moe:
            if self.cfg.latent_moe_use_norm:
                y = self.routed_expert_norm(y)
            y = self.routed_expert_up_proj(y.to(x.dtype))
        y = y.to(x.dtype)
        if self.cfg.num_shared_experts:
            y = y + self.shared_experts(xf)
        if self.out_reduce is not None:
            y = self.out_reduce(y)
        return y.view(shape)
