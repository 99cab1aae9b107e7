"""What a decode needs besides the model, without torch (docs/architecture.md, "The torch-free decode"): the
request's checks, left padding, the prefill chunk's default size, the one sampler and the one decode loop.
generate.py wraps it for torch backends, runtime/worker.py for a rank, lean.py runs it on a CPU artifact in a
process that never imports torch.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from k3compile.errors import UserError


class GenerationError(UserError):
    """Bad generation input (token ids, options); the message says which."""


@dataclass
class Generation:
    tokens: list[list[int]]  # new tokens per prompt (stopping after EOS, which is kept)
    prefill_s: float
    decode_s: float
    decode_steps: int
    logits: list = field(default_factory=list, repr=False)  # per step [B, V], when asked for

    @property
    def decode_tokens_per_s(self) -> float:
        return self.decode_steps * len(self.tokens) / self.decode_s if self.decode_s > 0 else float("nan")


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


def left_pad(prompts: list[list[int]], pad_id: int) -> tuple[np.ndarray, np.ndarray]:
    """Prompts -> (input_ids [B, Tmax], attention_mask [B, Tmax]), int64, with padding on the left."""
    t = max(len(p) for p in prompts)
    ids = np.full((len(prompts), t), pad_id, dtype=np.int64)
    mask = np.zeros((len(prompts), t), dtype=np.int64)
    for i, p in enumerate(prompts):
        ids[i, t - len(p):] = p
        mask[i, t - len(p):] = 1
    return ids, mask


def decode_loop(step: Callable, prompts: list[list[int]], max_new_tokens: int, pad: int,
                eos_token_id: int | None = None, on_step: Callable[[int], None] | None = None) -> Generation:
    """The one decode loop (generate, every rank of `k3compile run`, lean.py): left-padded prompts, then one token
    per step until `max_new_tokens` or every row's EOS. `step(input_ids [B, T], attention_mask [B, P+T], index)`
    (int64 numpy arrays) runs the model on the whole batch and returns the next token of each row [B] (anything
    numpy reads: an array, a CPU tensor; index 0 is the prefill); the loop keeps the rows that finished at `pad`,
    the tokens, the mask and the timings. `on_step(index)` follows each step."""
    ids, mask = left_pad(prompts, pad)
    b = len(prompts)
    out: list[list[int]] = [[] for _ in range(b)]
    done = np.zeros(b, dtype=bool)
    clock = StepClock()
    for index in range(max_new_tokens):
        nxt = np.where(done, pad, np.asarray(step(ids, mask, index), dtype=np.int64).reshape(b))
        for i in range(b):
            if not done[i]:
                out[i].append(int(nxt[i]))
        if eos_token_id is not None:
            done |= nxt == eos_token_id
        clock.stepped(index, on_step)
        if done.all():
            break
        ids = np.ascontiguousarray(nxt[:, None])
        mask = np.concatenate([mask, np.ones((b, 1), dtype=np.int64)], axis=1)
    return clock.generation(out)


class StepClock:
    """A decode loop's timings (decode_loop, the sharded runtime's micro-batched loop): the prefill (step 0) apart
    from the decode steps that follow it."""

    def __init__(self) -> None:
        self.t0 = time.perf_counter()
        self.prefill_s, self.steps = 0.0, 0

    def stepped(self, index: int, on_step: Callable[[int], None] | None = None) -> None:
        """Step `index` has run."""
        if index == 0:
            self.prefill_s = time.perf_counter() - self.t0
        else:
            self.steps += 1
        if on_step:
            on_step(index)

    def generation(self, tokens: list[list[int]]) -> Generation:
        return Generation(tokens, self.prefill_s, time.perf_counter() - self.t0 - self.prefill_s, self.steps)


class Sampler:
    """Each row's next token from its last logits [B, V]: the argmax (the first of equal maxima) at temperature 0;
    else a draw from the softmax of logits / temperature, cut to the top-p nucleus (the most probable tokens whose
    mass before them is below top_p: at least the top one), with one uniform per row, in row order, from a PCG64
    generator seeded with `seed`. numpy's generator and this arithmetic are the same in every runtime that decodes
    (generate's torch backends, lean.py's torch-free one, a sharded run's token source, the server's rows), so a seed
    draws the same tokens from the same logits in each."""

    def __init__(self, temperature: float = 0.0, top_p: float = 1.0, seed: int = 0) -> None:
        self.temperature, self.top_p = temperature, top_p
        self.rng = np.random.Generator(np.random.PCG64(seed)) if temperature > 0 else None

    @property
    def greedy(self) -> bool:
        return self.rng is None

    def __call__(self, logits: np.ndarray) -> np.ndarray:
        """logits [B, V] (finite: check_finite) -> next token ids [B], int64."""
        if self.rng is None:
            return np.argmax(logits, axis=-1).astype(np.int64)
        # In float64, shifted by the max before dividing: for a tiny temperature (1e-45) the quotient is 0 at the
        # max and -inf elsewhere, which exp takes, where logits / T alone overflows to inf - inf = NaN.
        x = np.asarray(logits, dtype=np.float64)
        probs = np.exp((x - x.max(axis=-1, keepdims=True)) / self.temperature)
        probs /= probs.sum(axis=-1, keepdims=True)
        if self.top_p < 1.0:
            order = np.argsort(-probs, axis=-1, kind="stable")
            ranked = np.take_along_axis(probs, order, axis=-1)
            before = np.cumsum(ranked, axis=-1) - ranked  # mass strictly above each candidate
            np.put_along_axis(probs, order, np.where(before >= self.top_p, 0.0, ranked), axis=-1)
        cdf = np.cumsum(probs, axis=-1)
        target = self.rng.random(len(probs)) * cdf[:, -1]
        # the first token whose cumulative mass exceeds the target: it has mass (cdf[i] > target >= cdf[i - 1])
        return (cdf <= target[:, None]).sum(axis=-1).astype(np.int64)


def check_finite(last: np.ndarray, index: int) -> None:
    """Logits [B, V] of a step: non-finite ones are one GenerationError naming the step and the rows."""
    finite = np.isfinite(last)
    if not finite.all():
        where = "prefill" if index == 0 else f"decode step {index}"
        raise GenerationError(f"{where}: the model produced non-finite logits (NaN or Inf) for prompt(s) "
                              f"{sorted(set(np.nonzero(~finite)[0].tolist()))}; check the weights")


def default_prefill_chunk(cfg, batch: int = 1, context: int | None = None, available: int | None = None) -> int:
    """Tokens per prefill step when none is asked (docs/architecture.md, "Serving"): a chunk's attention
    scores [batch, heads, chunk, context] (fp32, four such tensors live at once in the eager model) in an eighth of
    the memory available now, as a power of two in [64, 4096]. `context`: the positions the prefill reaches."""
    import psutil

    context = context or cfg.max_position_embeddings
    available = psutil.virtual_memory().available if available is None else available
    per_token = batch * max(cfg.num_attention_heads, cfg.kda_num_heads) * context * 4 * 4
    chunk = 4096
    while chunk > 64 and chunk * per_token > available // 8:
        chunk //= 2
    return chunk


def check_chunk(chunk: int | None) -> None:
    if chunk is not None and chunk < 1:
        raise GenerationError(f"the prefill chunk must be at least 1 token, got {chunk}")
