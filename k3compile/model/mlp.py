"""Gated MLP (dense layer 0 and the shared experts): down(act(gate(x), up(x))) with SiLU or SiTU."""

from __future__ import annotations

from torch import Tensor, nn

from k3compile.config import K3Config
from k3compile.ops.activations import glu


class GatedMLP(nn.Module):
    def __init__(self, cfg: K3Config, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)
        self.act = cfg.hidden_act
        self.beta, self.linear_beta = cfg.activation_situ_beta, cfg.activation_situ_linear_beta

    def forward(self, x: Tensor) -> Tensor:
        a = glu(self.gate_proj(x), self.up_proj(x), self.act, self.beta, self.linear_beta)
        return self.down_proj(a.to(x.dtype))
