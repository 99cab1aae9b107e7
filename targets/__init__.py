"""Target families of k3compile (shipped as `k3compile.targets`; docs/architecture.md, "Targets"): one module per
family saying how to schedule and build for it, and one table, `TARGETS`, of the names `--target` takes.

A `Target` gives the passes what they ask a target: its TVM target (`tvm()`), the schedule of a standard-op
PrimFunc (`schedule_func`) and the layout its expert kernel reads the packed MXFP4 weights in (`expert_layout`).
`resolve(name)` turns a `--target` value into one, or raises ExportError naming the target and the known ones.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Callable

from k3compile.interface import ExportError


def host_cpu() -> tuple[tuple[str, object], ...]:
    """The llvm target fields for this machine: LLVM's name for its CPU (e.g. znver4) and, where the CPU model
    promises vector features the kernel does not offer (a virtual machine masking AVX-512), those features turned
    off; an artifact built with them would stop with "illegal instruction" here."""
    import tvm
    from tvm.target import codegen

    cpu = str(codegen.llvm_get_system_cpu())
    fields: list[tuple[str, object]] = [("mcpu", cpu)]
    try:
        flags = next(line.split(":", 1)[1].split() for line in open("/proc/cpuinfo") if line.startswith("flags"))
    except (OSError, StopIteration):
        return tuple(fields)  # no /proc/cpuinfo (not Linux): LLVM's CPU name is all there is
    promised = [str(f) for f in codegen.llvm_get_cpu_features(tvm.target.Target({"kind": "llvm", "mcpu": cpu}))]
    off = sorted(f for f in promised if f.startswith("avx512") and "avx512f" not in flags)
    if off:
        fields.append(("mattr", tuple(f"-{f}" for f in off)))
    return tuple(fields)


@dataclass(frozen=True)
class Target:
    name: str                       # the `--target` value
    kind: str                       # TVM's target kind
    expert_layout: str              # "kn": packed MXFP4 experts stored [E, K/2, N], output dim contiguous
    schedule_func: Callable         # PrimFunc -> scheduled PrimFunc
    dense_panel: int                # dense weights stored as [N/P, K, P] panels (0: as exported, [K, N])
    options: tuple = ()             # extra TVM target fields, (key, value) pairs

    def tvm(self):
        import tvm

        return tvm.target.Target({"kind": self.kind, **{k: list(v) if isinstance(v, tuple) else v
                                                        for k, v in self.options}})

    def finish_passes(self) -> list:
        """The Relax passes after scheduling, down to VM code (TVM's own for the target's family)."""
        from tvm.relax.backend.cpu_generic import pipeline

        return [*pipeline.dataflow_lower_passes(self.tvm()), *pipeline.finalize_passes(self.tvm())]

    def compiling(self):
        """A context manager to build in: the llvm family lowers exp, tanh and sigmoid with k3compile's own
        (k3compile/kernels/vector_math.py: TVM's are a libm call per lane, and its tanh loses precision near 0)."""
        import contextlib

        if self.kind == "llvm":
            from k3compile.kernels.vector_math import lowering

            return lowering()
        return contextlib.nullcontext()

    def describe(self) -> str:
        return str(self.tvm())


def _llvm() -> Target:
    from k3compile.targets.llvm import PANEL, schedule_func

    return Target("llvm", "llvm", "kn", schedule_func, PANEL, (*host_cpu(), ("num-cores", os.cpu_count() or 1)))


TARGETS: dict[str, Callable[[], Target]] = {"llvm": _llvm}
PLANNED = ("opencl", "webgpu", "metal", "rocm", "vulkan", "cuda")  # the accelerator targets of the next issue


def resolve(name: str | None = None) -> Target:
    """The target for a `--target` value (default: llvm, this CPU)."""
    name = "llvm" if name is None else name
    if name in TARGETS:
        return TARGETS[name]()
    if name in PLANNED:
        raise ExportError(f"target {name!r} is not supported yet (this version compiles for: {', '.join(TARGETS)})")
    raise ExportError(f"unknown target {name!r} (known: {', '.join(TARGETS)})")
