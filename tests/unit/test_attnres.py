"""Block Attention Residuals against the equations on hand-checked small cases (tier 1)."""

from __future__ import annotations

import math

import torch
from torch import nn

from k3compile.model.attnres import attn_res_mix
from k3compile.model.norms import RMSNorm


def test_mix_hand_checked():
    proj = nn.Linear(2, 1, bias=False)
    norm = RMSNorm(2, eps=0.0)
    with torch.no_grad():
        proj.weight.copy_(torch.tensor([[1.0, 0.0]]))
        norm.weight.copy_(torch.tensor([2.0, 1.0]))
    a = torch.tensor([[[3.0, 4.0]]])  # rms = sqrt(12.5)
    b = torch.tensor([[[1.0, 1.0]]])  # rms = 1
    # scores: (3/sqrt(12.5))*2*1 and (1/1)*2*1  — no 1/sqrt(D)
    s_a, s_b = 2 * 3 / math.sqrt(12.5), 2.0
    p_a = math.exp(s_a) / (math.exp(s_a) + math.exp(s_b))
    want = p_a * a + (1 - p_a) * b
    got = attn_res_mix([a], b, proj, norm)
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)


def test_mix_is_convex_and_scale_aware():
    proj = nn.Linear(4, 1, bias=False)
    norm = RMSNorm(4, eps=1e-5)
    with torch.no_grad():
        proj.weight.zero_()  # zero query: uniform mix of the sources
    srcs = [torch.randn(2, 3, 4) for _ in range(3)]
    got = attn_res_mix(srcs[:2], srcs[2], proj, norm)
    torch.testing.assert_close(got, sum(srcs) / 3, atol=1e-6, rtol=1e-6)
    # scores see normalized sources (equal here, eps 0), but the mix combines the RAW ones
    norm.eps = 0.0
    with torch.no_grad():
        proj.weight.fill_(1.0)
    x = torch.ones(1, 1, 4)
    torch.testing.assert_close(attn_res_mix([x], 10 * x, proj, norm), torch.full((1, 1, 4), 5.5))
