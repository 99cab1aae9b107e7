"""Token generation over a step backend: left-padded batched prefill, then one token per step.

A backend is anything with `step(input_ids [B, T], attention_mask [B, P+T], past) -> (logits [B, T, V], present)`
and `init_past(batch)` (backends.base.Backend): the eager model, onnxruntime, and the compiled targets to come.
Greedy by default; temperature / top-p sampling draws from a seeded generator, so runs repeat exactly. The loop,
the sampler, the request's checks and left padding are decoding.py's (torch-free, shared with lean.py); this module
gives them torch tensors.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from k3compile import decoding
from k3compile.decoding import (
    Generation,
    GenerationError,
    check_chunk,
    check_prompts,
    check_request,
    default_prefill_chunk,
)
from k3compile.state import join_rows, on_host
from k3compile.threads import glue_threads

__all__ = ["Generation", "GenerationError", "RowPrefill", "check_chunk", "check_prompts", "check_request",
           "decode_loop", "default_prefill_chunk", "generate", "left_pad", "pick_next", "prefill_chunks",
           "prefill_rows", "step_last_of"]


def left_pad(prompts: list[list[int]], pad_id: int) -> tuple[Tensor, Tensor]:
    """decoding.left_pad as torch tensors."""
    ids, mask = decoding.left_pad(prompts, pad_id)
    return torch.from_numpy(ids), torch.from_numpy(mask)


def pick_next(logits: Tensor, sampler: decoding.Sampler) -> Tensor:
    """logits [B, V] -> next token ids [B]: decoding.Sampler's pick (shared with every runtime, never torch's RNG),
    on a numpy view of the fp32 logits."""
    return torch.from_numpy(sampler(logits.detach().float().cpu().numpy()))


def decode_loop(step: Callable[[Tensor, Tensor, int], Tensor], prompts: list[list[int]], max_new_tokens: int,
                pad: int, eos_token_id: int | None = None,
                on_step: Callable[[int], None] | None = None) -> Generation:
    """decoding.decode_loop with `step` given torch tensors (its ids and mask shared, not copied)."""
    return decoding.decode_loop(lambda ids, mask, index: step(torch.from_numpy(ids), torch.from_numpy(mask), index),
                                prompts, max_new_tokens, pad, eos_token_id, on_step)


def check_finite(last: Tensor, index: int) -> None:
    """decoding.check_finite of torch logits."""
    decoding.check_finite(last.detach().float().cpu().numpy(), index)


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


def prefill_chunks(step_last: Callable, ids: Tensor, mask: Tensor, past, chunk: int | None):
    """A left-padded batch's prefill (ids [B, T], mask [B, P+T]) in steps of at most `chunk` tokens, each fed the
    state the one before returned: the memory of a chunk's attention, whatever T is. -> (last logits [B, 1, V],
    present)."""
    t = ids.shape[1]
    chunk = chunk or t
    p = mask.shape[1] - t
    logits = None
    for start in range(0, t, chunk):
        stop = min(t, start + chunk)
        logits, past = step_last(ids[:, start:stop], mask[:, :p + stop], past)
    return logits, past


class RowPrefill:
    """One prompt's prefill as a single row, a chunk per `advance()` (so a server runs decode steps between them),
    resumed from the longest prefix `cache` holds (prefix_cache.py) and storing the state at every block boundary it
    passes. Chunks end at every `chunk` tokens (None: default_prefill_chunk) and at every cache block boundary.
    When `done`: `logits` [1, V] of the last position, `past` the row's state (batch 1), `mask` [1, len(prompt)] of
    ones."""

    def __init__(self, backend, prompt: list[int], chunk: int | None = None, cache=None) -> None:
        check_chunk(chunk)
        self.backend, self.prompt, self.cache = backend, list(prompt), cache
        self.chunk = chunk or default_prefill_chunk(backend.config, 1, len(self.prompt))
        self._step = step_last_of(backend)
        self.resumed, past = cache.lookup(self.prompt) if cache is not None else (0, None)
        self.past = past if past is not None else backend.init_past(1)
        self.n = self.resumed
        self.logits: Tensor | None = None

    @property
    def done(self) -> bool:
        return self.n == len(self.prompt)

    @property
    def mask(self) -> Tensor:
        return torch.ones(1, self.n, dtype=torch.long)

    def advance(self) -> None:
        start = self.n
        stop = min(len(self.prompt), start + self.chunk)
        if self.cache is not None:
            stop = min(stop, (start // self.cache.block + 1) * self.cache.block)
        ids = torch.tensor([self.prompt[start:stop]], dtype=torch.long)
        logits, self.past = self._step(ids, torch.ones(1, stop, dtype=torch.long), self.past)
        self.n = stop
        if self.cache is not None and stop % self.cache.block == 0:
            self.cache.store(self.prompt[:stop], on_host(self.backend, self.past))
        if self.done:
            self.logits = logits[:, -1]

    def run(self) -> RowPrefill:
        while not self.done:
            self.advance()
        return self


def prefill_rows(backend, prompts: list[list[int]], chunk: int | None = None, cache=None):
    """Each prompt prefilled as its own row (RowPrefill: from the cache, in chunks), the rows joined into one
    left-padded batch (state.join_rows). -> (last logits [B, V], present, mask [B, max len])."""
    rows = [RowPrefill(backend, p, chunk, cache).run() for p in prompts]
    if len(rows) == 1:
        return rows[0].logits, rows[0].past, rows[0].mask
    past, mask = join_rows(backend.config, [(on_host(backend, r.past), r.mask) for r in rows])
    return torch.cat([r.logits for r in rows]), past, mask


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
    prefill_chunk: int | None = None,
    cache=None,
) -> Generation:
    """`prefill_chunk`: the prefill runs in steps of at most that many tokens (prefill_chunks; None:
    default_prefill_chunk for the batch and its longest prompt); `cache`: a
    prefix_cache.PrefixCache each prompt resumes from and fills (the prompts are then prefilled one row each and
    joined, prefill_rows)."""
    cfg = backend.config
    check_request(cfg, prompts, max_new_tokens, temperature, top_p)
    check_chunk(prefill_chunk)
    sampler = decoding.Sampler(temperature, top_p, seed)
    kept: list[Tensor] = []
    past = backend.init_past(len(prompts))
    step_last = step_last_of(backend)

    def step(ids: Tensor, mask: Tensor, index: int) -> Tensor:
        nonlocal past
        if index > 0:
            logits, past = step_last(ids, mask, past)
            last = logits[:, -1]
        elif cache is not None:
            last, past, _ = prefill_rows(backend, prompts, prefill_chunk, cache)
        else:
            chunk = prefill_chunk or default_prefill_chunk(cfg, len(prompts), ids.shape[1])
            logits, past = prefill_chunks(step_last, ids, mask, past, chunk)
            last = logits[:, -1]
        check_finite(last, index)
        if keep_logits:
            kept.append(last.detach().clone())
        return pick_next(last, sampler)

    with glue_threads(backend):  # torch's threads would spin against the backend's own (threads.py)
        result = decode_loop(step, prompts, max_new_tokens, cfg.pad_token_id if cfg.pad_token_id is not None else 0,
                             eos_token_id, progress and (lambda index: progress(index + 1, max_new_tokens)))
    result.logits = kept
    return result
