"""A GPU artifact run on its device from its launch plan: the step protocol over k3compile/executors/
(docs/architecture.md, "GPU artifacts and their executors").

`ExecutorBackend(OUT)` checks the manifest (every file's sha256: the plan, the kernel sources and the weights
included), opens the target's driver (its device by `device` index, or the driver's environment variable), builds
every kernel once and uploads the weights once, already in the target's layout, then runs the plan once on
placeholder inputs so that the driver compiles its kernels' device code at load (executors/plan.py: Program.warm):
nothing is lowered at load. A step uploads the token ids and the mask; the decode state (`present`, fed back as
`past`) stays in device memory between steps, and only the logits of each row's last position come back
(`host=True`: all of them and the state too, for `verify`). No TVM and no model code is imported.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np
import torch

from k3compile.interface import ExportError, Past, as_input_type, check_step, init_past, unflatten

# the targets an executor runs here: target -> (its driver's module, the driver class); each module names the
# environment variable that picks its device (ENV_DEVICE)
_DRIVERS = {"opencl": ("k3compile.executors.opencl", "OpenCLDriver"),
            "webgpu": ("k3compile.executors.webgpu", "WebGPUDriver")}
DRIVERS = tuple(_DRIVERS)


def _driver_module(target: str):
    import importlib

    if target not in _DRIVERS:
        raise ExportError(f"no executor runs target {target!r} here (executors: {', '.join(DRIVERS)})")
    return importlib.import_module(_DRIVERS[target][0])


def device_variable(target: str) -> str:
    """The environment variable that picks a GPU target's device (what --device sets), e.g. for `run`'s ranks."""
    return _driver_module(target).ENV_DEVICE


def open_driver(target: str, device: int | None = None, profile: bool = False):
    """The driver of a GPU target's executor, on device `device` (with `profile`, one that times its launches on
    the device); one DeviceError line where it cannot open."""
    return getattr(_driver_module(target), _DRIVERS[target][1])(device, profile=profile)


class DeviceProgram:
    """A launch plan on its device: the driver opened, every kernel built once, the constants and the weights (the
    `names` of `weights`, in the plan's order) uploaded once. What a GPU artifact (ExecutorBackend) and a GPU rank of
    a sharded one (runtime/worker.py) run; `externs` serves the plan's host functions (a rank's collectives)."""

    def __init__(self, plan_file: Path, constants_file: Path, weights: Path, names: list[str], target: str,
                 device: int | None = None, profile: bool = False, externs: dict | None = None) -> None:
        from safetensors.numpy import load_file

        from k3compile.executors.plan import Program
        from k3compile.library import read_tensors

        self.driver = open_driver(target, device, profile)
        try:
            plan = json.loads(Path(plan_file).read_text())
            constants = load_file(str(constants_file)) if Path(constants_file).is_file() else {}
        except (OSError, ValueError) as e:
            raise ExportError(f"{plan_file}: the launch plan cannot be read ({e})") from None
        main = plan.get("main") if isinstance(plan, dict) else None
        if not isinstance(main, dict) or main.get("weights") != names:  # what the plan was built to take
            raise ExportError(f"{plan_file.parent}: its manifest's params are not the weights its launch plan was "
                              "built for (the manifest was edited, or the plan is another build's); compile again")
        try:
            self.program = Program(plan, constants, self.driver, externs)
        except (KeyError, TypeError, IndexError, ValueError, AttributeError) as e:
            raise ExportError(f"{plan_file}: malformed ({type(e).__name__}: {e}); compile again") from None
        # one tensor in host memory at a time, read straight from the file (no memory map: docs/toolchain.md,
        # "Benchmarks"), uploaded, dropped; every entry checked against the header before it is read
        self.weights = [self.program.upload(t) for t in read_tensors(weights, names)]
        try:  # the drivers' compiling at first launch belongs to loading, not to the first step (Program.warm)
            self.program.warm(self.weights, {"attention_mask": 1})  # a mask of tokens: positions from 0
        except (KeyError, TypeError, IndexError, ValueError, AttributeError) as e:
            raise ExportError(f"{plan_file}: malformed ({type(e).__name__}: {e}); compile again") from None

    def run(self, inputs: list) -> list:
        """main on the graph inputs (host tensors are uploaded, device tensors passed as they are) and the weights:
        its results, in device memory."""
        from k3compile.executors.plan import DeviceTensor

        args = [x if isinstance(x, DeviceTensor)
                else self.program.upload(as_input_type(np.asarray(x), p["name"], p["dtype"]))
                for x, p in zip(inputs, self.program.params)]
        try:
            return self.program.run([*args, *self.weights])
        except (KeyError, TypeError, IndexError, ValueError, AttributeError) as e:  # a plan edited and rehashed
            raise ExportError(f"the launch plan is malformed ({type(e).__name__}: {e}); compile again") from None

    def host(self, t) -> torch.Tensor:
        """A device tensor's whole content, in host memory (a host tensor as it is)."""
        return t if isinstance(t, torch.Tensor) else torch.from_numpy(self.program.download(t).reshape(t.shape))

    def last_positions(self, logits) -> torch.Tensor:
        """[b, 1, v]: each row's logits at its last position, all that crosses back for a decode step."""
        b, t, v = logits.shape
        last = np.stack([self.program.download(logits, (r * t + t - 1) * v, v) for r in range(b)])
        return torch.from_numpy(last).reshape(b, 1, v)


class ExecutorBackend:
    def __init__(self, folder: str | Path, device: int | None = None, host: bool = False,
                 profile: bool = False) -> None:
        from k3compile.config import read_config
        from k3compile.manifest import CONSTANTS, LAUNCH_PLAN, WEIGHTS, read_manifest

        folder = Path(folder)
        t0 = time.perf_counter()
        self.manifest = read_manifest(folder)
        target = self.manifest["target"]
        if LAUNCH_PLAN not in self.manifest["files"]:
            raise ExportError(f"{folder}: compiled for {target} without a launch plan (an older k3compile); compile "
                              "it again")
        self.config = read_config(folder / "config.json")
        self.name, self.host = target, host
        self.device = DeviceProgram(folder / LAUNCH_PLAN, folder / CONSTANTS, folder / WEIGHTS,
                                    self.manifest["params"], target, device, profile)
        self.load_s = time.perf_counter() - t0

    @property
    def driver(self):  # the device's driver (bench reads its kernel time)
        return self.device.driver

    @property
    def program(self):
        return self.device.program

    def describe(self) -> str:
        return self.driver.describe()

    def init_past(self, batch: int) -> Past:
        past = init_past(self.config, batch)
        return past if self.host else [tuple(self.program.upload(t.numpy()) for t in pair) for pair in past]

    def host_past(self, past: Past) -> Past:
        """A state (on the device between steps) in host memory: what joins or splits batch rows and the prefix
        cache hold (state.on_host); a step takes host tensors back as they are."""
        return [tuple(self.device.host(t) for t in pair) for pair in past]

    @torch.no_grad()
    def step(self, input_ids, attention_mask, past: Past):
        check_step(self.config, input_ids, attention_mask, past)
        ids = np.asarray(input_ids, dtype=np.int64)  # DeviceProgram.run gives them the type main takes
        mask = np.asarray(attention_mask, dtype=np.int64)
        state = [t.numpy() if isinstance(t, torch.Tensor) else t for pair in past for t in pair]
        outs = self.device.run([ids, mask, *state])
        if self.host:
            host = [self.device.host(x) for x in outs]
            return host[0], unflatten(host[1:])
        return self.device.last_positions(outs[0]), unflatten(outs[1:])
