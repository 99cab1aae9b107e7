"""ROCm (docs/architecture.md, "GPU targets"): AMD GPUs through TVM's AMDGPU LLVM code generator, whose code objects
are linked by ROCm's ld.lld: refused where no ROCm install is found (as on this machine)."""

from __future__ import annotations

from k3compile.targets import Target
from k3compile.targets.gpu import Limits, schedule_func

from k3compile.interface import ExportError

LIMITS = Limits("AMDGPU", max_threads=256)


def target() -> Target:
    from tvm.support.rocm import find_rocm_path

    try:
        find_rocm_path()
    except RuntimeError:
        raise ExportError("target 'rocm' needs a ROCm install (its ld.lld links the kernels); none was found "
                          "(set ROCM_PATH)") from None
    return Target("rocm", "rocm", "words", schedule_func, 0, limits=LIMITS, source=("hsaco", ".s"))
