"""Parameter counts and stored bytes of a config, from a meta-device model (no memory, any size), and the memory
checks run before anything is allocated (docs/architecture.md, "Errors").

Active parameters per token count the routed experts at top-k/num_experts. Bytes are those of the published
storage: bf16 for everything but the routed experts, which take MXFP4 (4 bits + one E8M0 byte per 32) when the
config stores them so, bf16 otherwise. `step_memory` estimates what one forward step holds beyond the weights.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from k3compile.config import ConfigError, K3Config
from k3compile.model.k3 import K3ForCausalLM


@dataclass(frozen=True)
class ModelSize:
    params: int
    active_params: int
    expert_params: int
    bytes: int
    resident_bytes: int  # as this toolchain holds the weights: fp32, routed MXFP4 experts packed


def model_size(cfg: K3Config) -> ModelSize:
    with torch.device("meta"):
        model = K3ForCausalLM(cfg)
    total = active = experts = nbytes = resident = 0
    frac = cfg.num_experts_per_token / cfg.num_experts if cfg.num_experts else 0.0
    seen = set()
    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        if id(t) in seen:  # tied embeddings
            continue
        seen.add(id(t))
        resident += t.numel() * t.element_size()
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
    return ModelSize(total, active, experts, nbytes, resident)


def available_memory() -> int | None:
    """Bytes of memory available to a new allocation (Linux MemAvailable), or None where unknown."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def check_fits(cfg: K3Config) -> None:
    """Refuse to materialize weights that cannot fit in memory (the `k3` preset is 2.8T parameters), before any
    allocation: one error line instead of an out-of-memory kill."""
    need = model_size(cfg).resident_bytes
    have = available_memory()
    if have is not None and need > 0.9 * have:
        raise ConfigError(f"{cfg.name}: its weights need {need / 2**30:,.1f} GiB in memory, more than the "
                          f"{have / 2**30:,.1f} GiB available here (use a smaller preset or config)")


def step_memory(cfg: K3Config, batch: int, new: int, past: int = 0) -> int:
    """Bytes one forward step of `batch` rows of `new` tokens after `past` cached ones holds beyond the weights, fp32
    as the backends here run it (an estimate of its largest live tensors, not a measurement): the decode state in
    and out (KDA states, MLA cache of past + new tokens), the logits [B, T, vocab] and, with an MLA layer, three
    attention scores [B, H, T, past + T] at once (the eager model's two einsums' sum, then scaled and masked:
    model/mla.py, `_naive`)."""
    from k3compile.sharding import Mesh, make_plan
    from k3compile.sharding.cost import rank_state

    whole = make_plan(cfg, Mesh()).rank(0)  # one rank holding every layer
    state = sum(rank_state(cfg, whole, batch, past + new, 4).values())
    scores = 3 * batch * cfg.num_attention_heads * new * (past + new) * 4 if cfg.full_attn_layers else 0
    return 2 * state + batch * new * cfg.vocab_size * 4 + scores


def check_step_fits(cfg: K3Config, what: str, batch: int, new: int, past: int = 0, weights: int = 0) -> None:
    """Refuse, before any allocation, a forward step (step_memory) that with `weights` bytes of weights held
    beside it cannot fit in this machine's memory: one error line naming `what` (the option that asked for it)."""
    need = weights + step_memory(cfg, batch, new, past)
    have = available_memory()
    if have is not None and need > 0.9 * have:
        raise ConfigError(f"{what}: a step of {batch} x {new} tokens of {cfg.name} needs ~{need / 2**30:,.1f} GiB in "
                          f"memory with its weights, more than the {have / 2**30:,.1f} GiB available here")
