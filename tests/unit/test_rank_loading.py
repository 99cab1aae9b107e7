"""The ranks' start-up bound (runtime/worker.loaded, `run --start-timeout`): a rank that has loaded waits for the
others up to the start timeout, not the collectives' timeout, and a node's failure line (worker.report_failure,
which a node's launcher writes) ends that wait at once with it. On a real TCPStore, the ranks as threads; every
`run` in tests/export/test_sharded.py goes through the same wait."""

from __future__ import annotations

import datetime
import threading
import time

import pytest
import torch.distributed as dist

from k3compile.runtime.worker import Options, RuntimeFault, loaded, node_failure, report_failure


@pytest.fixture
def store():
    return dist.TCPStore("127.0.0.1", 0, 1, True, timeout=datetime.timedelta(seconds=5), wait_for_workers=False)


def later(seconds: float, fn) -> threading.Thread:
    t = threading.Thread(target=lambda: (time.sleep(seconds), fn()), daemon=True)
    t.start()
    return t


def test_a_rank_waits_past_the_collective_timeout_for_one_still_loading(store):
    """Rank 1 loads 2 s after rank 0 with a 1 s collective timeout: rank 0 waits for it, then both go on."""
    options = Options([], 0, timeout=1.0, start_timeout=30.0)
    helper = later(2.0, lambda: store.set("k3compile/loaded/1", "1"))
    t0 = time.monotonic()
    loaded(store, 0, 2, options)
    assert 1.8 < time.monotonic() - t0 < 10
    helper.join()
    loaded(store, 1, 2, options)  # everyone is there: no wait


def test_a_failed_node_ends_the_wait_with_its_line(store):
    options = Options([], 0, start_timeout=30.0, nnodes=3)
    assert node_failure(store, 3) is None
    later(0.5, lambda: report_failure(store, 2, "rank 5 failed: killed by SIGKILL (the other ranks were stopped)"))
    t0 = time.monotonic()
    with pytest.raises(RuntimeFault, match=r"rank 0: the ranks stopped while loading \(node 2: rank 5 failed: "
                                           r"killed by SIGKILL"):
        loaded(store, 0, 6, options)
    assert time.monotonic() - t0 < 5
    assert node_failure(store, 3).startswith("node 2: rank 5 failed")


def test_a_rank_that_never_loads_ends_the_wait_at_the_start_timeout(store):
    options = Options([], 0, start_timeout=1.0)
    t0 = time.monotonic()
    with pytest.raises(RuntimeFault, match=r"rank 1: rank\(s\) \[0, 2\] did not load within --start-timeout 1 s"):
        loaded(store, 1, 3, options)
    assert 0.9 < time.monotonic() - t0 < 5
