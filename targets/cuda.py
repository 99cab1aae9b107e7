"""CUDA (docs/architecture.md, "GPU targets"): the same GPU kernels as CUDA C, compiled by nvcc for `ARCH`; the
comparison point for the other GPU targets. Refused where no nvcc is on PATH; not executed here (no NVIDIA GPU)."""

from __future__ import annotations

import shutil

from k3compile.targets import Target
from k3compile.targets.gpu import Limits, schedule_func

from k3compile.interface import ExportError

ARCH = "sm_80"  # TVM's default, sm_50, is below what nvcc 13 compiles
LIMITS = Limits("CUDA C", max_threads=1024, bitcast="__uint_as_float")


def target() -> Target:
    if shutil.which("nvcc") is None:
        raise ExportError("target 'cuda' needs nvcc (the CUDA toolkit) to compile its kernels; none is on PATH")
    return Target("cuda", "cuda", "words", schedule_func, 0, (("arch", ARCH),), limits=LIMITS, source=("cuda", ".cu"))
