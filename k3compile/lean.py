"""Decoding a CPU artifact in a process that imports neither torch nor TVM's compiler (docs/architecture.md,
"The torch-free decode").

Why: a decode's peak memory should be its weights plus little. A Python process that imports torch holds ~220 MB
before any weight, and `import tvm` loads TVM's compiler library (~300 MB with torch: tvm_ffi imports torch whenever
it is installed). TVM's runtime library alone, without torch, is ~90 MB, and it runs a compiled artifact: the
library, its VM and the weights are all the runtime's.

`k3compile generate` takes this path (cli/generate.py asks `eligible`) for an llvm artifact whose manifest records
this machine as its `host` (targets.host_record: the check TvmBackend makes with LLVM's CPU name, made without the
compiler), with no prefix cache. Everything else (`--cache-block`, an older artifact, serve, verify, bench's
throughput rows) runs TvmBackend (backends/tvm.py); serve's and generate's processes on such an artifact load TVM's
runtime library alone beside torch (runtime_library_for). Both call the same functions of the same library on the same
weights, main_inplace_last and decode.so's for a batch-1 step, the same decode loop (decoding.decode_loop) and the
same sampler (decoding.Sampler), so they give the same tokens, sampled ones too; a test compares this path with eager
in a process where importing torch fails.

The state stays in TVM tensors for the whole run: the KDA states a step returns are the next step's inputs as they
are, and each MLA cache is one buffer sized to the longest prompt plus max_new_tokens, which main_inplace_last writes
in place (no growth, no copy: TvmBackend's buffers double because it cannot know the run's length).
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from k3compile.decoding import (
    Generation,
    Sampler,
    check_chunk,
    check_finite,
    check_request,
    decode_loop,
    default_prefill_chunk,
)
from k3compile.interface import ExportError, state_shapes
from k3compile.library import LAST_FUNC, RELEASE_AT, has_function, release_pool, vm_for

NAME = "tvm-llvm"  # the backend name generate reports: the same library TvmBackend runs


def eligible(source, backend: str = "auto", cache_block: int | None = None, device: int | None = None,
             wire: str = "fp32") -> bool:
    """Whether `generate` with these options runs SOURCE here: an artifact TVM's runtime runs alone
    (`runtime_suffices`) whose library has main_inplace_last (its manifest's entry_points: a model with MLA caches in
    the form passes/inplace_caches.py takes), no prefix cache, no device, no wire format."""
    if backend not in ("auto", "tvm") or cache_block is not None or device is not None or wire != "fp32":
        return False
    doc = _manifest_of(source)
    entry_points = doc.get("entry_points")
    return _runs_here(doc) and isinstance(entry_points, list) and LAST_FUNC in entry_points


def runtime_suffices(source) -> bool:
    """Whether TVM's runtime library alone runs SOURCE on this machine: an llvm artifact whose manifest records a
    `host` equal to this machine's targets.host_record (check_host: TvmBackend's host check, made without LLVM)."""
    return _runs_here(_manifest_of(source))


def _manifest_of(source) -> dict:
    """SOURCE's manifest, unchecked (manifest.loose_manifest); {} where SOURCE has none."""
    from k3compile.manifest import MANIFEST, loose_manifest

    return loose_manifest(source) if (Path(source) / MANIFEST).is_file() else {}


def _runs_here(manifest: dict) -> bool:
    """A single llvm artifact whose recorded host is this machine's (targets.host_record)."""
    from k3compile.manifest import KIND

    return manifest.get("kind") == KIND and _host_is_here(manifest)


def _host_is_here(manifest: dict) -> bool:
    from k3compile.targets import host_record

    here = host_record()
    return manifest.get("target") == "llvm" and here is not None and manifest.get("host") == here


def runtime_library_for(source, backend: str = "auto") -> None:
    """For a verb whose process only runs SOURCE and never compiles (serve; generate's torch runtime): load TVM's
    runtime library alone, beside torch, when TvmBackend will run an artifact runtime_suffices runs (~100 MB less
    resident than with the compiler library)."""
    if backend in ("auto", "tvm") and runtime_suffices(source):
        import_tvm(beside_torch=True)


def check_host(folder: Path, manifest: dict) -> None:
    """An llvm artifact's (or a sharded CPU OUT's) recorded `host` must be this machine's (targets.host_record; equal
    records give equal tvm_target fields); one line otherwise."""
    from k3compile.manifest import SHARDED_KIND

    if not _host_is_here(manifest):
        again = "export --mesh or compile --mesh" if manifest.get("kind") == SHARDED_KIND else "compile"
        raise ExportError(f"{folder}: compiled for {manifest.get('tvm_target')}, not for this machine; build it "
                          f"again here ({again})")


def import_tvm(beside_torch: bool = False):
    """TVM as its runtime library only (TVM_USE_RUNTIME_LIB), when tvm is not imported yet: without torch when
    torch is not imported either (a fresh `generate` process), or beside torch (`beside_torch`: serve and generate's
    torch runtime on an artifact runtime_suffices runs, which never compile). Else the tvm already there, or the
    whole of it. tvm_ffi imports torch for its DLPack exchange whenever torch is installed; where nothing exchanges
    tensors with torch, its import is made to fail (a None entry in sys.modules) for that moment only."""
    if "tvm" not in sys.modules and (beside_torch or sys.modules.get("torch") is None):  # None: torch blocked
        if beside_torch:
            import torch  # noqa: F401  (first: tvm_ffi's torch bridge is what TvmBackend exchanges tensors through)
        before = os.environ.get("TVM_USE_RUNTIME_LIB")
        os.environ["TVM_USE_RUNTIME_LIB"] = "1"  # read once, as tvm loads; not left to the processes it starts
        block = "torch" not in sys.modules  # a None entry (blocked already) is in sys.modules too
        if block:
            sys.modules["torch"] = None  # type: ignore[assignment]
        try:
            import tvm
            from tvm import base, libinfo

            # The runtime's extras, which a compiled library calls (tvm.contrib.sort.topk: the MoE's routing); the
            # full import loads them as the compiler library's dependency.
            if base._RUNTIME_ONLY and "tvm_runtime_extra" not in base._LOADED_LIBS:
                base._LOADED_LIBS["tvm_runtime_extra"] = base.load_lib_ctypes(
                    "tvm", "tvm_runtime_extra", "RTLD_GLOBAL", extra_lib_paths=libinfo.package_lib_paths())
        finally:
            if block:
                del sys.modules["torch"]
            if before is None:
                os.environ.pop("TVM_USE_RUNTIME_LIB", None)
            else:
                os.environ["TVM_USE_RUNTIME_LIB"] = before
    import tvm

    return tvm


class LeanArtifact:
    """An llvm artifact loaded by TVM's runtime alone: its manifest, every file's sha256 and the library's signature
    checked as TvmBackend checks them (manifest.read_manifest, library.load), the host by `host_record`."""

    def __init__(self, folder: str | Path) -> None:
        from k3compile import library
        from k3compile.manifest import LIBRARY

        tvm = import_tvm()
        from tvm.runtime.vm import VirtualMachine

        folder = Path(folder)
        t0 = time.perf_counter()
        self.manifest, self.config = library.open_artifact(folder)
        check_host(folder, self.manifest)
        self.name = NAME
        self.device = tvm.cpu()
        executable, decode, self._params = library.load_artifact(folder, self.manifest, self.device)
        self._vm = VirtualMachine(executable, self.device)
        self._decode_vm = None
        if decode is not None:
            self._decode_vm = VirtualMachine(decode, self.device)
            if not has_function(self._decode_vm, LAST_FUNC):
                self._decode_vm = None
        if not has_function(self._vm, LAST_FUNC):
            raise ExportError(f"{folder / LIBRARY}: has no {LAST_FUNC} (built by an older k3compile); compile again")
        self.load_s = time.perf_counter() - t0

    def generate(self, prompts: list[list[int]], max_new_tokens: int, temperature: float = 0.0, top_p: float = 1.0,
                 seed: int = 0, eos_token_id: int | None = None, prefill_chunk: int | None = None,
                 progress: Callable[[int, int], None] | None = None) -> Generation:
        """Tokens for a left-padded batch of prompts, as generate.generate gives them (the same sampler)."""
        cfg = self.config
        check_request(cfg, prompts, max_new_tokens, temperature, top_p)
        check_chunk(prefill_chunk)
        sampler = Sampler(temperature, top_p, seed)
        run = _Run(self, len(prompts), max(len(p) for p in prompts) + max_new_tokens)

        def step(ids: np.ndarray, mask: np.ndarray, index: int) -> np.ndarray:
            if index == 0:
                t = ids.shape[1]
                chunk = prefill_chunk or default_prefill_chunk(cfg, len(prompts), t)
                for start in range(0, t, chunk):
                    logits = run.step(ids[:, start:start + chunk], mask[:, :min(t, start + chunk)])
            else:
                logits = run.step(ids, mask)
            last = logits[:, -1]
            check_finite(last, index)
            return sampler(last)

        pad = cfg.pad_token_id if cfg.pad_token_id is not None else 0
        return decode_loop(step, prompts, max_new_tokens, pad, eos_token_id,
                           progress and (lambda index: progress(index + 1, max_new_tokens)))


class _Run:
    """One generation's decode state in TVM tensors: per layer the KDA pair (the last step's outputs) or the MLA
    buffers [B, capacity, width] with their first `length` rows filled."""

    def __init__(self, art: LeanArtifact, batch: int, capacity: int) -> None:
        import tvm

        cfg = art.config
        self.art, self.batch, self.length = art, batch, 0
        self.state = []
        for i, shapes in enumerate(state_shapes(cfg, batch, capacity)):
            if cfg.is_mla(i):
                self.state.append([tvm.runtime.empty(s, "float32", art.device) for s in shapes])
            else:
                self.state.append([tvm.runtime.tensor(np.zeros(s, np.float32), art.device) for s in shapes])

    def step(self, ids: np.ndarray, mask: np.ndarray) -> np.ndarray:
        """One call of main_inplace_last: ids [B, T], mask [B, length + T] -> the last positions' logits [B, 1, V]
        (a numpy view of the VM's output)."""
        import tvm

        art, cfg = self.art, self.art.config
        vm = vm_for(art._vm, art._decode_vm, ids.shape)
        feeds = [tvm.runtime.tensor(np.ascontiguousarray(x, dtype=np.int64), art.device) for x in (ids, mask)]
        feeds += [t for pair in self.state for t in pair]
        outs = vm[LAST_FUNC](*feeds, tvm.runtime.ShapeTuple([self.length]), *art._params)
        if ids.shape[1] * mask.shape[1] >= RELEASE_AT:
            release_pool()
        for i, pair in enumerate(self.state):
            if not cfg.is_mla(i):  # the MLA buffers were written in place and come back as they went
                pair[:] = [outs[1 + 2 * i], outs[2 + 2 * i]]
        self.length = mask.shape[1]
        return np.from_dlpack(outs[0])

