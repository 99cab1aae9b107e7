"""k3compile/threads.py: setting the thread count never pins this process to one core (docs/architecture.md,
"Threads")."""

from __future__ import annotations

import os
import subprocess
import sys
import threading

import pytest


@pytest.mark.skipif(not hasattr(os, "sched_getaffinity"), reason="core affinity is a Linux notion")
def test_setting_threads_once_tvm_is_loaded_keeps_every_core():
    """TVM's config_threadpool in mode -1 ("little cores") pinned the calling thread to core 0, and every process it
    then started (builds, `run`'s ranks) inherited that one core. Run in a fresh process: pytest's own main thread
    is restored between tests (tests/conftest.py)."""
    code = ("import os, tvm\n"
            "from k3compile.threads import use_threads\n"
            "before = os.sched_getaffinity(0)\n"
            "for n in (1, 2, 1):\n"
            "    use_threads(n)\n"
            "    assert os.sched_getaffinity(0) == before, (n, before, os.sched_getaffinity(0))\n"
            "print('ok', len(before))\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and r.stdout.startswith("ok"), r.stderr[-2000:]


class _Counting:
    """A backend that computes with something other than torch: the eager model's step, recording torch's thread
    count at each call (the count its glue runs with)."""

    def __init__(self, inner) -> None:
        self.inner, self.config, self.seen = inner, inner.config, []

    def init_past(self, batch):
        return self.inner.init_past(batch)

    def step(self, input_ids, attention_mask, past):
        import torch

        self.seen.append(torch.get_num_threads())
        return self.inner.step(input_ids, attention_mask, past)


def test_torch_glues_on_one_thread_while_another_runtime_decodes():
    """torch's OpenMP threads spin after its argmax over a batch's logits and took the cores from TVM's pool
    (k3-small batch-8 decode 110 -> 277 tokens/s once held at one thread): generate and the serving engine hold
    torch at one thread around any backend but the eager one, and give the count back."""
    import torch

    from k3compile.backends.eager import EagerBackend
    from k3compile.generate import generate
    from k3compile.serving.engine import Engine, Request, Sampling
    from k3compile.source import load_model

    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        eager = EagerBackend(load_model("k3-tiny", seed=0))
        other = _Counting(eager)
        want = generate(eager, [[1, 2, 3]], 3, eos_token_id=eager.config.eos_token_id).tokens
        assert generate(other, [[1, 2, 3]], 3).tokens == want
        assert other.seen and set(other.seen) == {1}
        assert torch.get_num_threads() == 2  # given back

        class Eagerly(_Counting):
            computes_with_torch = True

        mine = Eagerly(eager)
        generate(mine, [[1, 2, 3]], 3)
        assert set(mine.seen) == {2}

        served, events, done = _Counting(eager), [], threading.Event()

        def sink(event):
            events.append(event)
            if event.kind in ("done", "error"):
                done.set()

        with Engine(served) as engine:  # its own thread, as `serve` runs it
            engine.submit(Request([1, 2, 3], Sampling(3), sink))
            assert done.wait(120)
        assert [t for e in events if e.kind == "token" for t in e.token_ids] == want[0]
        assert served.seen and set(served.seen) == {1}
    finally:
        torch.set_num_threads(before)
