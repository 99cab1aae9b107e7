"""Target families of k3compile (shipped as `k3compile.targets`; docs/architecture.md, "Targets" and "GPU targets"):
one module per family saying how to schedule and build for it, and one table, `TARGETS`, of the names `--target`
takes.

A `Target` gives the passes what they ask a target: its TVM target (`tvm()`), the schedule of a standard-op
PrimFunc (`schedule_func`), the layout its kernels read the packed MXFP4 weights in (`expert_layout`: column tiles
of bytes on the CPU, "words" on the GPUs) and, for a GPU, its limits (checked at compile time) and the device source
it writes.
`resolve(name)` turns a `--target` value into one, or raises ExportError with one line: an unknown name, or a
target this machine or this TVM build cannot compile for, and why.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass, replace
from typing import Callable

from k3compile.interface import ExportError

# The CPU features k3compile's kernels choose code by (targets/llvm.py: BF16_GEMM_FEATURE), as /proc/cpuinfo names
# them (what CPUID says) -> LLVM's name, with the flags LLVM's feature implies (avx512bf16: avx512bw, avx512f).
CPUINFO_FEATURES = {"avx512_bf16": ("avx512bf16", ("avx512f", "avx512bw"))}


def host_cpu() -> tuple[tuple[str, object], ...]:
    """The llvm target fields for this machine: LLVM's name for its CPU (e.g. znver4) and, where that name and the
    CPU's own flags (/proc/cpuinfo) disagree, the difference: features the model promises and the CPU lacks (a
    virtual machine masking AVX-512) turned off, since an artifact built with them would stop with "illegal
    instruction" here; and the features of CPUINFO_FEATURES the CPU has and the model lacks (a virtual machine
    reporting another model: an AVX512_BF16 Xeon seen as family 6 model 167, `rocketlake`) turned on, since without
    them `--matmul-precision bf16` is refused on a CPU that has it (docs/toolchain.md, "Apache TVM 0.27")."""
    import tvm
    from tvm.target import codegen

    cpu = str(codegen.llvm_get_system_cpu())
    fields: list[tuple[str, object]] = [("mcpu", cpu)]
    info = _cpuinfo()
    if info is None:
        return tuple(fields)  # no /proc/cpuinfo (not Linux): LLVM's CPU name is all there is
    flags = set(info["flags"].split())
    promised = {str(f) for f in codegen.llvm_get_cpu_features(tvm.target.Target({"kind": "llvm", "mcpu": cpu}))}
    off = {f for f in promised if f.startswith("avx512") and "avx512f" not in flags}
    off |= {llvm for flag, (llvm, _) in CPUINFO_FEATURES.items() if llvm in promised and flag not in flags}
    on = sorted(llvm for flag, (llvm, needs) in CPUINFO_FEATURES.items()
                if flag in flags and all(n in flags for n in needs) and llvm not in promised)
    if off or on:
        fields.append(("mattr", (*(f"-{f}" for f in sorted(off)), *(f"+{f}" for f in on))))
    return tuple(fields)


def host_record() -> dict | None:
    """This CPU as the torch-free decode checks it without TVM's compiler (k3compile/lean.py), recorded in an llvm
    artifact's manifest as `host`: the vendor, family and model /proc/cpuinfo gives (what LLVM names the CPU from,
    with its features), the sha256 of the sorted feature flags (what `host_cpu` turns AVX-512 off by) and the core
    count (the target's num-cores). Equal records give `host_cpu`'s fields equal; None without /proc/cpuinfo."""
    import hashlib

    info = _cpuinfo()
    if info is None:
        return None
    return {"cpu": " ".join(info.get(k, "?") for k in ("vendor_id", "cpu family", "model")),
            "flags_sha256": hashlib.sha256(" ".join(sorted(info["flags"].split())).encode()).hexdigest(),
            "cores": os.cpu_count() or 1}


def cpu_record() -> dict:
    """This CPU for a benchmark's record (the machine a session gets varies): its name and id as /proc/cpuinfo gives
    them and which of the matmul kernels' vector features it has (docs/toolchain.md, "CPU schedules"); {} without
    /proc/cpuinfo."""
    info = _cpuinfo()
    if info is None:
        return {}
    flags = set(info["flags"].split())
    return {"name": info.get("model name", "?"), "id": " ".join(info.get(k, "?") for k in ("vendor_id", "cpu family",
                                                                                            "model")),
            "features": [f for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16") if f in flags]}


@functools.cache
def _cpuinfo() -> dict[str, str] | None:
    """The vendor, family, model, model name and flags of the first processor /proc/cpuinfo lists (read once); None
    where there is no /proc/cpuinfo or it gives no flags."""
    fields: dict[str, str] = {}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, sep, value = line.partition(":")
                key = key.strip()
                if not sep:
                    if fields:
                        break  # the first processor's block is read
                    continue
                if key in ("vendor_id", "cpu family", "model", "model name", "flags") and key not in fields:
                    fields[key] = value.strip()
    except OSError:
        return None
    return fields if "flags" in fields else None


@dataclass(frozen=True)
class Target:
    name: str                       # the `--target` value
    kind: str                       # TVM's target kind
    expert_layout: str              # "tiles": packed MXFP4 stored [E, N/t, K/2, t] bytes; "words": [E, K/8, N] uint32
    schedule_func: Callable         # PrimFunc -> scheduled PrimFunc
    dense_panel: int                # dense weights stored as [N/P, K, P] panels (0: as exported, [K, N])
    options: tuple = ()             # extra TVM target fields, (key, value) pairs
    limits: object = None           # a GPU's targets.gpu.Limits (None: the CPU)
    source: tuple = ()              # a GPU's (TVM module kind of its device code, file suffix), e.g. ("opencl", ".cl")
    dense_format: str = "fp32"      # how the dense panels are stored (modes.DenseFormat; compile.dense_target sets it)
    matmul_precision: str = "fp32"  # "bf16": dense matmuls round their activations to bf16 (with_matmul_precision)

    @property
    def gpu(self) -> bool:
        return self.limits is not None

    def tvm(self):
        import tvm

        return tvm.target.Target({"kind": self.kind, **{k: list(v) if isinstance(v, tuple) else v
                                                        for k, v in self.options}})

    def finish_passes(self) -> list:
        """The Relax passes after scheduling, down to VM code (TVM's generic ones for the CPU or the GPUs: its
        CUDA-specific list names passes this wheel lacks)."""
        if self.gpu:
            from tvm.relax.backend.gpu_generic import pipeline
        else:
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

    def has_feature(self, name: str) -> bool:
        """Whether this CPU target's code may use the LLVM CPU feature `name` (e.g. "avx512bw"): its CPU has it and
        the target does not turn it off (host_cpu)."""
        if self.kind != "llvm":
            return False
        from tvm.target import codegen

        return name in {str(f) for f in codegen.llvm_get_cpu_features(self.tvm())}

    def with_dense(self, fmt: str) -> Target:
        """This target storing its dense panels as `fmt` (a modes.DenseFormat value)."""
        from k3compile.modes import DenseFormat

        return replace(self, dense_format=DenseFormat(fmt))

    def without_host_gemm(self) -> Target:
        """This CPU target with no call to the host GEMM in its kernels (`compile --no-host-gemm`: targets/llvm.py,
        schedule_func); a GPU target's kernels never call it, so asking there is refused."""
        if self.gpu:
            raise ExportError(f"--no-host-gemm applies to the CPU (llvm); target {self.name!r} never calls the host "
                              "GEMM")
        return replace(self, schedule_func=functools.partial(self.schedule_func, host_gemm=False))

    def with_matmul_precision(self, precision: str) -> Target:
        """This CPU target with its dense matmuls at `precision` (`compile --matmul-precision`): "fp32" (exact),
        or "bf16": at every row count (prefill and decode) a matmul over bf16 panels rounds its activations to bf16
        and runs targets/bf16_gemm.c (vdpbf16ps), twice fp32's multiply rate. Refused on a GPU target and on a CPU
        without AVX512_BF16."""
        from k3compile.targets.llvm import BF16_GEMM_FEATURE

        if precision not in MATMUL_PRECISIONS:
            raise ExportError(f"unknown matmul precision {precision!r} (known: {', '.join(MATMUL_PRECISIONS)})")
        if precision == "fp32":
            return self
        if self.gpu:
            raise ExportError(f"--matmul-precision {precision} applies to the CPU (llvm), not target {self.name!r}")
        if not self.has_feature(BF16_GEMM_FEATURE):
            raise ExportError(f"--matmul-precision {precision} needs a CPU with AVX512_BF16 (vdpbf16ps); this "
                              "target's has none")
        return replace(self, matmul_precision=precision,
                       schedule_func=functools.partial(self.schedule_func, bf16_gemm=True))

    def with_f32_gemm(self) -> Target:
        """This CPU target with its exact (fp32) matmuls over bf16 panels calling targets/bf16_gemm.c's fp32 GEMM,
        which sums in the order and with the FMAs of TVM's loops (the same bits) at up to 4x their speed, where the
        CPU has AVX-512 (F and BW); itself elsewhere, on a GPU and under --matmul-precision bf16. Only a library
        written to disk can link the kernel in (compile.build_proto)."""
        from k3compile.targets.llvm import F32_GEMM_FEATURES

        if self.gpu or self.matmul_precision != "fp32" or not all(map(self.has_feature, F32_GEMM_FEATURES)):
            return self
        return replace(self, schedule_func=functools.partial(self.schedule_func, f32_gemm=True))

    def describe(self) -> str:
        return str(self.tvm())


MATMUL_PRECISIONS = ("fp32", "bf16")  # `compile --matmul-precision`


def _llvm() -> Target:
    from k3compile.targets.llvm import PANEL, schedule_func

    return Target("llvm", "llvm", "tiles", schedule_func, PANEL, (*host_cpu(), ("num-cores", os.cpu_count() or 1)))


def _family(name: str) -> Callable[[], Target]:
    def make() -> Target:
        import importlib

        return importlib.import_module(f"k3compile.targets.{name}").target()

    return make


# The capability table: every `--target` name. Each GPU family module says what it needs to build and its limits.
TARGETS: dict[str, Callable[[], Target]] = {
    "llvm": _llvm, **{n: _family(n) for n in ("opencl", "webgpu", "metal", "cuda", "rocm", "vulkan")}}


def resolve(name: str | Target | None = None) -> Target:
    """The target for a `--target` value (default: llvm, this CPU); ExportError (one line) for an unknown name or
    a target that cannot be built here. Resolved once, at the door (the CLI, a library entry point): below it,
    functions take the Target; a Target given here is returned as it is."""
    if isinstance(name, Target):
        return name
    name = "llvm" if name is None else name
    if name in TARGETS:
        return TARGETS[name]()
    raise ExportError(f"unknown target {name!r} (known: {', '.join(TARGETS)})")
