"""Chunked prefill, the prefix-state cache and batch rows (generate.py, prefix_cache.py, state.py; docs/architecture.md,
"Serving"), on eager k3-tiny: each against a cold one-shot prefill of the same tokens.

Tolerance 1e-5 on logits (the issue's bar): a chunked or resumed prefill computes the same sums in another grouping
(the KDA chunk boundaries move, attention rows split), so only float rounding may differ; the greedy tokens must be
identical.
"""

from __future__ import annotations

import hashlib
import subprocess
import sys
import textwrap

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from k3compile import prefix_cache as pc
from k3compile.backends.eager import EagerBackend
from k3compile.generate import RowPrefill, generate, prefill_chunks, step_last_of
from k3compile.interface import past_length
from k3compile.presets import load_config
from k3compile.source import load_model
from k3compile.state import clone, join_rows, take_rows

TOL = 1e-5


@pytest.fixture(scope="module")
def backend():
    return EagerBackend(load_model("k3-tiny", seed=0))


def _prompt(n: int, seed: int = 1) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 256, (n,), generator=g).tolist()


def _cold(backend, prompt):
    ids = torch.tensor([prompt])
    logits, past = step_last_of(backend)(ids, torch.ones_like(ids), backend.init_past(1))
    return logits[:, -1].clone(), clone(past)


def _states_close(a, b, tol=TOL):
    for (x0, x1), (y0, y1) in zip(a, b):
        assert x0.shape == y0.shape and x1.shape == y1.shape
        assert (x0 - y0).abs().max() <= tol and (x1 - y1).abs().max() <= tol


@pytest.mark.parametrize("chunk", [16, 24, 96, 200])  # divides 96, does not, the whole prompt, longer
def test_chunked_prefill_equals_one_shot(backend, chunk):
    prompt = _prompt(96)
    ref_logits, ref_past = _cold(backend, prompt)
    row = RowPrefill(backend, prompt, chunk).run()
    assert (row.logits - ref_logits).abs().max() <= TOL
    _states_close(row.past, ref_past)
    # a left-padded batch through generate: the same tokens, chunked or not
    prompts = [prompt, prompt[:37], prompt[:70]]
    assert generate(backend, prompts, 6, prefill_chunk=chunk).tokens == generate(backend, prompts, 6,
                                                                                   prefill_chunk=10_000).tokens


def test_prefill_chunks_counts_the_steps(backend):
    calls = []

    def step(ids, mask, past):
        calls.append((ids.shape[1], mask.shape[1]))
        return torch.zeros(ids.shape[0], 1, 4), past

    prefill_chunks(step, torch.zeros(2, 10, dtype=torch.long), torch.ones(2, 13, dtype=torch.long), None, 4)
    assert calls == [(4, 7), (4, 11), (2, 13)]  # the mask covers the 3 past positions and the chunks so far


@pytest.mark.parametrize("length", [31, 32, 33, 64, 65, 80])  # before, on and after the boundaries of 16-blocks
def test_resumed_prefill_equals_cold(backend, length):
    cfg = backend.config
    cache = pc.PrefixCache(cfg, block=16, budget_bytes=1 << 30)
    base = _prompt(80)
    RowPrefill(backend, base[:72], None, cache).run()  # stores the blocks ending at 16, 32, 48, 64
    assert len(cache) == 4
    prompt = base[:length]
    row = RowPrefill(backend, prompt, None, cache).run()
    assert row.resumed == min(64, (length - 1) // 16 * 16)  # the longest cached prefix leaving a token to run
    ref_logits, ref_past = _cold(backend, prompt)
    assert (row.logits - ref_logits).abs().max() <= TOL
    _states_close(row.past, ref_past)
    # a different token inside the cached span resumes only before it
    other = list(prompt)
    other[20] = (other[20] + 1) % 256 or 3
    assert RowPrefill(backend, other, None, cache).resumed == 16


def test_cached_batch_and_eviction(backend):
    cfg = backend.config
    prompts = [_prompt(70, 2), _prompt(70, 2)[:40] + _prompt(9, 3), _prompt(20, 4)]
    want = generate(backend, prompts, 8)
    cache = pc.PrefixCache(cfg, block=16, budget_bytes=1 << 30)
    # left-padded batch with rows resumed from the cache (the second shares the first's first 32 tokens)
    first = generate(backend, prompts, 8, cache=cache, keep_logits=True)
    again = generate(backend, prompts, 8, cache=cache, keep_logits=True)
    assert first.tokens == want.tokens == again.tokens
    assert cache.stats.hits >= 3
    assert max(float((a - b).abs().max()) for a, b in zip(first.logits, again.logits)) <= TOL
    # a budget of about two entries: the least recently used leaves go, and what remains is still exact
    small = pc.PrefixCache(cfg, block=16, budget_bytes=2 * cache.bytes // len(cache))
    third = generate(backend, prompts, 8, cache=small)
    assert small.stats.evicted > 0 and small.bytes <= small.budget
    assert third.tokens == want.tokens
    resumed = []
    for p in prompts:
        row = RowPrefill(backend, p, None, small).run()
        resumed.append(row.resumed)
        assert (row.logits - _cold(backend, p)[0]).abs().max() <= TOL
    assert any(resumed)


def test_rows_join_and_leave(backend):
    """Rows prefilled alone and joined (left padding) decode as generate's batch does; a row taken out is unchanged."""
    cfg = backend.config
    prompts = [_prompt(12, 5), _prompt(30, 6), _prompt(5, 7)]
    want = generate(backend, prompts, 5)
    rows = [RowPrefill(backend, p).run() for p in prompts]
    past, mask = join_rows(cfg, [(r.past, r.mask) for r in rows])
    assert past_length(cfg, past) == 30 and mask.sum(1).tolist() == [12, 30, 5]
    tokens = [[int(r.logits.argmax())] for r in rows]
    step = step_last_of(backend)
    for _ in range(4):
        ids = torch.tensor([[t[-1]] for t in tokens])
        mask = torch.cat([mask, torch.ones(3, 1, dtype=torch.long)], 1)
        logits, past = step(ids, mask, past)
        for t, nxt in zip(tokens, logits[:, -1].argmax(-1).tolist()):
            t.append(nxt)
    assert tokens == want.tokens
    # the longest row leaves: the columns only it used are cut, and the others go on as before
    kept, kmask = take_rows(cfg, past, mask, [0, 2])
    assert past_length(cfg, kept) == 12 + 4 and kmask.shape == (2, 16)
    ids = torch.tensor([[tokens[0][-1]], [tokens[2][-1]]])
    logits, _ = step(ids, torch.cat([kmask, torch.ones(2, 1, dtype=torch.long)], 1), kept)
    full, _ = step(torch.tensor([[t[-1]] for t in tokens]), torch.cat([mask, torch.ones(3, 1, dtype=torch.long)], 1),
                   past)
    assert (logits[:, -1] - full[[0, 2], -1]).abs().max() <= TOL


# ---- the cache never returns a state for another prefix (Hypothesis) ------------------------------------------------

CFG = load_config("k3-tiny")


def _tagged_state(tokens: list[int]):
    """A stand-in decode state that records the tokens it follows: MLA rows hold the token ids, KDA states a digest
    of the whole prefix."""
    digest = torch.tensor(list(hashlib.sha256(str(tokens).encode()).digest()[:8]), dtype=torch.float32)
    past = []
    for i in range(CFG.num_hidden_layers):
        if CFG.is_mla(i):
            rows = torch.tensor(tokens, dtype=torch.float32).view(1, -1, 1)
            past.append((rows.expand(1, len(tokens), 3).clone(), rows.clone()))
        else:
            past.append((digest.view(1, 1, 8).clone(), digest.view(1, 8, 1).clone()))
    return past


def _check(cache, prompt):
    n, past = cache.lookup(prompt)
    if past is None:
        assert n == 0
        return 0
    assert 0 < n < len(prompt) and n % cache.block == 0
    expect = _tagged_state(prompt[:n])
    for (a, b), (c, d) in zip(past, expect):
        assert torch.equal(a, c) and torch.equal(b, d)
    return n


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.lists(st.integers(0, 2), min_size=1, max_size=14), min_size=1, max_size=12),
       st.integers(1, 3), st.integers(0, 4000), st.booleans())
def test_cache_returns_only_the_prompts_prefix(prompts, block, budget, weak_hash):
    """Random token sequences over a 3-token alphabet (so prefixes are shared often), stored block by block under a
    random budget: every lookup gives the state of exactly the prompt's prefix or nothing. With the hash replaced by
    one that collides all the time, still (the lookup compares the tokens and the parent of every block)."""
    cache = pc.PrefixCache(CFG, block=block, budget_bytes=budget)
    original = pc.block_key
    if weak_hash:
        pc.block_key = lambda parent, tokens: bytes([sum(int(t) for t in tokens) % 2])
    try:
        for prompt in prompts:
            _check(cache, prompt)
            for end in range(block, len(prompt) + 1, block):
                cache.store(prompt[:end], _tagged_state(prompt[:end]))
            assert cache.bytes <= budget
            for other in prompts:
                _check(cache, other)
    finally:
        pc.block_key = original


def test_cache_refuses_what_it_cannot_hold():
    cache = pc.PrefixCache(CFG, block=4)
    with pytest.raises(pc.PrefixCacheError, match="whole number"):
        cache.store([1, 2, 3], _tagged_state([1, 2, 3]))
    with pytest.raises(pc.PrefixCacheError, match="holds 5 tokens"):
        cache.store([1, 2, 3, 4], _tagged_state([1, 2, 3, 4, 5]))
    assert not cache.store([1, 2, 3, 4, 5, 6, 7, 8], _tagged_state([1, 2, 3, 4, 5, 6, 7, 8]))  # no parent block
    with pytest.raises(pc.PrefixCacheError):
        pc.PrefixCache(CFG, block=0)


def test_long_prompt_in_bounded_memory(tmp_path):
    """A 32768-token prompt on k3-tiny in 512-token chunks, in a fresh process: its peak resident memory stays under
    1.5 GiB. One-shot, a single MLA layer's scores would be [1, 2, 32768, 32768] fp32 = 8 GiB, and the eager model
    holds several such tensors at once; chunked, they are [1, 2, 512, <= 32768] = 128 MiB (observed: 0.3 GiB after
    loading, 0.8 GiB peak). The peak is the process's own VmHWM (bench.peak_rss): ru_maxrss of a process started by
    the suite's 2 GiB pytest process reports the parent's peak (Linux keeps it across exec)."""
    script = textwrap.dedent("""
        import json, sys, torch
        from k3compile.backends.eager import EagerBackend
        from k3compile.bench import peak_rss
        from k3compile.generate import generate
        from k3compile.source import load_model
        backend = EagerBackend(load_model("k3-tiny", seed=0))
        prompt = torch.randint(3, 256, (32768,), generator=torch.Generator().manual_seed(0)).tolist()
        g = generate(backend, [prompt], 2, prefill_chunk=512)
        print(json.dumps({"tokens": g.tokens, "peak_bytes": peak_rss()}))
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stderr[-2000:]
    import json

    doc = json.loads(out.stdout.strip().splitlines()[-1])
    assert len(doc["tokens"][0]) == 2
    assert doc["peak_bytes"] < 1.5 * 2**30, doc
