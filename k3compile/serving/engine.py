"""The serving engine (docs/architecture.md, "Serving"): continuous batching of generation requests over any step
backend, in one thread that owns the backend and the decode state.

Each turn of the engine's loop runs at most one prefill chunk of the request being admitted (a single row,
generate.RowPrefill: resumed from the prefix cache, in chunks, storing its blocks) and then one decode step of the
running batch, so a long prompt delays the running streams by a chunk at a time, never by its whole prefill. Short
prompts waiting together (one chunk each, shorter than a cache block: nothing to resume or store) are prefilled in
one left-padded step instead and join together (docs/architecture.md, "Serving"). A row
joins the batch when its prefill ends (state.join_rows: left padding), and leaves it when it finishes or its client
goes (state.take_rows), between steps; its tokens are picked with its own sampling settings and its own seeded
sampler (decoding.Sampler, the one every runtime uses), so a request's tokens do not depend on what else runs beside
it beyond the float rounding of a batched matmul. An idle engine woken by short prompts waits while more keep
arriving (each within `batch_wait` seconds of the last, BATCH_WAIT_ROUNDS such waits at most) before it prefills
them: clients that send together are prefilled together. Requests wait in a bounded queue (`QueueFull` when it is
full); what can be refused is refused in `submit`, before any work. Events go to each request's `emit` from the
engine thread.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

from k3compile.decoding import Sampler
from k3compile.errors import UserError
from k3compile.generate import (
    GenerationError,
    RowPrefill,
    check_prompts,
    default_prefill_chunk,
    left_pad,
    pick_next,
    step_last_of,
)
from k3compile.state import join_rows, on_host, take_rows
from k3compile.threads import glue_threads

log = logging.getLogger(__name__)

# How long an idle engine woken by short prompts waits for the next to arrive, and how many such waits at most
# (docs/architecture.md, "Serving"). 8 streamed requests sent at once by one client reach the engine over ~10 ms
# (the event loop reads and checks each, ~0.5-3 ms apart, measured on k3-small): without the wait the first was
# prefilled alone and the rest in a second step, ~80 ms more of a k3-small batch-8 run's ~1.9 s. A lone request
# pays one wait in its time to first token.
BATCH_WAIT_S = 0.003
BATCH_WAIT_ROUNDS = 10


class RequestError(UserError):
    """A request refused before any work (HTTP 400); `param` names the field at fault."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class QueueFull(UserError):
    """The waiting queue is full (HTTP 429)."""


@dataclass(frozen=True)
class Sampling:
    max_tokens: int
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False  # generate max_tokens whatever the model picks (benchmarks)


@dataclass
class Event:
    kind: str  # "token" (token_ids and the text they add), "done" (finish_reason), "error" (message)
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    message: str = ""


class Request:
    def __init__(self, prompt: list[int], sampling: Sampling, emit: Callable[[Event], None]) -> None:
        self.id = uuid.uuid4().hex
        self.prompt, self.sampling, self.emit = list(prompt), sampling, emit
        self.tokens: list[int] = []
        self.cancelled = False
        self.cached_tokens = 0  # prompt tokens the prefix cache supplied
        self.submitted = time.monotonic()
        self.first_token_at: float | None = None
        self.last_token_at: float | None = None
        self._text = ""  # the text of `tokens`, as far as sent
        seed = sampling.seed if sampling.seed is not None else int.from_bytes(os.urandom(8), "little") >> 1
        self.sampler = Sampler(sampling.temperature, sampling.top_p, seed)

    def cancel(self) -> None:
        """The client went: the engine drops the request at its next step (queued or running)."""
        self.cancelled = True


class _Row:
    def __init__(self, request: Request, token: int) -> None:
        self.request, self.token = request, token


def _finite_rows(last) -> list[bool]:
    """Whether each row of the logits `last` [B, V] is finite: one pass over the batch (docs/architecture.md,
    "Serving"; a check per row, two torch calls each, cost ~0.6 ms of a k3-small batch-8 turn, and each call let the
    server's event loop take the GIL from the engine)."""
    return np.isfinite(last.detach().float().cpu().numpy()).all(axis=1).tolist()


def _pick(request: Request, last) -> int:
    """The next token of `request`'s row from its last logits [1, V], with its own sampler."""
    return int(pick_next(last, request.sampler)[0])


class Engine:
    def __init__(self, backend, tokenizer=None, max_batch: int = 8, max_queue: int = 64,
                 prefill_chunk: int | None = None, cache=None, metrics=None, batch_wait: float = BATCH_WAIT_S) -> None:
        if max_batch < 1 or max_queue < 0 or not batch_wait >= 0:
            raise UserError(f"max batch must be >= 1, max queue and batch wait >= 0, got {max_batch}, {max_queue} "
                            f"and {batch_wait}")
        self.batch_wait = batch_wait
        self.backend, self.tokenizer, self.cache, self.metrics = backend, tokenizer, cache, metrics
        self.config = backend.config
        self.max_batch, self.max_queue, self.prefill_chunk = max_batch, max_queue, prefill_chunk
        self.context = self.config.max_position_embeddings
        eos = self.config.eos_token_id
        self.eos_ids = set(eos if isinstance(eos, (list, tuple)) else [] if eos is None else [eos])
        if tokenizer is not None:
            self.eos_ids |= set(tokenizer.eos_ids)
        self._step = step_last_of(backend)
        self._waiting: deque[Request] = deque()
        self._arrivals = 0  # requests submitted so far (_gather: whether another came while it waited)
        self._admitting: tuple[Request, RowPrefill] | None = None
        self._rows: list[_Row] = []
        self._past = None
        self._mask: torch.Tensor | None = None
        self._cond = threading.Condition()
        self._stop = False
        self._thread: threading.Thread | None = None
        self.steps = 0

    # ---- the caller's side (any thread) ----------------------------------------------------------------------------

    def check(self, prompt: list[int], sampling: Sampling) -> None:
        """Everything about a request that is refused before any work: RequestError naming the field."""
        try:
            check_prompts([prompt], self.config.vocab_size)
        except GenerationError as e:
            raise RequestError(str(e), "prompt") from None
        if sampling.max_tokens < 1:
            raise RequestError(f"max_tokens must be at least 1, got {sampling.max_tokens}", "max_tokens")
        if len(prompt) + sampling.max_tokens > self.context:
            raise RequestError(f"the prompt's {len(prompt)} tokens plus max_tokens {sampling.max_tokens} exceed the "
                               f"model's context of {self.context} tokens", "max_tokens")
        if not (sampling.temperature >= 0 and sampling.temperature != float("inf")):
            raise RequestError(f"temperature must be a finite number >= 0, got {sampling.temperature}", "temperature")
        if not 0.0 < sampling.top_p <= 1.0:
            raise RequestError(f"top_p must lie in (0, 1], got {sampling.top_p}", "top_p")
        if sampling.seed is not None and not 0 <= sampling.seed < 2**64:  # the seeds `generate --seed` takes
            raise RequestError(f"seed must lie in [0, 2^64), got {sampling.seed}", "seed")

    def submit(self, request: Request) -> None:
        self.check(request.prompt, request.sampling)
        with self._cond:
            if self._stop:
                raise QueueFull("the server is shutting down")
            if len(self._waiting) >= self.max_queue:
                raise QueueFull(f"the queue holds {self.max_queue} waiting requests: try again later")
            self._waiting.append(request)
            self._arrivals += 1
            self._cond.notify()
        if self.metrics:
            self.metrics.queue(len(self._waiting))

    @property
    def queue_depth(self) -> int:
        return len(self._waiting)

    @property
    def running(self) -> int:
        return len(self._rows) + (self._admitting is not None)

    def start(self) -> Engine:
        self._thread = threading.Thread(target=self._run, name="k3compile-engine", daemon=True)
        self._thread.start()
        return self

    def close(self) -> None:
        with self._cond:
            self._stop = True
            self._cond.notify()
        if self._thread is not None:
            self._thread.join()

    def __enter__(self) -> Engine:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()

    # ---- the engine thread -----------------------------------------------------------------------------------------

    def _run(self) -> None:
        with torch.no_grad(), glue_threads(self.backend):  # torch's threads would spin against TVM's (threads.py)
            while True:
                with self._cond:
                    while not self._stop and not self._waiting and not self._rows and self._admitting is None:
                        self._cond.wait()
                    if self._stop:
                        break
                    self._gather()
                self.turn()
        for request in [*self._waiting, *(r.request for r in self._rows),
                        *([self._admitting[0]] if self._admitting else [])]:
            request.emit(Event("error", message="the server shut down"))

    def _gather(self) -> None:
        """(Holding the condition.) An idle engine whose waiting requests are all short (`_short`: prefilled
        together) waits while more arrive, each within `batch_wait` seconds of the last, BATCH_WAIT_ROUNDS waits at
        most, until the batch is full: requests sent together are prefilled in one step, not the first alone."""
        if self.batch_wait <= 0 or self._rows or self._admitting is not None:
            return
        for _ in range(BATCH_WAIT_ROUNDS):
            if (self._stop or not self._waiting or len(self._waiting) >= self.max_batch
                    or not all(self._short(r) for r in self._waiting)):
                return
            seen = self._arrivals
            self._cond.wait(self.batch_wait)
            if self._arrivals == seen:
                return

    def turn(self) -> None:
        """One turn: admit a waiting request (one prefill chunk), then one decode step of the running batch."""
        self._drop_cancelled()
        if self._admitting is None and len(self._rows) < self.max_batch:
            with self._cond:
                request = self._waiting.popleft() if self._waiting else None
                together = [request] if request is not None and self._short(request) else []
                while (together and self._waiting and len(self._rows) + len(together) < self.max_batch
                       and self._short(self._waiting[0])):
                    together.append(self._waiting.popleft())
            if self.metrics:
                self.metrics.queue(len(self._waiting))
            if len(together) > 1:
                self._guard(together, lambda: self._prefill_together(together))
            elif request is not None:
                self._guard([request], lambda: self._begin(request))
        if self._admitting is not None:
            request = self._admitting[0]
            self._guard([request], self._prefill_chunk)
        if self._rows:
            self._guard([r.request for r in self._rows], self._decode)

    def _guard(self, requests: list[Request], work: Callable[[], None]) -> None:
        """Run `work`; an error fails the requests it concerns (their clients get it), and the engine goes on."""
        try:
            work()
        except Exception as e:  # the server outlives any one request
            if not isinstance(e, UserError):
                log.exception("a step failed")
            message = str(e) if isinstance(e, UserError) else f"internal error: {type(e).__name__}: {e}"
            ids = {r.id for r in requests}
            for r in requests:
                r.emit(Event("error", message=message))
            if self._admitting is not None and self._admitting[0].id in ids:
                self._admitting = None
            if any(r.request.id in ids for r in self._rows):
                self._rows, self._past, self._mask = [], None, None

    def _short(self, request: Request) -> bool:
        """Whether `request`'s prompt is one prefill chunk that the prefix cache neither resumes nor stores (shorter
        than a cache block): such prompts waiting together are prefilled as one left-padded batch."""
        n = len(request.prompt)
        chunk = self.prefill_chunk or default_prefill_chunk(self.config, 1, n)
        return n <= chunk and (self.cache is None or n < self.cache.block)

    def _prefill_together(self, requests: list[Request]) -> None:
        """The prompts of `requests` (each `_short`) prefilled as one left-padded batch, one step; each row then
        joins the running batch as a prompt prefilled alone would (its first token picked with its own settings)."""
        pad = self.config.pad_token_id if self.config.pad_token_id is not None else 0
        ids, mask = left_pad([r.prompt for r in requests], pad)
        logits, past = self._step(ids, mask, self.backend.init_past(len(requests)))
        last = logits[:, -1]
        finite = _finite_rows(last)
        keep = []
        for i, request in enumerate(requests):
            if self.metrics:
                self.metrics.prefix(self.cache is not None, 0)
            if not finite[i]:
                request.emit(Event("error", message="prefill: the model produced non-finite logits (NaN or Inf); "
                                                    "check the weights"))
                continue
            token = _pick(request, last[i:i + 1])
            done = self._accept(request, token)
            if done is None:
                keep.append((i, _Row(request, token)))
            else:
                request.emit(done)
        if keep:
            self._join(take_rows(self.config, on_host(self.backend, past), mask, [i for i, _ in keep]),
                       [r for _, r in keep])

    def _join(self, state: tuple, rows: list[_Row]) -> None:
        """Prefilled rows (`state`: their (past, mask) on the host) join the running batch (state.join_rows: left
        padding)."""
        if self._rows:
            self._past, self._mask = join_rows(self.config, [(on_host(self.backend, self._past), self._mask), state])
        else:
            self._past, self._mask = state
        self._rows += rows

    def _begin(self, request: Request) -> None:
        prefill = RowPrefill(self.backend, request.prompt, self.prefill_chunk, self.cache)
        request.cached_tokens = prefill.resumed
        if self.metrics:
            self.metrics.prefix(self.cache is not None, prefill.resumed)
        self._admitting = (request, prefill)

    def _prefill_chunk(self) -> None:
        request, prefill = self._admitting
        prefill.advance()
        if not prefill.done:
            return
        self._admitting = None
        last = prefill.logits
        if not bool(torch.isfinite(last).all()):
            raise GenerationError("prefill: the model produced non-finite logits (NaN or Inf); check the weights")
        token = _pick(request, last)
        done = self._accept(request, token)
        if done is None:
            self._join((on_host(self.backend, prefill.past), prefill.mask), [_Row(request, token)])
        else:
            request.emit(done)

    def _decode(self) -> None:
        ids = torch.tensor([[r.token] for r in self._rows], dtype=torch.long)
        mask = torch.cat([self._mask, torch.ones(len(self._rows), 1, dtype=torch.long)], dim=1)
        logits, self._past = self._step(ids, mask, self._past)
        self._mask = mask
        self.steps += 1
        last = logits[:, -1]
        finite = _finite_rows(last)
        finished, ends = [], []
        for i, row in enumerate(self._rows):
            request = row.request
            if not finite[i]:
                ends.append((request, Event("error", message=f"decode step {len(request.tokens)}: the model "
                                                             "produced non-finite logits (NaN or Inf); check the "
                                                             "weights")))
                finished.append(i)
                continue
            token = _pick(request, last[i:i + 1])
            row.token = token
            done = self._accept(request, token)
            if done is not None:
                finished.append(i)
                ends.append((request, done))
        if finished:
            self._keep([i for i in range(len(self._rows)) if i not in finished])
        for request, end in ends:  # after their rows left the batch: a client that got its answer and asks /health
            request.emit(end)      # finds it no longer running

    def _drop_cancelled(self) -> None:
        with self._cond:
            gone = [r for r in self._waiting if r.cancelled]
            for r in gone:
                self._waiting.remove(r)
        if self._admitting is not None and self._admitting[0].cancelled:
            gone.append(self._admitting[0])
            self._admitting = None
        keep = [i for i, r in enumerate(self._rows) if not r.request.cancelled]
        gone += [r.request for r in self._rows if r.request.cancelled]
        if len(keep) < len(self._rows):
            self._keep(keep)
        if self.metrics:
            for _ in gone:
                self.metrics.finished("cancelled")

    def _keep(self, rows: list[int]) -> None:
        if not rows:
            self._rows, self._past, self._mask = [], None, None
            return
        self._past, self._mask = take_rows(self.config, on_host(self.backend, self._past), self._mask, rows)
        self._rows = [self._rows[i] for i in rows]

    def _accept(self, request: Request, token: int) -> Event | None:
        """Record a new token of `request` and send what it adds; its done event when it is finished (the caller
        sends it once the request's row has left the batch)."""
        now = time.monotonic()
        if self.metrics:
            self.metrics.token(request, now)
        if request.first_token_at is None:
            request.first_token_at = now
        request.last_token_at = now
        request.tokens.append(token)
        finish = None
        if token in self.eos_ids and not request.sampling.ignore_eos:
            finish = "stop"
        elif len(request.tokens) >= request.sampling.max_tokens:
            finish = "length"
        text, stopped = self._text(request, final=finish is not None)
        if stopped:
            finish = "stop"
        request.emit(Event("token", [token], text))
        if finish is None:
            return None
        if self.metrics:
            self.metrics.finished(finish)
        return Event("done", finish_reason=finish)

    def _text(self, request: Request, final: bool) -> tuple[str, bool]:
        """The text `request`'s tokens add since the last call, and whether a stop string ended it. Held back: a
        character the tokens so far end inside (an incomplete UTF-8 sequence decodes to U+FFFD), and a tail that
        may be the start of a stop string."""
        if self.tokenizer is None:
            return "", False
        text = self.tokenizer.decode(request.tokens)
        stops = request.sampling.stop
        for s in stops:
            at = text.find(s, max(0, len(request._text) - len(s)))
            if s and at >= 0:
                return self._send(request, text[:at]), True
        if not final:
            end = len(text)
            if text.endswith("\ufffd"):
                end -= 1
            end -= max((k for s in stops for k in range(1, min(len(s), end + 1)) if text[:end].endswith(s[:k])),
                       default=0)
            text = text[:max(end, len(request._text))]
        return self._send(request, text), False

    @staticmethod
    def _send(request: Request, text: str) -> str:
        delta = text[len(request._text):] if text.startswith(request._text) else ""
        request._text = text if text.startswith(request._text) else request._text
        return delta
