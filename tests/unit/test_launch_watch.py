"""The launcher's watch over its workers (runtime/launch.py), without a model: a worker's exit is seen without
Popen's lock, and stop_all ends a worker that ignores SIGTERM."""

from __future__ import annotations

import signal
import subprocess
import sys
import threading

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
