"""The launcher's watch over its workers (runtime/launch.py), without a model: a worker's exit is seen without
Popen's lock, and stop_all ends a worker that ignores SIGTERM."""

from __future__ import annotations

import signal
import subprocess
import sys
import threading

import pytest

from k3compile.runtime import launch
from k3compile.runtime.worker import RuntimeFault


def test_watch_and_stop_all_take_no_popen_lock(tmp_path, monkeypatch):
    """A SIGTERM raised inside Popen.poll just after it takes its lock leaves that lock held (CPython 3.11); a run
    whose launcher watched with poll and stopped its workers with wait then hung after SIGTERM (a CI run of stop 40).
    The test holds both workers' locks as that leaves them: _watch must still see rank 0's exit and name it, and
    stop_all must end rank 1, which ignores SIGTERM, with SIGKILL; each within the 10 s given (both blocked for ever
    before)."""
    monkeypatch.setattr(launch, "SHUTDOWN_S", 0.5)  # the SIGTERM grace, shortened: rank 1 ignores it anyway
    exits = subprocess.Popen([sys.executable, "-c", "import sys; sys.exit(3)"])
    stubborn = subprocess.Popen([sys.executable, "-c", "import signal, time; signal.signal(signal.SIGTERM, "
                                 "signal.SIG_IGN); print('ready', flush=True); time.sleep(600)"],
                                stdout=subprocess.PIPE, text=True)
    procs = {0: exits, 1: stubborn}
    assert stubborn.stdout.readline() == "ready\n"
    seen: list[str] = []

    def watch() -> None:
        try:
            launch._watch(procs, tmp_path)
        except RuntimeFault as e:
            seen.append(str(e))

    for p in procs.values():
        p._waitpid_lock.acquire()  # as the SIGTERM inside poll leaves it
    try:
        for fn, what in ((watch, "_watch did not see rank 0 exit"), (lambda: launch.stop_all(procs),
                                                                      "stop_all did not end rank 1")):
            t = threading.Thread(target=fn, daemon=True)
            t.start()
            t.join(10)
            assert not t.is_alive(), what
        assert seen == ["rank 0 failed: exit code 3 (the other ranks were stopped)"]
        assert launch.exit_code(stubborn) == -signal.SIGKILL
    finally:
        for p in procs.values():
            p._waitpid_lock.release()
    launch.stop_all(procs)  # reaps, the locks free
    stubborn.stdout.close()
    assert exits.returncode == 3 and stubborn.returncode == -signal.SIGKILL


class _Store:
    """A dict in place of the run's TCPStore: set / get (bytes; a missing key raises as the store's timeout does) /
    add / check, what launch and worker.report_failure call."""

    def __init__(self) -> None:
        self.keys: dict[str, bytes] = {}

    def set(self, key: str, value) -> None:
        self.keys[key] = value.encode() if isinstance(value, str) else value

    def get(self, key: str) -> bytes:
        if key not in self.keys:
            raise RuntimeError("wait timeout after 3000ms, keys: /k3compile/run/request")
        return self.keys[key]

    def add(self, key: str, n: int) -> int:
        value = int(self.keys.get(key, b"0")) + n
        self.keys[key] = str(value).encode()
        return value

    def check(self, keys) -> bool:
        return all(k in self.keys for k in keys)


def test_a_node_given_another_request_than_node_0_stops_the_run_naming_the_options():
    """Over several nodes each launcher is given the request: node 0 puts its own into the store, another node
    compares. The same request passes; a different one (prompts, micro-batches, wire) is one line naming those
    options, reported to the store for node 0 (worker.node_failure finds it); node 0's value as something that is not
    a request's JSON, or no value within the timeout, is one line too."""
    from k3compile.runtime.worker import Options, node_failure

    node0 = Options([[1, 2, 3], [4, 5]], 8, micro_batches=2)
    store = _Store()
    store.set(launch.REQUEST, launch.request_of(node0))
    launch.agree_with_node_0(store, Options([[1, 2, 3], [4, 5]], 8, micro_batches=2, threads=3, timeout=9.0), 1)
    assert node_failure(store, 2) is None  # threads and timeouts are each node's own

    other = Options([[1, 2, 3], [4, 6]], 8, micro_batches=1, wire="bf16")
    with pytest.raises(RuntimeFault) as e:
        launch.agree_with_node_0(store, other, 1)
    assert "node 1 was given another request than node 0 (--prompt-ids, --micro-batches, --wire-dtype differ)" in \
        str(e.value)
    assert node_failure(store, 2) == f"node 1: {e.value}"

    for value in ("not json", "[1, 2]", '{"prompts": "x"}'):
        store = _Store()
        store.set(launch.REQUEST, value)
        with pytest.raises(RuntimeFault, match="node 1 was given another request than node 0 .*--prompt-ids"):
            launch.agree_with_node_0(store, node0, 1)
    with pytest.raises(RuntimeFault, match="node 2: node 0 gave no request to decode .wait timeout"):
        launch.agree_with_node_0(_Store(), node0, 2)


def test_a_failure_another_node_reported_stops_this_nodes_watch(tmp_path, monkeypatch):
    """A launcher of several nodes asks the store whether another node failed while its own workers run (their ranks
    may be joining the world, which would wait for the missing ranks until --start-timeout): the other node's line
    ends the watch, and stop_all then ends the workers."""
    monkeypatch.setattr(launch, "OTHERS_S", 0.1)
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    asked = []

    def elsewhere():
        asked.append(1)
        return "node 1: node 1 was given another request than node 0" if len(asked) > 2 else None

    try:
        with pytest.raises(RuntimeFault, match="^node 1: node 1 was given another request"):
            launch._watch({0: sleeper}, tmp_path, elsewhere)
        assert len(asked) == 3 and sleeper.poll() is None
    finally:
        launch.stop_all({0: sleeper})
    assert sleeper.poll() is not None
