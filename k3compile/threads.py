"""How many CPU threads the eager model and onnxruntime use (docs/architecture.md, "Threads").

torch and onnxruntime default to one thread per core and spin while they wait for work. For the tiny widths of the
test presets a matmul is too small to split, and under CPU contention (a test runner, another job) the spinning
threads fight the busy cores: in single generate runs (not a benchmark), k3-tiny's eager decode gave 74 tokens/s
on one thread and 13 on two with one of two cores busy (77 and 66 idle). So small models take one thread and the
rest take every core this process may run on; `--threads` overrides.
"""

from __future__ import annotations

import os

from k3compile.config import K3Config

SPLIT_HIDDEN = 512  # below this hidden width, one thread: the per-token matmuls are too small to share out


def available_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        return os.cpu_count() or 1


def default_threads(cfg: K3Config) -> int:
    return 1 if cfg.hidden_size < SPLIT_HIDDEN else available_cores()


def use_threads(n: int) -> int:
    """Set torch's intra-op thread count (onnxruntime takes it per session); returns n."""
    import torch

    torch.set_num_threads(n)
    return n
