"""How many CPU threads every backend uses: one setting for torch, onnxruntime and TVM (docs/architecture.md,
"Threads").

torch and onnxruntime default to one thread per core and spin while they wait for work; TVM's pool defaults to its
own count (one thread on this 2-core machine). For the tiny widths of the test presets a matmul is too small to split,
and under CPU contention (a test runner, another job) the spinning threads fight the busy cores: in single generate
runs (not a benchmark), k3-tiny's eager decode gave 74 tokens/s on one thread and 13 on two with one of two cores
busy (77 and 66 idle). So small models take one thread and the rest take every core this process may run on;
`--threads` overrides, capped at those cores (more threads than cores only contend).

While a compiled model runs (TVM, onnxruntime, a device or the ranks of a sharded OUT), torch does only the glue
between steps (sampling, masks), yet at a batch of 8 its argmax over [8, vocab] logits is big enough to run on
every thread, and torch's OpenMP threads then spin after it while TVM's pool wants the same cores: k3-small's
batch-8 decode through `generate --threads 2` ran at 110 tokens/s (bimodal, 95-210 over runs) and at 285 with
torch's threads waiting passively (OMP_WAIT_POLICY=PASSIVE, measured to find the cause). `glue_threads(backend)`
holds torch at one thread while such a backend decodes; the eager backend (`computes_with_torch`) keeps them all.

`use_threads(n)` sets the three at once: torch's intra-op count, TVM's pool (TVM_NUM_THREADS, read when the pool
starts, and `runtime.config_threadpool` once TVM is loaded); onnxruntime takes the same count per session
(backends/onnx.py, through `capped`). TVM's pool cannot grow past the size it started with, so commands set the
count before they load or compile anything.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys

from k3compile.config import K3Config

log = logging.getLogger(__name__)

SPLIT_HIDDEN = 512  # below this hidden width, one thread: the per-token matmuls are too small to share out


def available_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        return os.cpu_count() or 1


def _allowed_cores() -> list[str]:
    try:
        return [str(c) for c in sorted(os.sched_getaffinity(0))]  # config_threadpool takes them as strings
    except AttributeError:  # pragma: no cover - not Linux
        return [str(c) for c in range(os.cpu_count() or 1)]


def default_threads(cfg: K3Config) -> int:
    return 1 if cfg.hidden_size < SPLIT_HIDDEN else available_cores()


def capped(n: int) -> int:
    """n, at most the cores this process may run on (and at least 1)."""
    cores = available_cores()
    if n > cores:
        log.info("%d threads asked, %d cores available: using %d", n, cores, cores)
    return max(1, min(int(n), cores))


def use_threads(n: int, with_torch: bool = True) -> int:
    """Set torch's, TVM's and onnxruntime's thread count to n (capped at the cores); returns the count set.
    `with_torch=False`: torch's only where torch is imported already (lean.py's process runs without it)."""
    n = capped(n)
    if with_torch or sys.modules.get("torch") is not None:
        import torch

        torch.set_num_threads(n)
    os.environ["TVM_NUM_THREADS"] = str(n)  # read when TVM's pool first starts
    if "tvm" in sys.modules:
        import tvm

        # Mode -3 (every thread shares the given cores), given every core this process may run on: modes 1 / -1
        # ("big" / "little" cores) pin the calling thread to one core, and every process it then starts (a build,
        # `run`'s ranks) inherited that core: in the test suite two ranks shared one core of two.
        tvm.get_global_func("runtime.config_threadpool")(-3, n, _allowed_cores())
    return n



@contextlib.contextmanager
def glue_threads(backend):
    """torch at one thread inside the block when `backend` computes the model with something else (the module
    docstring: torch's spinning threads took the cores from TVM's pool); unchanged for the eager backend."""
    import torch

    if getattr(backend, "computes_with_torch", False):
        yield
        return
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)
