"""An export folder compiled by TVM, or a compiled artifact, behind the step protocol (docs/architecture.md, "The
compile path").

`TvmBackend(artifact)` loads `k3compile compile`'s OUT after checking its manifest (manifest.read_manifest: every
file's sha256) and passes the weights as parameters. `TvmBackend(export_folder, target="llvm")` checks the folder
like every reader (interface.open_export, check_graph),
imports model.onnx into Relax (frontend.to_relax), runs the passes' phases (passes.PHASES: every k3 call becomes a
TIR kernel, or the build is refused naming the op and why; weight layouts move to compile time, the standard ops are
fused and scheduled for the target), compiles for the target and runs it in the Relax VM. An artifact built for
another CPU (other vector features) is refused rather than run into an illegal instruction. It still registers the
ops' reference implementations (ops.register_tvm_references), which no module k3compile builds calls (modules built
by hand from one k3 node do: the converter tests). No model code is imported.
"""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import torch

from k3compile import library
from k3compile.interface import (
    ExportError,
    GraphInterface,
    Past,
    check_step,
    init_past,
    numpy_inputs,
    open_export,
    unflatten,
)


class TvmBackend:
    """`folder`: an export folder (compiled here, in memory) or a compiled artifact (`k3compile compile`'s OUT,
    loaded after its manifest and every file's sha256 are checked)."""

    def __init__(self, folder: str | Path, target="llvm") -> None:
        import tvm
        from tvm import relax

        from k3compile.manifest import MANIFEST
        from k3compile.ops import register_tvm_references
        from k3compile.targets import resolve

        folder = Path(folder)
        target = resolve(target)  # a Target, or its name
        register_tvm_references()
        self.device = tvm.cpu()
        self._tensor = tvm.runtime.tensor
        t0 = time.perf_counter()
        self._decode_executable = None  # compile --tune's decode.so, when the artifact has one
        if (folder / MANIFEST).is_file():
            self._load_artifact(folder)
        else:
            self._compile_export(folder, target)
        self.compile_s = time.perf_counter() - t0
        self._vm = relax.VirtualMachine(self.executable, self.device)
        self._decode_vm = None if self._decode_executable is None else relax.VirtualMachine(self._decode_executable,
                                                                                             self.device)

    def _compile_export(self, folder: Path, target) -> None:
        from k3compile.compile import build

        self.record, self.config = open_export(folder, graph=True)
        self.name = f"tvm-{target.name}"
        self.mod, self.executable, _, self._params = build(folder, target)

    def _load_artifact(self, folder: Path) -> None:
        from k3compile.config import read_config
        from k3compile.manifest import LIBRARY, WEIGHTS, read_manifest
        from k3compile.targets import TARGETS, resolve

        self.manifest = read_manifest(folder)
        self.config = read_config(folder / "config.json")
        if self.manifest.get("interface") != GraphInterface.of(self.config).as_record():
            raise ExportError(f"{folder}: config.json does not give the interface its manifest records")
        self.name = f"tvm-{self.manifest['target']}"
        if self.manifest["target"] in TARGETS and resolve(self.manifest["target"]).gpu:
            raise ExportError(f"{folder}: compiled for {self.manifest['target']}, which TVM's VM does not run (no "
                              f"device runtime in this TVM); `k3compile generate {folder}` runs it on its device's "
                              "executor (backends/executor.py)")
        here = resolve(self.manifest["target"]).describe()
        if self.manifest.get("tvm_target") != here:
            raise ExportError(f"{folder}: compiled for {self.manifest.get('tvm_target')}, not for this machine "
                              f"({here}); compile it again here")
        names = self.manifest["params"]
        self.executable = library.load(folder / LIBRARY, names, folder / WEIGHTS)
        self._params = library.read_weights(folder / WEIGHTS, names, self.device)
        tuning = self.manifest.get("tuning")
        if tuning:  # compile --tune: a library for decode at batch 1 (k3compile/tune.py), on the same weights
            self._decode_executable = library.load(folder / tuning["library"], names, folder / WEIGHTS)

    def _input(self, x: np.ndarray):
        """A TVM tensor of `x`: shared when it is already aligned as TVM needs (a `present` the VM wrote and that
        comes back as `past`), else copied."""
        import tvm

        x = np.ascontiguousarray(x)
        if x.size and x.ctypes.data % 64 == 0:
            return tvm.runtime.from_dlpack(x)
        return self._tensor(x, self.device)

    def init_past(self, batch: int) -> Past:
        return init_past(self.config, batch)

    @torch.no_grad()
    def step(self, input_ids, attention_mask, past: Past):
        check_step(self.config, input_ids, attention_mask, past)
        feeds = [self._input(x) for x in numpy_inputs(input_ids, attention_mask, past)]
        vm = self._decode_vm if self._decode_vm is not None and tuple(input_ids.shape) == (1, 1) else self._vm
        outs = [torch.from_dlpack(o) for o in vm["main"](*feeds, *self._params)]  # shared, not copied
        return outs[0], unflatten(outs[1:])
