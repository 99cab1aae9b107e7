"""RMSNorm in fp32 (the weight multiplies the fp32 normalized value; the result takes the input's dtype)."""

from __future__ import annotations

import torch
from torch import Tensor, nn


def rms_normalize(x: Tensor, eps: float) -> Tensor:
    x = x.float()
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        return (rms_normalize(x, self.eps) * self.weight.float()).to(x.dtype)
