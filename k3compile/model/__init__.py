"""The kimi_linear family (Kimi-Linear, Kimi K3) as plain PyTorch: no export, sharding or TVM code here."""

from k3compile.model.cache import Past, init_past
from k3compile.model.k3 import K3ForCausalLM

__all__ = ["K3ForCausalLM", "Past", "init_past"]
