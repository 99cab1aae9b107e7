"""Token generation over a step backend: left-padded batched prefill, then one token per step.

A backend is anything with `step(input_ids [B, T], attention_mask [B, P+T], past) -> (logits [B, T, V], present)`
and `init_past(batch)` (backends.base.Backend): the eager model, onnxruntime, and the compiled targets to come.
Greedy by default; temperature / top-p sampling draws from a seeded generator, so runs repeat exactly.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import Tensor

from k3compile.errors import UserError


class GenerationError(UserError):
    """Bad generation input (token ids, options); the message says which."""


@dataclass
class Generation:
    tokens: list[list[int]]  # new tokens per prompt (stopping after EOS, which is kept)
    prefill_s: float
    decode_s: float
    decode_steps: int
    logits: list[Tensor] = field(default_factory=list, repr=False)  # per step [B, V], when asked for

    @property
    def decode_tokens_per_s(self) -> float:
        return self.decode_steps * len(self.tokens) / self.decode_s if self.decode_s > 0 else float("nan")


def left_pad(prompts: list[list[int]], pad_id: int) -> tuple[Tensor, Tensor]:
    """Prompts -> (input_ids [B, Tmax], attention_mask [B, Tmax]) with padding on the left."""
    t = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), t), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), t), dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, t - len(p):] = torch.tensor(p, dtype=torch.long)
        mask[i, t - len(p):] = 1
    return ids, mask


def check_prompts(prompts: list[list[int]], vocab_size: int) -> None:
    if not prompts or any(len(p) == 0 for p in prompts):
        raise GenerationError("every prompt needs at least one token id")
    for p in prompts:
        bad = [t for t in p if not 0 <= t < vocab_size]
        if bad:
            raise GenerationError(f"token id {bad[0]} is outside the vocabulary 0..{vocab_size - 1}")


def check_request(cfg, prompts: list[list[int]], max_new_tokens: int, temperature: float = 0.0,
                  top_p: float = 1.0) -> None:
    """Everything about a generation request that can be refused before any step (here and in k3compile run)."""
    check_prompts(prompts, cfg.vocab_size)
    if max_new_tokens < 0:
        raise GenerationError("max-new-tokens must be >= 0")
    longest = max(len(p) for p in prompts)
    if longest + max_new_tokens > cfg.max_position_embeddings:
        raise GenerationError(f"a prompt of {longest} tokens plus {max_new_tokens} new tokens "
                              f"exceeds the model's max_position_embeddings ({cfg.max_position_embeddings})")
    if not 0.0 < top_p <= 1.0:
        raise GenerationError("top-p must lie in (0, 1]")
    if not (temperature >= 0 and math.isfinite(temperature)):
        raise GenerationError(f"temperature must be a finite number >= 0, got {temperature}")


def pick_next(logits: Tensor, temperature: float, top_p: float, gen: torch.Generator) -> Tensor:
    """logits [B, V] -> next token ids [B]."""
    if temperature <= 0:
        return logits.argmax(-1)
    # Shift by the max before dividing: for a tiny temperature (1e-45) the quotient is 0 at the max and -inf
    # elsewhere, which softmax takes, where logits / T alone overflows to inf - inf = NaN.
    logits = logits.float()
    probs = torch.softmax((logits - logits.max(-1, keepdim=True).values) / temperature, dim=-1)
    if top_p < 1.0:
        sorted_p, order = probs.sort(dim=-1, descending=True)
        before = sorted_p.cumsum(-1) - sorted_p  # mass strictly above each candidate
        sorted_p = sorted_p.masked_fill(before >= top_p, 0.0)  # keeps at least the top token
        probs = torch.zeros_like(probs).scatter(-1, order, sorted_p)
    return torch.multinomial(probs, 1, generator=gen).squeeze(-1)


def decode_loop(step: Callable[[Tensor, Tensor, int], Tensor], prompts: list[list[int]], max_new_tokens: int,
                pad: int, eos_token_id: int | None = None,
                on_step: Callable[[int], None] | None = None) -> Generation:
    """The one decode loop (generate, and every rank of `k3compile run`): left-padded prompts, then one token per
    step until `max_new_tokens` or every row's EOS. `step(input_ids [B, T], attention_mask [B, P+T], index)` runs
    the model on the whole batch and returns the next token of each row [B] (index 0 is the prefill); the loop keeps
    the rows that finished at `pad`, the tokens, the mask and the timings. `on_step(index)` follows each step."""
    ids, mask = left_pad(prompts, pad)
    b = len(prompts)
    out: list[list[int]] = [[] for _ in range(b)]
    done = torch.zeros(b, dtype=torch.bool)
    t0 = time.perf_counter()
    prefill_s = 0.0
    steps = 0
    for index in range(max_new_tokens):
        nxt = step(ids, mask, index)
        nxt = torch.where(done, torch.full_like(nxt, pad), nxt)
        for i in range(b):
            if not done[i]:
                out[i].append(int(nxt[i]))
        if eos_token_id is not None:
            done |= nxt == eos_token_id
        if index == 0:
            prefill_s = time.perf_counter() - t0
        else:
            steps += 1
        if on_step:
            on_step(index)
        if bool(done.all()):
            break
        ids = nxt.unsqueeze(-1)
        mask = torch.cat([mask, torch.ones_like(ids)], dim=-1)
    total = time.perf_counter() - t0
    return Generation(out, prefill_s, total - prefill_s, steps)


def check_finite(last: Tensor, index: int) -> None:
    """Logits [B, V] of a step: non-finite ones are one GenerationError naming the step and the rows."""
    if not bool(torch.isfinite(last).all()):
        where = "prefill" if index == 0 else f"decode step {index}"
        raise GenerationError(f"{where}: the model produced non-finite logits (NaN or Inf) for prompt(s) "
                              f"{sorted(set(torch.nonzero(~torch.isfinite(last))[:, 0].tolist()))}; "
                              "check the weights")


def step_last_of(backend) -> Callable:
    """The backend's step as generation uses it: (input_ids, attention_mask, past) -> (logits of each row's last
    position [B, 1, V], present). A backend that can skip the other positions' logits says so by a `step_last`
    method (backends/tvm.py); for the others, their step's last position."""
    if hasattr(backend, "step_last"):
        return backend.step_last

    def last(input_ids, attention_mask, past):
        logits, present = backend.step(input_ids, attention_mask, past)
        return logits[:, -1:], present

    return last


def generate(
    backend,
    prompts: list[list[int]],
    max_new_tokens: int,
    temperature: float = 0.0,
    top_p: float = 1.0,
    seed: int = 0,
    eos_token_id: int | None = None,
    keep_logits: bool = False,
    progress: Callable[[int, int], None] | None = None,
) -> Generation:
    cfg = backend.config
    check_request(cfg, prompts, max_new_tokens, temperature, top_p)
    gen = torch.Generator().manual_seed(seed)
    kept: list[Tensor] = []
    past = backend.init_past(len(prompts))
    step_last = step_last_of(backend)

    def step(ids: Tensor, mask: Tensor, index: int) -> Tensor:
        nonlocal past
        logits, past = step_last(ids, mask, past)
        last = logits[:, -1]
        check_finite(last, index)
        if keep_logits:
            kept.append(last.detach().clone())
        return pick_next(last, temperature, top_p, gen)

    result = decode_loop(step, prompts, max_new_tokens, cfg.pad_token_id if cfg.pad_token_id is not None else 0,
                         eos_token_id, progress and (lambda index: progress(index + 1, max_new_tokens)))
    result.logits = kept
    return result
