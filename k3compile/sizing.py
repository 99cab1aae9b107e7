"""Parameter counts and stored bytes of a config, from a meta-device model (no memory, any size).

Active parameters per token count the routed experts at top-k/num_experts. Bytes are those of the published
storage: bf16 for everything but the routed experts, which take MXFP4 (4 bits + one E8M0 byte per 32) when the
config stores them so, bf16 otherwise.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from k3compile.config import K3Config
from k3compile.model.k3 import K3ForCausalLM


@dataclass(frozen=True)
class ModelSize:
    params: int
    active_params: int
    expert_params: int
    bytes: int


def model_size(cfg: K3Config) -> ModelSize:
    with torch.device("meta"):
        model = K3ForCausalLM(cfg)
    total = active = experts = nbytes = 0
    frac = cfg.num_experts_per_token / cfg.num_experts if cfg.num_experts else 0.0
    seen = set()
    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        if id(t) in seen:  # tied embeddings
            continue
        seen.add(id(t))
        if name.endswith("_scale"):
            nbytes += t.numel()
            continue
        n = t.numel() * (2 if name.endswith("_packed") else 1)
        total += n
        if ".experts." in name:
            experts += n
            active += round(n * frac)
            nbytes += t.numel() if name.endswith("_packed") else 2 * n
        else:
            active += n
            nbytes += 2 * n
    return ModelSize(total, active, experts, nbytes)
