"""Quantile balancing turns a skewed router into a balanced one (docs/model.md, "Router and latent MoE")."""

from __future__ import annotations

import torch
from builders import tiny_model

from k3compile.calibration import calibrate_router_bias, expert_load, max_overload, quantile_balance


def skewed_scores(m=4096, n=32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(m, n, generator=gen) + torch.linspace(-2.0, 2.0, n)  # experts at the top end win
    return torch.sigmoid(logits)


def test_balances_a_skewed_router():
    s, k = skewed_scores(), 4
    unbiased = max_overload(expert_load(s, torch.zeros(s.shape[1]), k), k)
    assert unbiased > 2.0  # the skew overloads the favourite experts several-fold
    bias = quantile_balance(s, k)
    balanced = max_overload(expert_load(s, bias, k), k)
    assert balanced < 0.05
    # and it generalizes to fresh tokens from the same router
    fresh = skewed_scores(seed=1)
    assert max_overload(expert_load(fresh, bias, k), k) < 0.25


def test_calibrates_model_router_biases():
    m = tiny_model()
    with torch.no_grad():  # skew every router so that balancing has work to do
        for layer in m.model.layers[1:]:
            layer.block_sparse_moe.gate.weight[0] += 3 * layer.block_sparse_moe.gate.weight[1]
    ids = torch.randint(0, m.config.vocab_size, (4, 64), generator=torch.Generator().manual_seed(0))
    biases = calibrate_router_bias(m, ids)
    assert sorted(biases) == list(range(1, m.config.num_hidden_layers))
    for i, b in biases.items():
        assert torch.equal(m.model.layers[i].block_sparse_moe.gate.e_score_correction_bias, b)
        assert b.abs().sum() > 0
