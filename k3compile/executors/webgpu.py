"""The WebGPU driver of the executors: wgpu-py (wgpu-native over Vulkan, Metal or D3D12; Mesa's lavapipe here), as
executors/plan.py asks of a driver (docs/architecture.md, "GPU artifacts and their executors").

Each kernel's WGSL becomes a shader module and a compute pipeline once, at load (wgpu's validator checks it there).
A launch binds its buffers at the bindings its WGSL declares and its scalars in the uniform `PODArgs` struct TVM's
WebGPU generator writes, and is recorded into the one command encoder of the step: the dispatches of a step go to
the device as one command buffer, submitted when the host needs a result (a download), writes into a buffer (a
collective's result) or syncs. Uniform buffers and bind groups are cached by their contents, so the steps of one
shape reuse them.
"""

from __future__ import annotations

import os
import re
import struct
from dataclasses import dataclass

import numpy as np

from k3compile.executors.opencl import DeviceError, padded, size_text

ENV_DEVICE = "K3COMPILE_WEBGPU_ADAPTER"  # the adapter index (wgpu's enumeration order), as --device takes it
MAX_STORAGE_BUFFERS = 10  # what TVM's web runtime requests (targets/webgpu.py checks kernels against it)
_CACHE = 8192  # cached bind groups / uniform buffers before the caches are dropped (a new prefill shape each step)


@dataclass(frozen=True)
class Interface:
    """What a kernel's WGSL declares: its storage bindings by parameter name, its PODArgs fields (name, WGSL type)
    and the uniform's binding (None: no scalar arguments)."""

    bindings: dict
    fields: tuple
    pod_binding: int | None

    @classmethod
    def of(cls, source: str) -> Interface:
        bindings = {m.group(2): int(m.group(1)) for m in re.finditer(
            r"@binding\((\d+)\) var<storage, [a-z_]+> (\w+) ", source)}
        pod = re.search(r"struct PODArgs \{([^}]*)\}", source)
        fields = tuple(re.findall(r"(\w+): (\w+)", pod.group(1))) if pod else ()
        binding = re.search(r"@binding\((\d+)\) var<uniform> podArgs", source)
        return cls(bindings, fields, int(binding.group(1)) if binding else None)

    def pod(self, values: dict, grid) -> bytes:
        """The PODArgs bytes for the scalar arguments `values` (by name) of a launch over `grid`, padded to 16
        bytes."""
        # packGridDimX: the last block index along x (WebGPUDriver.dispatch folds a wider grid over z)
        values = {**{wgsl_name(k): v for k, v in values.items()}, "packGridDimX": grid[0] - 1}
        data = b"".join(struct.pack({"i32": "<i", "u32": "<I", "f32": "<f"}[ty], values[name])
                        for name, ty in self.fields)
        return data.ljust(max(16, -(-len(data) // 16) * 16), b"\0")


def _primary_backends() -> None:
    """wgpu's instance limited to its primary backends (Vulkan, Metal, D3D12), once per process and before the
    instance exists: its GL backend adds no compute device worth choosing (here, llvmpipe again, as a second
    adapter), and probing it wrote three more "error: XDG_RUNTIME_DIR is invalid" lines to stderr on this machine
    without a display (Mesa's Vulkan driver still writes one)."""
    global _INSTANCE_SET
    if _INSTANCE_SET:
        return
    _INSTANCE_SET = True
    try:
        from wgpu.backends.wgpu_native.extras import set_instance_extras

        set_instance_extras(backends=["Primary"])
    except Exception:  # noqa: BLE001 - another wgpu, or an instance made already: all backends, as wgpu's default
        pass


_INSTANCE_SET = False


def adapters() -> list:
    """Every WebGPU adapter wgpu finds on its primary backends (the --device indices); raises DeviceError."""
    _primary_backends()
    try:
        import wgpu

        found = list(wgpu.gpu.enumerate_adapters_sync())
    except Exception as e:  # noqa: BLE001 - wgpu or its loader: the reason is the message
        raise DeviceError(f"WebGPU: no adapter ({_first_line(e)}); install a Vulkan driver (Debian: "
                          "mesa-vulkan-drivers libvulkan1) and pip install wgpu") from None
    if not found:
        raise DeviceError("WebGPU: wgpu finds no adapter; install a Vulkan driver (Debian: mesa-vulkan-drivers "
                          "libvulkan1)")
    return found


class WebGPUDriver:
    """One WebGPU device: adapter `index` (else $K3COMPILE_WEBGPU_ADAPTER, else wgpu's high-performance choice),
    with the adapter's own buffer limits and TVM's 10 storage buffers per kernel. `profile` is accepted and has no
    effect yet (timestamp queries are optional in WebGPU; `bench` profiles the OpenCL executor)."""

    def __init__(self, index: int | None = None, profile: bool = False) -> None:
        try:
            import wgpu
        except ImportError:
            raise DeviceError("WebGPU: the wgpu package is not installed (pip install wgpu)") from None
        _primary_backends()
        if index is None and os.environ.get(ENV_DEVICE) is not None:
            env = os.environ[ENV_DEVICE]
            if not env.isdigit():
                raise DeviceError(f"{ENV_DEVICE}={env!r}: expected an adapter index")
            index = int(env)
        if index is None:
            try:
                adapter = wgpu.gpu.request_adapter_sync(power_preference="high-performance")
            except Exception as e:  # noqa: BLE001
                raise DeviceError(f"WebGPU: no adapter ({_first_line(e)}); install a Vulkan driver (Debian: "
                                  "mesa-vulkan-drivers libvulkan1)") from None
            if adapter is None:
                raise DeviceError("WebGPU: no adapter; install a Vulkan driver (Debian: mesa-vulkan-drivers "
                                  "libvulkan1)")
            index = 0
        else:
            found = adapters()
            if not 0 <= index < len(found):
                raise DeviceError(f"WebGPU adapter {index} does not exist here (adapters: " + ", ".join(
                    f"{i}: {a.info.get('device', '?')} ({a.info.get('backend_type', '?')})"
                    for i, a in enumerate(found)) + ")")
            adapter = found[index]
        limits = adapter.limits
        if limits["max-storage-buffers-per-shader-stage"] < MAX_STORAGE_BUFFERS:
            raise DeviceError(f"WebGPU: the adapter binds {limits['max-storage-buffers-per-shader-stage']} storage "
                              f"buffers per kernel; k3compile's WGSL needs {MAX_STORAGE_BUFFERS}")
        self.max_alloc = int(min(limits["max-buffer-size"], limits["max-storage-buffer-binding-size"]))
        self.max_workgroups = int(limits["max-compute-workgroups-per-dimension"])
        try:
            self.device = adapter.request_device_sync(required_limits={
                "max-storage-buffers-per-shader-stage": MAX_STORAGE_BUFFERS,
                "max-storage-buffer-binding-size": int(limits["max-storage-buffer-binding-size"]),
                "max-buffer-size": int(limits["max-buffer-size"])})
        except Exception as e:  # noqa: BLE001
            raise DeviceError(f"WebGPU: the adapter refused a device ({_first_line(e)})") from None
        self.wgpu, self.adapter, self.index = wgpu, adapter, index
        self.profile = profile
        self._usage = wgpu.BufferUsage.STORAGE | wgpu.BufferUsage.COPY_SRC | wgpu.BufferUsage.COPY_DST
        self._kernels: dict[str, tuple] = {}  # name -> (pipeline, Interface, bind group layout)
        self._pods: dict[bytes, object] = {}
        self._groups: dict[tuple, object] = {}
        self._encoder = self._pass = self._fence = None
        self.dispatches = 0  # dispatches recorded (bench: per step)
        self.cache_groups = True  # bind groups kept by their buffers and uniform (the executor's pooled buffers)

    def describe(self) -> str:
        info = self.adapter.info
        return f"WebGPU {self.index}: {info.get('device', '?')} ({info.get('backend_type', '?')})"

    # ---- kernels ----------------------------------------------------------------------------------------------
    def prepare(self, kernels: dict[str, str]) -> None:
        """A compute pipeline per kernel, made once (wgpu validates the WGSL here)."""
        for name, source in kernels.items():
            self.build(name, source)

    def build(self, name: str, source: str) -> tuple:
        """(pipeline, Interface, bind group layout) of kernel `name` of the WGSL `source`; raises DeviceError."""
        try:
            module = self.device.create_shader_module(code=source)
            pipeline = self.device.create_compute_pipeline(layout="auto",
                                                           compute={"module": module, "entry_point": name})
        except Exception as e:  # noqa: BLE001 - wgpu's validation error: its message is the reason
            raise DeviceError(f"WebGPU refused kernel {name}: {reason(e)}") from None
        self._kernels[name] = (pipeline, Interface.of(source), pipeline.get_bind_group_layout(0))
        return self._kernels[name]

    # ---- memory -----------------------------------------------------------------------------------------------
    def alloc(self, nbytes: int):
        if nbytes > self.max_alloc:
            raise DeviceError(f"a buffer of {size_text(nbytes)} is over this WebGPU adapter's "
                              f"{size_text(self.max_alloc)} per binding (maxStorageBufferBindingSize)")
        try:
            return self.device.create_buffer(size=nbytes, usage=self._usage)
        except Exception as e:  # noqa: BLE001
            raise DeviceError(f"WebGPU: cannot allocate {size_text(nbytes)} ({_first_line(e)})") from None

    def upload(self, array: np.ndarray):
        raw = padded(array)
        buf = self.alloc(raw.size)
        self.device.queue.write_buffer(buf, 0, raw)
        return buf

    def write(self, handle, array: np.ndarray) -> None:
        """Overwrite the start of a buffer with array's bytes (after the dispatches recorded before it)."""
        self.flush()
        self.device.queue.write_buffer(handle, 0, padded(array))

    def download(self, handle, nbytes: int, offset: int = 0) -> bytes:
        self.flush()
        if not nbytes:
            return b""
        start, end = offset // 4 * 4, -(-(offset + nbytes) // 4) * 4  # wgpu copies whole 4-byte words
        raw = bytes(self.device.queue.read_buffer(handle, start, end - start))
        return raw[offset - start:offset - start + nbytes]

    # ---- launches ---------------------------------------------------------------------------------------------
    def launch(self, name: str, launch: dict, handles: list, scalars: list[int], grid, block) -> None:
        pipeline, iface, layout = self._kernels[name]
        names = [p["name"] for p in launch["params"] if p["buffer"]]
        values = dict(zip((p["name"] for p in launch["params"] if not p["buffer"]), scalars))
        self.dispatch(name, pipeline, iface, layout, names, handles, values, grid)

    def dispatch(self, key, pipeline, iface: Interface, layout, names: list[str], handles: list, values: dict,
                 grid) -> None:
        """Record one dispatch of a built pipeline into the step's command encoder. A grid wider than the adapter's
        workgroups per dimension along x is folded over z, as TVM's WGSL expects: its kernels index the block
        blockIdx.z · gridDim.x + blockIdx.x and return past `packGridDimX` (the reason TVM's WebGPU target keeps
        blockIdx.z for itself)."""
        limit = self.max_workgroups
        dims = tuple(grid)
        if dims[0] > limit and any(name == "packGridDimX" for name, _ in iface.fields):
            dims = (limit, dims[1], -(-dims[0] // limit))
        if max(dims) > limit:
            raise DeviceError(f"{key}: a grid of {tuple(grid)} is over this adapter's {limit} workgroups per "
                              "dimension")
        pod = iface.pod(values, grid) if iface.pod_binding is not None else None
        group_key = (key, tuple(id(h) for h in handles), pod)
        group = self._groups.get(group_key, (None,))[0] if self.cache_groups else None
        if group is None:
            entries = [{"binding": iface.bindings[n], "resource": {"buffer": h, "offset": 0, "size": h.size}}
                       for n, h in zip(map(wgsl_name, names), handles) if n in iface.bindings]
            if pod is not None:
                entries.append({"binding": iface.pod_binding,
                                "resource": {"buffer": self._uniform(pod), "offset": 0, "size": len(pod)}})
            group = self.device.create_bind_group(layout=layout, entries=entries)
            if self.cache_groups:  # the buffers kept with it, so their ids stay theirs while it is cached (a bind
                # group does not hold the Python buffers: a freed one's id came back for a new buffer, and the stale
                # group bound the old one: wrong tokens after 14 steps)
                if len(self._groups) > _CACHE:
                    self._groups.clear()
                self._groups[group_key] = (group, list(handles))
        if self._pass is None:
            self._encoder = self.device.create_command_encoder()
            self._pass = self._encoder.begin_compute_pass()
        self._pass.set_pipeline(pipeline)
        self._pass.set_bind_group(0, group)
        self._pass.dispatch_workgroups(*dims)
        self.dispatches += 1

    def _uniform(self, pod: bytes):
        buf = self._pods.get(pod)
        if buf is None:
            if len(self._pods) > _CACHE:
                self._pods.clear()
            buf = self._pods[pod] = self.device.create_buffer_with_data(data=pod,
                                                                        usage=self.wgpu.BufferUsage.UNIFORM)
        return buf

    def flush(self) -> None:
        """Submit the dispatches recorded so far, as one command buffer."""
        if self._pass is not None:
            self._pass.end()
            self.device.queue.submit([self._encoder.finish()])
            self._encoder = self._pass = None

    def sync(self) -> None:
        self.flush()
        # a read waits for the work submitted before it (wgpu-py 0.32's on_submitted_work_done fails in its
        # binding: "initializer for ctype ... WGPUQueueWorkDoneStatus")
        if self._fence is None:
            self._fence = self.alloc(4)
        self.device.queue.read_buffer(self._fence, 0, 4)


def wgsl_name(name: str) -> str:
    """A parameter's name as TVM's WGSL declares it (a dot is not a WGSL identifier character)."""
    return re.sub(r"\W", "_", name)


def reason(error: Exception) -> str:
    """wgpu's validation message on one line (its first lines are a generic header)."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    useful = [line for line in lines if line not in ("Validation Error", "Caused by:")]
    errors = [line for line in useful if "error" in line.lower()]
    return " / ".join((errors or useful)[:4]) or type(error).__name__


def _first_line(e: Exception) -> str:
    return str(e).strip().splitlines()[0][:160] if str(e).strip() else type(e).__name__
