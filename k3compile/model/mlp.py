"""Gated MLP (dense layer 0 and the shared experts): down(act(gate(x), up(x))) with SiLU or SiTU. With tensor
parallelism a module holds its rank's share of the intermediate width and `reduce` sums down's partial output over
the tp group."""

from __future__ import annotations

from collections.abc import Callable

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
        self.reduce: Callable[[Tensor], Tensor] | None = None

    def forward(self, x: Tensor) -> Tensor:
        a = glu(self.gate_proj(x), self.up_proj(x), self.act, self.beta, self.linear_beta)
        out = self.down_proj(a.to(x.dtype))
        return out if self.reduce is None else self.reduce(out)
