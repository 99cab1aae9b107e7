"""An export folder compiled by TVM, or a compiled artifact, behind the step protocol (docs/architecture.md, "The
compile path").

`TvmBackend(artifact)` loads `k3compile compile`'s OUT after checking its manifest (compile.read_manifest: every
file's sha256) and passes the weights as parameters. `TvmBackend(export_folder, target="llvm")` checks the folder
like every reader (interface.open_export, check_graph),
imports model.onnx into Relax (frontend.to_relax), runs the passes' phases (passes.PHASES: the KDA recurrence and
the MXFP4 MoE dispatch become TIR kernels, weight layouts move to compile time, the standard ops are fused and
scheduled for the target), compiles for the target and runs it in the Relax VM. An artifact built for another
CPU (other vector features) is refused rather than run into an illegal instruction. k3 calls no kernel
covers yet (float experts, MXFP8 activations) stay calls of their extern symbols, served by the ops' reference
implementations (the eager ops, registered by ops.register_tvm_references). No model code is imported.
"""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import torch

from k3compile.interface import (
    ExportError,
    GraphInterface,
    Past,
    init_past,
    numpy_inputs,
    open_export,
    unflatten,
)


class TvmBackend:
    """`folder`: an export folder (compiled here, in memory) or a compiled artifact (`k3compile compile`'s OUT,
    loaded after its manifest and every file's sha256 are checked)."""

    def __init__(self, folder: str | Path, target: str = "llvm") -> None:
        import tvm
        from tvm import relax

        from k3compile.compile import MANIFEST, check_target
        from k3compile.ops import register_tvm_references

        folder = Path(folder)
        check_target(target)
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

    def _compile_export(self, folder: Path, target: str) -> None:
        from k3compile.compile import build

        self.record, self.config = open_export(folder, graph=True)
        self.name = f"tvm-{target}"
        self.mod, self.executable, _, self._params = build(folder, target)

    def _load_artifact(self, folder: Path) -> None:
        from k3compile.compile import LIBRARY, WEIGHTS, read_manifest
        from k3compile.config import read_config
        from k3compile.targets import TARGETS, resolve

        self.manifest = read_manifest(folder)
        self.config = read_config(folder / "config.json")
        if self.manifest.get("interface") != GraphInterface.of(self.config).as_record():
            raise ExportError(f"{folder}: config.json does not give the interface its manifest records")
        self.name = f"tvm-{self.manifest['target']}"
        if self.manifest["target"] in TARGETS and resolve(self.manifest["target"]).gpu:
            raise ExportError(f"{folder}: compiled for {self.manifest['target']}, which this TVM cannot run here (no "
                              f"device runtime); run its kernels with `k3compile verify {folder} --device "
                              f"{self.manifest['target']}` where that driver exists")
        here = resolve(self.manifest["target"]).describe()
        if self.manifest.get("tvm_target") != here:
            raise ExportError(f"{folder}: compiled for {self.manifest.get('tvm_target')}, not for this machine "
                              f"({here}); compile it again here")
        self.executable = _load_library(folder / LIBRARY)
        self._params = read_weights(folder / WEIGHTS, self.manifest["params"], self.device)
        tuning = self.manifest.get("tuning")
        if tuning:  # compile --tune: a library for decode at batch 1 (k3compile/tune.py), on the same weights
            self._decode_executable = _load_library(folder / tuning["library"])

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
        feeds = [self._input(x) for x in numpy_inputs(input_ids, attention_mask, past)]
        vm = self._decode_vm if self._decode_vm is not None and tuple(input_ids.shape) == (1, 1) else self._vm
        outs = [torch.from_dlpack(o) for o in vm["main"](*feeds, *self._params)]  # shared, not copied
        return outs[0], unflatten(outs[1:])


def _load_library(path: Path):
    import tvm

    try:
        return tvm.runtime.load_module(str(path))
    except Exception as e:  # TVM's loader raises its own error types for a bad library
        raise ExportError(f"{path}: cannot load it ({str(e).splitlines()[0][:200]})") from None


# what compile writes (numpy can view each through DLPack): safetensors dtype -> (TVM dtype, bytes)
SAFETENSORS_DTYPES = {"F32": ("float32", 4), "F16": ("float16", 2), "F64": ("float64", 8), "U8": ("uint8", 1),
                      "I8": ("int8", 1), "I32": ("int32", 4), "U32": ("uint32", 4), "I64": ("int64", 8),
                      "BOOL": ("bool", 1)}
HEADER_MAX = 100 * 2**20  # the safetensors format's own bound on the JSON header


def read_weights(path: Path, names: list[str], device) -> list:
    """The named tensors of a safetensors file, each read straight into TVM memory (no numpy copy, no memory map:
    the peak resident memory is the weights once plus the process). The format: an 8-byte little-endian header
    length, a JSON header {name: {dtype, shape, data_offsets: [begin, end]}} (offsets after the header), the data.
    The file's sha256 was checked against the manifest already; every entry is still checked before it is read."""
    import json
    import math
    import struct

    import tvm

    def bad(why: str) -> ExportError:
        return ExportError(f"{path}: not a readable weights file ({why}; compile again)")

    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) != 8:
                raise bad("truncated")
            n = struct.unpack("<Q", head)[0]
            if n > min(HEADER_MAX, size - 8):
                raise bad("header length out of range")
            try:
                header = json.loads(f.read(n))
            except (ValueError, UnicodeDecodeError):
                raise bad("header is not JSON") from None
            if not isinstance(header, dict):
                raise bad("header is not a table")
            out = []
            for name in names:
                ent = header.get(name)
                if not isinstance(ent, dict):
                    raise ExportError(f"{path}: missing the weight {name!r} the library takes")
                dtype, shape, offsets = ent.get("dtype"), ent.get("shape"), ent.get("data_offsets")
                if (not isinstance(dtype, str) or dtype not in SAFETENSORS_DTYPES or not isinstance(shape, list)
                        or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape)
                        or not (isinstance(offsets, list) and len(offsets) == 2
                                and all(isinstance(o, int) and not isinstance(o, bool) for o in offsets))):
                    raise bad(f"entry {name!r} malformed")
                tvm_dtype, itemsize = SAFETENSORS_DTYPES[dtype]
                begin, end = offsets
                if not (0 <= begin <= end and 8 + n + end <= size
                        and end - begin == itemsize * math.prod(shape)):  # checked before any allocation
                    raise bad(f"entry {name!r} out of range")
                t = tvm.runtime.empty(shape, tvm_dtype, device)
                view = np.from_dlpack(t)
                f.seek(8 + n + begin)
                if view.nbytes and f.readinto(memoryview(view.reshape(-1)).cast("B")) != view.nbytes:
                    raise bad("truncated")
                out.append(t)
            return out
    except OSError as e:
        raise ExportError(f"{path}: unreadable ({e.strerror or e})") from None
