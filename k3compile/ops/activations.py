"""GLU activations of the family: SiLU (Kimi-Linear) and SiTU (K3, docs/model.md, "SiTU"), both computed in fp32.

SiTU(g, u) = [β · tanh(g/β) · sigmoid(g)] · [β_lin · tanh(u/β_lin)] with β = 4, β_lin = 25: the cap sits on
SiLU's linear factor (gate factor in (-0.2698, 4)), and |output| < β · β_lin = 100.
"""

from __future__ import annotations

import torch
from torch import Tensor

from k3compile.modes import Activation


def situ(gate: Tensor, up: Tensor, beta: float = 4.0, linear_beta: float = 25.0) -> Tensor:
    g, u = gate.float(), up.float()
    return beta * torch.tanh(g / beta) * torch.sigmoid(g) * (linear_beta * torch.tanh(u / linear_beta))


def silu_glu(gate: Tensor, up: Tensor) -> Tensor:
    return torch.nn.functional.silu(gate.float()) * up.float()


def glu(gate: Tensor, up: Tensor, act: str, beta: float = 4.0, linear_beta: float = 25.0) -> Tensor:
    if act == Activation.SITU:
        return situ(gate, up, beta, linear_beta)
    if act == Activation.SILU:
        return silu_glu(gate, up)
    raise ValueError(f"unknown activation {act!r}")
