"""Which backend runs a SOURCE (docs/architecture.md, "Backends"): the one place `generate` and `k3compile.testing`
pick one. Apart from backends/__init__.py so that importing a backend never imports the build cache (cache.py ->
pipeline.py -> backends.*).
"""

from __future__ import annotations

from collections.abc import Callable

KINDS = ("auto", "eager", "onnx", "onnx-reference", "tvm")


def open_backend(source: str, backend: str = "auto", seed: int = 0, experts: str = "auto",
                 threads: int | None = None, device: int | None = None, host: bool = False,
                 progress: Callable[[str], None] | None = None, timeout: float | None = None, wire: str = "fp32",
                 rendezvous=None, start_timeout: float | None = None):
    """The engine that runs SOURCE as `backend` asks. "auto": an artifact on its own target (llvm in TVM's VM, a GPU
    target on its device's executor; a sharded OUT on its ranks, which the caller ends with `close()`), an export in
    onnxruntime, anything else eager. "onnx" / "tvm" with a preset,
    config or checkpoint build it into the cache first (cache.py). `device` picks a GPU executor's device; `host`
    brings all of a GPU artifact's outputs back each step (the state too: what `verify.compare` reads). `timeout`: a
    sharded OUT's collectives' (as `run --timeout`; None: its default); `wire`: a sharded OUT's all-to-all vectors on
    the wire (as `run --wire-dtype`; anything but fp32 is refused for every other SOURCE); `rendezvous`: node 0's
    runtime.rendezvous.Rendezvous when a sharded OUT's ranks spread over several machines (refused for any other
    SOURCE when it names more than one node); `start_timeout`: a sharded OUT's ranks' loading bound (None: its
    default)."""
    from k3compile.interface import ExportError
    from k3compile.manifest import is_sharded
    from k3compile.source import ARTIFACT, EXPORT, kind_of

    if is_sharded(source):  # export --mesh's OUT: its ranks, started by this process (backends/sharded.py)
        from k3compile.backends.sharded import ShardedBackend

        if backend != "auto":
            raise ExportError(f"{source}: a sharded artifact runs on its ranks; --backend {backend} does not apply")
        return ShardedBackend(source, threads, devices=() if device is None else (device,), progress=progress,
                              wire=wire, rendezvous=rendezvous, **({} if timeout is None else {"timeout": timeout}),
                              **({} if start_timeout is None else {"start_timeout": start_timeout}))
    if rendezvous is not None and rendezvous.nnodes > 1:
        raise ExportError(f"--nnodes spreads a sharded OUT's ranks over machines; {source} is not one")
    if wire != "fp32":
        raise ExportError(f"--wire-dtype {wire} applies to a sharded OUT's all-to-all dispatch; {source} is not one")
    kind = kind_of(source)
    if backend == "auto":
        backend = "artifact" if kind == ARTIFACT else "onnx" if kind == EXPORT else "eager"
    if device is not None and not (kind == ARTIFACT and backend in ("artifact", "tvm")):
        raise ExportError("--device picks the device of a GPU artifact's executor; SOURCE is not a GPU artifact")
    folder = source
    if backend in ("onnx", "onnx-reference", "tvm") and kind not in (EXPORT, ARTIFACT):
        from k3compile.cache import cached_artifact, cached_export

        folder = (cached_artifact(source, seed=seed, weights=experts, progress=progress) if backend == "tvm" else
                  cached_export(source, seed=seed, weights=experts, progress=progress))
    if backend == "eager":
        from k3compile.backends.eager import EagerBackend
        from k3compile.source import load_model

        return EagerBackend(load_model(source, seed=seed, experts=experts))
    if backend in ("onnx", "onnx-reference"):
        from k3compile.backends.onnx import OnnxBackend

        return OnnxBackend(folder, reference=backend == "onnx-reference", threads=threads)
    if kind == ARTIFACT:
        from k3compile.manifest import is_gpu_artifact

        if is_gpu_artifact(folder):
            from k3compile.backends.executor import ExecutorBackend

            return ExecutorBackend(folder, device, host=host)
    from k3compile.backends.tvm import TvmBackend

    return TvmBackend(folder)
