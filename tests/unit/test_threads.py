"""k3compile/threads.py: setting the thread count never pins this process to one core (docs/architecture.md,
"Threads")."""

from __future__ import annotations

import os
import subprocess
import sys

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
