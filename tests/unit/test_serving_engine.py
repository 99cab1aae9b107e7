"""The serving engine's continuous batching (serving/engine.py), driven turn by turn on eager k3-tiny: what each
request gets equals `generate` on that request alone, whatever joins or leaves beside it."""

from __future__ import annotations

import time

import pytest
import torch

from k3compile.backends.eager import EagerBackend
from k3compile.generate import generate
from k3compile.prefix_cache import PrefixCache
from k3compile.serving.engine import Engine, QueueFull, Request, RequestError, Sampling
from k3compile.source import load_model, tokenizer_for


@pytest.fixture(scope="module")
def backend():
    return EagerBackend(load_model("k3-tiny", seed=0))


def _prompt(n: int, seed: int) -> list[int]:
    return torch.randint(3, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


class _Sink:
    def __init__(self) -> None:
        self.events = []

    def __call__(self, event) -> None:
        self.events.append(event)

    @property
    def tokens(self):
        return [t for e in self.events if e.kind == "token" for t in e.token_ids]

    @property
    def text(self):
        return "".join(e.text for e in self.events if e.kind == "token")

    @property
    def finish(self):
        done = [e for e in self.events if e.kind in ("done", "error")]
        return done[-1].finish_reason or done[-1].message if done else None


def _request(prompt, max_tokens, **kw):
    sink = _Sink()
    return Request(prompt, Sampling(max_tokens, **kw), sink), sink


def _run(engine, until):
    for _ in range(2000):
        if until():
            return
        engine.turn()
    raise AssertionError("the engine did not finish")


def test_requests_join_and_leave_a_running_batch(backend):
    engine = Engine(backend, max_batch=3, max_queue=16, prefill_chunk=8, cache=PrefixCache(backend.config, 8))
    specs = [(_prompt(20, 1), 12, {}), (_prompt(5, 2), 3, {}), (_prompt(33, 3), 9, {}),
             (_prompt(9, 4), 10, {"temperature": 0.9, "top_p": 0.8, "seed": 7}), (_prompt(20, 1)[:17], 6, {})]
    reqs = []
    seen_rows = []
    for i, (prompt, n, kw) in enumerate(specs):
        r, sink = _request(prompt, n, **kw)
        engine.submit(r)
        reqs.append((r, sink))
        for _ in range(i + 2):  # arrivals between steps: some join mid-generation, some wait in the queue
            engine.turn()
            seen_rows.append(len(engine._rows))
    _run(engine, lambda: all(s.finish for _, s in reqs))
    assert max(seen_rows) <= 3 and engine.running == 0 and engine.queue_depth == 0
    for (prompt, n, kw), (r, sink) in zip(specs, reqs):
        want = generate(backend, [prompt], n, eos_token_id=backend.config.eos_token_id, **kw).tokens[0]
        assert sink.tokens == want == r.tokens
        assert sink.finish in ("length", "stop")
    assert reqs[4][0].cached_tokens == 16  # the last prompt shares two 8-token blocks with the first


def test_a_finished_request_has_left_the_batch_when_its_client_hears(backend):
    """A request's last event (done, from a decode step or from its prefill) is sent after its row left the batch:
    a client that got its answer and asks /health finds it no longer running. The done event used to go out before
    the row was dropped, and a CI run under load read running == 1 (tests/unit/test_serve_http.py)."""
    engine = Engine(backend, max_batch=3)
    in_batch = []  # at each request's last event: is its row still in the running batch?

    def heard(request, sink):
        def emit(event):
            sink(event)
            if event.kind in ("done", "error"):
                in_batch.append(any(r.request is request[0] for r in engine._rows))
        return emit

    sinks = []
    for prompt, n in ((_prompt(6, 8), 1), (_prompt(5, 9), 3), (_prompt(7, 10), 5)):
        sink, request = _Sink(), []
        request.append(Request(prompt, Sampling(n), heard(request, sink)))
        engine.submit(request[0])
        sinks.append(sink)
    _run(engine, lambda: all(s.finish for s in sinks))
    assert [s.finish for s in sinks] == ["length"] * 3  # one ends at its prefill, two in decode steps
    assert in_batch == [False] * 3 and engine.running == 0


def test_a_cancelled_request_frees_its_row(backend):
    engine = Engine(backend, max_batch=2)
    a, sa = _request(_prompt(6, 5), 50)
    b, sb = _request(_prompt(7, 6), 8)
    c, sc = _request(_prompt(8, 7), 4)
    for r in (a, b, c):
        engine.submit(r)
    _run(engine, lambda: len(engine._rows) == 2)
    a.cancel()
    got = len(sa.tokens)
    engine.turn()
    assert len(sa.tokens) == got and a.id not in [r.request.id for r in engine._rows]
    _run(engine, lambda: sb.finish and sc.finish)
    assert sb.tokens == generate(backend, [b.prompt], 8, eos_token_id=2).tokens[0]
    assert sc.tokens == generate(backend, [c.prompt], 4, eos_token_id=2).tokens[0]


def test_refused_before_any_work(backend):
    engine = Engine(backend, max_queue=1)
    ok, _ = _request([5, 6], 4)
    engine.submit(ok)
    with pytest.raises(QueueFull):
        engine.submit(_request([5, 6], 4)[0])
    for prompt, sampling, param in [
        ([5] * 10, Sampling(backend.config.max_position_embeddings), "max_tokens"),  # past the context
        ([5], Sampling(0), "max_tokens"), ([5], Sampling(3, temperature=-1.0), "temperature"),
        ([5], Sampling(3, top_p=0.0), "top_p"), ([999], Sampling(3), "prompt"), ([], Sampling(3), "prompt"),
        ([5], Sampling(3, seed=-1), "seed"), ([5], Sampling(3, seed=2**64), "seed"),
    ]:
        with pytest.raises(RequestError) as e:
            engine.check(prompt, sampling)
        assert e.value.param == param
    assert engine.queue_depth == 1


def test_stop_strings_and_text(backend):
    tok = tokenizer_for("k3-tiny", backend.config)
    prompt = tok.encode("The model answers")
    full = generate(backend, [prompt], 24, eos_token_id=2).tokens[0]
    text = tok.decode(full)
    assert len(text) > 6
    stop = text[3:5]
    engine = Engine(backend, tok)
    r, sink = _request(prompt, 24, stop=(stop,))
    engine.submit(r)
    _run(engine, lambda: sink.finish)
    assert sink.finish == "stop" and sink.text == text[:text.find(stop)]
    r, sink = _request(prompt, 24)
    engine.submit(r)
    _run(engine, lambda: sink.finish)
    assert sink.text == text and sink.tokens == full


def test_a_failing_step_fails_its_requests_only(backend, monkeypatch):
    engine = Engine(backend)
    good, sg = _request(_prompt(4, 8), 3)
    bad, sbad = _request(_prompt(4, 9), 3)

    def lost(*args):
        raise RuntimeError("device lost")

    monkeypatch.setattr(backend, "step", lost)
    engine.submit(bad)
    engine.turn()  # admits `bad`: its prefill is the first step, which fails
    monkeypatch.undo()
    engine.submit(good)
    _run(engine, lambda: sg.finish)
    assert "internal error: RuntimeError: device lost" in sbad.finish and sbad.tokens == []
    assert sg.tokens == generate(backend, [good.prompt], 3, eos_token_id=2).tokens[0]


def _step_shapes(backend, monkeypatch) -> list:
    """`backend.step` patched to record the shape of each call's ids, in the list returned."""
    shapes = []
    step = backend.step

    def recording(ids, mask, past):
        shapes.append(tuple(ids.shape))
        return step(ids, mask, past)

    monkeypatch.setattr(backend, "step", recording)
    return shapes


def test_short_prompts_waiting_together_are_prefilled_as_one_batch(backend, monkeypatch):
    """Prompts shorter than a cache block and a chunk that wait together are prefilled in one left-padded step, up to
    the batch's free rows and up to the first prompt that is not short (it goes alone, in chunks, from the cache);
    each request still gets what `generate` gives it alone, with its own sampling settings."""
    shapes = _step_shapes(backend, monkeypatch)
    engine = Engine(backend, max_batch=3, prefill_chunk=8, cache=PrefixCache(backend.config, 8))
    specs = [(_prompt(3, 11), 5, {}), (_prompt(6, 12), 4, {"temperature": 0.8, "seed": 3}), (_prompt(20, 13), 3, {}),
             (_prompt(5, 14), 6, {}), (_prompt(7, 15), 3, {})]
    reqs = [_request(p, n, **kw) for p, n, kw in specs]
    for r, _ in reqs:
        engine.submit(r)
    engine.turn()
    assert shapes[:2] == [(2, 6), (2, 1)]  # the first two together, then their decode step; the long one waits
    _run(engine, lambda: all(s.finish for _, s in reqs))
    assert (3, 8) not in shapes and (1, 8) in shapes  # the long prompt in chunks of 8, as one row
    assert (2, 7) in shapes  # the last two together, once rows were free
    monkeypatch.undo()
    for (prompt, n, kw), (r, sink) in zip(specs, reqs):
        assert sink.tokens == generate(backend, [prompt], n, eos_token_id=2, **kw).tokens[0] == r.tokens


def test_an_idle_engine_waits_for_requests_sent_together(backend, monkeypatch):
    """The engine's own thread, woken by the first of several short requests that arrive one after another (a
    client's concurrent streams reach the engine over milliseconds), waits while they keep coming (Engine._gather)
    and prefills them in one step; a request that comes once the batch runs joins it after its own prefill. Without
    the wait the first was prefilled alone. The gaps here (10 ms) are far inside the wait (0.5 s), so a slow machine
    does not split the group."""
    shapes = _step_shapes(backend, monkeypatch)
    reqs = [_request(_prompt(3 + i, 40 + i), 4) for i in range(6)]
    with Engine(backend, max_batch=8, batch_wait=0.5) as engine:
        for r, _ in reqs[:5]:
            engine.submit(r)
            time.sleep(0.01)
        deadline = time.monotonic() + 60
        while not reqs[0][1].tokens and time.monotonic() < deadline:
            time.sleep(0.01)
        engine.submit(reqs[5][0])
        while not all(s.finish for _, s in reqs) and time.monotonic() < deadline:
            time.sleep(0.01)
    monkeypatch.undo()
    assert shapes[0] == (5, 7)  # the five prompts (3 to 7 tokens) left-padded into one step
    assert (1, 8) in shapes  # the sixth, alone: the batch was running
    for r, sink in reqs:
        assert sink.finish == "length"
        assert sink.tokens == generate(backend, [r.prompt], 4, eos_token_id=2).tokens[0]


@pytest.mark.parametrize("poisoned", ["prefill", "decode"])
def test_non_finite_logits_fail_their_row_only(backend, monkeypatch, poisoned):
    """A row whose logits are not finite (NaN in one, +inf in another position) gets one error event naming the
    step, in the left-padded prefill of prompts waiting together or in a decode step of the batch; the other rows
    go on and get what `generate` gives them alone."""
    step = backend.step
    calls = []

    def poisoning(ids, mask, past):
        logits, present = step(ids, mask, past)
        calls.append(tuple(ids.shape))
        if (poisoned == "prefill") == (ids.shape[1] > 1) and len(calls) <= 2:
            logits = logits.clone()
            logits[1, -1, 5] = float("nan")
            logits[1, -1, 9] = float("inf")
        return logits, present

    monkeypatch.setattr(backend, "step", poisoning)
    engine = Engine(backend, max_batch=3, prefill_chunk=8)
    reqs = [_request(_prompt(4 + i, 30 + i), 4) for i in range(3)]
    for r, _ in reqs:
        engine.submit(r)
    _run(engine, lambda: all(s.finish for _, s in reqs))
    monkeypatch.undo()
    assert calls[0] == (3, 6)  # the three prompts prefilled together: row 1 is the second request
    bad = reqs[1][1]
    assert f"{'prefill' if poisoned == 'prefill' else 'decode step 1'}: the model produced non-finite logits" \
        in bad.finish
    assert len(bad.tokens) == (0 if poisoned == "prefill" else 1)  # its prefill's token, when decode failed
    for i in (0, 2):
        r, sink = reqs[i]
        assert sink.tokens == generate(backend, [r.prompt], 4, eos_token_id=2).tokens[0]
