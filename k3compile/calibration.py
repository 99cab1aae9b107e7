"""Quantile balancing (docs/model.md, "Router and latent MoE"): the router's `e_score_correction_bias` from router
scores on sample data.

For m tokens, n experts and top-k, alternate
    α_i = (1 - k/n)-quantile over experts of (s_i - β)        (per token)
    β_j = (1 - k/n)-quantile over tokens of (s_j - α)         (per expert)
so that each token has k experts with s - α - β > 0 and each expert is above its threshold for a k/n share of
tokens. Routing takes top-k of s - β, so the checkpoint bias is b = -β. (J. Su, kexue.fm/archives/11619.)
"""

from __future__ import annotations

import torch
from torch import Tensor

from k3compile.model.k3 import K3ForCausalLM


def quantile_balance(scores: Tensor, top_k: int, iters: int = 30) -> Tensor:
    """scores [m, n] (router scores s) -> bias [n] to add to the scores before top-k."""
    s = scores.double()
    m, n = s.shape
    q = 1.0 - top_k / n
    beta = torch.zeros(n, dtype=s.dtype)
    for _ in range(iters):
        alpha = torch.quantile(s - beta, q, dim=1, keepdim=True)  # [m, 1]
        beta = torch.quantile(s - alpha, q, dim=0)  # [n]
    return (-beta).to(scores.dtype)


def expert_load(scores: Tensor, bias: Tensor, top_k: int) -> Tensor:
    """Tokens routed to each expert [n] when taking top-k of scores + bias."""
    idx = (scores + bias).topk(top_k, dim=-1).indices
    return torch.bincount(idx.flatten(), minlength=scores.shape[1])


def max_overload(load: Tensor, top_k: int) -> float:
    """max_j load_j / (mean load) - 1: 0 is perfect balance."""
    mean = load.sum().item() / load.numel()
    return load.max().item() / mean - 1.0


@torch.no_grad()
def calibrate_router_bias(model: K3ForCausalLM, input_ids: Tensor, iters: int = 30) -> dict[int, Tensor]:
    """Run the model on sample tokens, collect each MoE layer's router scores, and set (and return) every
    layer's e_score_correction_bias from quantile balancing."""
    captured: dict[int, Tensor] = {}
    hooks = []
    for i, layer in enumerate(model.model.layers):
        moe = getattr(layer, "block_sparse_moe", None)
        if moe is None:
            continue

        def hook(mod, args, out, i=i):
            captured[i] = mod.scores(args[0])

        hooks.append(moe.gate.register_forward_hook(hook))
    try:
        model(input_ids)
    finally:
        for h in hooks:
            h.remove()
    k = model.config.num_experts_per_token
    biases = {}
    for i, s in captured.items():
        # Each layer's scores depend on the layers before it, whose biases change routing; calibrating all
        # layers from one pass is the usual one-shot approximation.
        biases[i] = quantile_balance(s, k, iters)
        model.model.layers[i].block_sparse_moe.gate.e_score_correction_bias.copy_(biases[i])
    return biases
