"""Session builds shared by the suite's pytest-xdist workers (the README's test command runs two)."""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from pathlib import Path

from filelock import FileLock


def built_once(tmp_path_factory, name: str, build: Callable[[Path], object]) -> Path:
    """The folder `build(folder)` writes, made once per test run: the README's command runs the suite in two
    pytest-xdist workers (whole files each), and a session artifact two files need is built by the first worker to
    ask while the other waits on a lock and then reads the same folder (pytest-xdist's recipe for session
    fixtures). A plain `pytest` builds it in its own session's temp folder. Tests only read these folders."""
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        folder = tmp_path_factory.mktemp(name) / name
        build(folder)
        return folder
    root = tmp_path_factory.getbasetemp().parent / "built-once"  # the run's temp folder, above each worker's
    root.mkdir(exist_ok=True)
    folder, done = root / name, root / f"{name}.done"
    with FileLock(str(root / f"{name}.lock")):
        if not done.exists():
            if folder.exists():  # a worker that failed half-way (the build's error is that worker's failure)
                shutil.rmtree(folder)
            build(folder)
            done.touch()
    return folder
