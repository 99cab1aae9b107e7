"""The OpenCL driver of the executors: pyopencl on any OpenCL platform (an ICD: AMD, Intel, ARM Mali, Qualcomm
Adreno, NVIDIA, PoCL here), as executors/plan.py asks of a driver (docs/architecture.md, "GPU artifacts and their
executors"). Kernels are built from their OpenCL C once, at load; launches are queued in order on one in-order
queue and only a download waits for them.
"""

from __future__ import annotations

import os

import numpy as np

from k3compile.interface import ExportError

ENV_DEVICE = "K3COMPILE_OPENCL_DEVICE"  # the device index (over every platform's devices), as --device takes it


class DeviceError(ExportError):
    """A device that cannot be opened here (no driver, no such index), a kernel it refuses, a buffer it cannot
    hold."""


def devices() -> list:
    """Every OpenCL device of every platform, in platform order (the --device indices); raises DeviceError."""
    try:
        import pyopencl as cl

        platforms = cl.get_platforms()
    except Exception as e:  # noqa: BLE001 - pyopencl or the ICD loader: the reason is the message
        raise DeviceError(f"OpenCL: no platform ({str(e).splitlines()[0][:160] if str(e) else type(e).__name__}); "
                          "install an ICD (Debian: pocl-opencl-icd ocl-icd-libopencl1) and pip install pyopencl")\
            from None
    found = [d for p in platforms for d in p.get_devices()]
    if not found:
        raise DeviceError("OpenCL: the platforms have no device")
    return found


class OpenCLDriver:
    """One OpenCL device (`index`, else $K3COMPILE_OPENCL_DEVICE, else the first), one context and one queue. With
    `profile`, the queue records each launch's start and end on the device (OpenCL profiling events, kept in
    `events` until `kernel_time` reads and clears them): what `bench` reports as the kernels' share of a step."""

    def __init__(self, index: int | None = None, profile: bool = False) -> None:
        import pyopencl as cl

        found = devices()
        if index is None:
            env = os.environ.get(ENV_DEVICE, "0")
            if not env.isdigit():
                raise DeviceError(f"{ENV_DEVICE}={env!r}: expected a device index")
            index = int(env)
        if not 0 <= index < len(found):
            raise DeviceError(f"OpenCL device {index} does not exist here (devices: "
                              f"{', '.join(f'{i}: {d.name}' for i, d in enumerate(found))})")
        self.cl = cl
        self.index = index
        self.device = found[index]
        self.ctx = cl.Context(devices=[self.device])
        self.queue = cl.CommandQueue(
            self.ctx, properties=cl.command_queue_properties.PROFILING_ENABLE if profile else 0)
        self.profile = profile
        self.events: list = []
        self.max_alloc = int(self.device.max_mem_alloc_size)
        self._kernels: dict[str, object] = {}

    def describe(self) -> str:
        return f"OpenCL {self.index}: {self.device.platform.name}, {self.device.name}"

    def prepare(self, kernels: dict[str, str]) -> None:
        """Build each kernel's OpenCL C once (one program per kernel: TVM names repeat nothing across them)."""
        for name, source in kernels.items():
            self._kernels[name] = self.build(name, source)

    def build(self, name: str, source: str):
        """The kernel `name` of the OpenCL C `source`, built for this device; raises DeviceError."""
        try:
            return getattr(self.cl.Program(self.ctx, source).build(), name)
        except self.cl.Error as e:
            raise DeviceError(f"OpenCL refused kernel {name}: {str(e).strip().splitlines()[-1][:200]}") from None

    def alloc(self, nbytes: int):
        if nbytes > self.max_alloc:
            raise DeviceError(f"a buffer of {size_text(nbytes)} is over this OpenCL device's "
                              f"{size_text(self.max_alloc)} per allocation")
        try:
            return self.cl.Buffer(self.ctx, self.cl.mem_flags.READ_WRITE, nbytes)
        except self.cl.Error as e:
            raise DeviceError(f"OpenCL: cannot allocate {size_text(nbytes)} ({e})") from None

    def upload(self, array: np.ndarray):
        raw = padded(array)
        buf = self.alloc(raw.size)
        self.cl.enqueue_copy(self.queue, buf, raw)
        return buf

    def write(self, handle, array: np.ndarray) -> None:
        """Overwrite the start of a buffer with array's bytes."""
        self.cl.enqueue_copy(self.queue, handle, np.asarray(array, order="C").reshape(-1).view(np.uint8))

    def download(self, handle, nbytes: int, offset: int = 0) -> bytes:
        raw = np.empty(max(nbytes, 1), np.uint8)
        if nbytes:
            self.cl.enqueue_copy(self.queue, raw[:nbytes], handle, src_offset=offset)
        return raw[:nbytes].tobytes()

    def launch(self, name: str, launch: dict, handles: list, scalars: list[int], grid, block) -> None:
        self.enqueue(self._kernels[name], [p["dtype"] for p in launch["params"] if not p["buffer"]], handles,
                     scalars, grid, block)

    def enqueue(self, kernel, scalar_dtypes: list[str], handles: list, scalars: list[int], grid, block) -> None:
        """Queue one launch of a built kernel: its buffers, then its scalars (TVM's argument order)."""
        size = tuple(g * b for g, b in zip(grid, block))
        event = kernel(self.queue, size, tuple(block), *handles,
                       *(np.dtype(t).type(v) for t, v in zip(scalar_dtypes, scalars)))
        if self.profile:
            self.events.append(event)

    def kernel_time(self) -> tuple[float, int]:
        """(device seconds, launches) of the launches since the last call (a profiling queue's events; waits for
        them)."""
        self.queue.finish()
        total = sum(e.profile.end - e.profile.start for e in self.events) * 1e-9
        count = len(self.events)
        self.events.clear()
        return total, count

    def sync(self) -> None:
        self.queue.finish()


def size_text(nbytes: int) -> str:
    return next(f"{nbytes / 2**k:.1f} {unit}" for k, unit in ((30, "GiB"), (20, "MiB"), (10, "KiB"), (0, "B"))
                if nbytes >= 2**k or k == 0)


def padded(array: np.ndarray) -> np.ndarray:
    """The array's bytes (uploaded as they are), at least 4 and a multiple of 4 (see executors/plan.py: _room)."""
    raw = np.asarray(array, order="C").reshape(-1).view(np.uint8)
    pad = max(4, -(-raw.size // 4) * 4) - raw.size
    return np.concatenate([raw, np.zeros(pad, np.uint8)]) if pad else raw
