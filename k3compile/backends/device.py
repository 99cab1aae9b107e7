"""A GPU target's compiled model run here, kernel by kernel, on a device driver (docs/architecture.md, "GPU
targets"): the step protocol over k3compile/devices.py's `run_main`, for `verify --kernels`.

`DeviceBackend(folder, device)` takes a compiled artifact of a GPU target (its manifest checked, every file's sha256)
or an export folder; it lowers the ONNX it holds for the device's target again (what TVM compiled into the
artifact: the same passes, the same kernels) and, for an artifact, uses the artifact's weights (already in the
target's layout, in the library's order) after checking that the rebuild takes the same parameters. TVM's own
runtime has no OpenCL / WebGPU device here; each call of `main` runs as device kernels through pyopencl or wgpu, the
tensors passing through host memory between kernels: slow, but it is the generated code that runs.
"""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import torch

from k3compile.interface import (
    ExportError,
    Past,
    as_input_type,
    check_step,
    init_past,
    numpy_inputs,
    open_export,
    unflatten,
)


class DeviceBackend:
    def __init__(self, folder: str | Path, device: str, progress=None) -> None:
        from k3compile import devices
        from k3compile.compile import build
        from k3compile.config import read_config
        from k3compile.manifest import MANIFEST, read_manifest
        from k3compile.targets import resolve

        folder = Path(folder)
        if device not in devices.DRIVERS:
            raise ExportError(f"--device {device!r}: this machine runs {', '.join(devices.DRIVERS)}")
        self.target = resolve(device)
        self.name = f"{device}-device"
        t0 = time.perf_counter()
        if (folder / MANIFEST).is_file():
            self.manifest = read_manifest(folder)
            if self.manifest["target"] != device:
                raise ExportError(f"{folder}: compiled for {self.manifest['target']}, not {device} (compile it with "
                                  f"--target {device}, or give the export folder)")
            self.config = read_config(folder / "config.json")
        else:
            self.manifest = None
            _, self.config = open_export(folder, graph=True)
        self.dev = devices.driver(device)
        self.mod, _, names, weights = build(folder, self.target, progress=progress, executable=False)
        if self.manifest is not None:
            if names != self.manifest["params"]:
                raise ExportError(f"{folder}: lowering its model.onnx again gives other parameters than its "
                                  "manifest lists (another k3compile or TVM?); compile it again")
            import tvm

            from k3compile.library import read_weights
            from k3compile.manifest import WEIGHTS

            weights = read_weights(folder / WEIGHTS, names, tvm.cpu())
        self._weights = [np.from_dlpack(w) for w in weights]
        self.compile_s = time.perf_counter() - t0
        self.progress = progress

    def describe(self) -> str:
        return self.dev.describe()

    def init_past(self, batch: int) -> Past:
        return init_past(self.config, batch)

    @torch.no_grad()
    def step(self, input_ids, attention_mask, past: Past):
        from k3compile import devices

        check_step(self.config, input_ids, attention_mask, past)
        feeds = numpy_inputs(input_ids, attention_mask, past)
        feeds[:2] = [as_input_type(f, p.name, str(p.ty.dtype)) for f, p in zip(feeds[:2], self.mod["main"].params)]
        outs = devices.run_main(self.mod, self.target, [*feeds, *self._weights], self.dev, self.progress)
        outs = [torch.from_numpy(o) for o in outs]
        return outs[0], unflatten(outs[1:])
