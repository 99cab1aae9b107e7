"""Vulkan (docs/architecture.md, "GPU targets"): SPIR-V, which only a TVM built with USE_VULKAN=ON generates; the
PyPI wheel has no `target.build.vulkan`, so the target is refused there with that reason. (Vulkan devices are still
reached here: the WebGPU target's WGSL runs on Vulkan through wgpu.)"""

from __future__ import annotations

from k3compile.targets import Target
from k3compile.targets.gpu import Limits, schedule_func

from k3compile.interface import ExportError

LIMITS = Limits("SPIR-V", max_threads=256)


def target() -> Target:
    import tvm

    if tvm.get_global_func("target.build.vulkan", allow_missing=True) is None:
        raise ExportError("target 'vulkan': this TVM build has no SPIR-V code generator (target.build.vulkan; "
                          "a TVM built with USE_VULKAN=ON has one; for Vulkan devices use --target webgpu)")
    return Target("vulkan", "vulkan", "words", schedule_func, 0, limits=LIMITS, source=("vulkan", ".spv"))
