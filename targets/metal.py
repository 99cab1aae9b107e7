"""Metal (docs/architecture.md, "GPU targets"): Metal Shading Language for Apple GPUs. Built here (the host part
for this machine, the .metal source for a Mac to compile); not executed here: no Metal device. A kernel takes at most
31 buffers (the argument table)."""

from __future__ import annotations

from k3compile.targets import Target
from k3compile.targets.gpu import Limits, schedule_func

LIMITS = Limits("Metal", max_threads=256, max_buffers=31, bitcast="as_type<float>", pow_of_negative=False)


def target() -> Target:
    return Target("metal", "metal", "words", schedule_func, 0, limits=LIMITS, source=("metal", ".metal"))
