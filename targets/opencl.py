"""OpenCL (docs/architecture.md, "GPU targets"): OpenCL C for any OpenCL 1.2 device; its kernels run here on PoCL
(k3compile/devices.py). No limit beyond the workgroup size: OpenCL C has 8- and 64-bit integers; the MXFP4 weights
are still read as uint32 words (a uint8 storage type gives broken vectorized OpenCL in TVM)."""

from __future__ import annotations

from k3compile.targets import Target
from k3compile.targets.gpu import Limits, schedule_func

LIMITS = Limits("OpenCL C", max_threads=256, bitcast="as_float")


def target() -> Target:
    return Target("opencl", "opencl", "words", schedule_func, 0, limits=LIMITS, source=("opencl", ".cl"))
