"""WebGPU (docs/architecture.md, "GPU targets"): WGSL, run in a browser or by a native WebGPU (Dawn, wgpu); its
kernels run here on Mesa's lavapipe through wgpu (k3compile/devices.py), whose shader validator checks the WGSL.

WGSL has no 8-bit, 16-bit or 64-bit integers and no f64, and TVM emits them anyway (`array<u8>`, i64 buffers): such
a kernel is refused at compile time, as are workgroups over 256 threads (TVM's WebGPU target), more than 10 storage
buffers in one kernel (what TVM's web runtime requests; the spec's default is 8), a buffer over 128 MiB (the binding
size every device guarantees) and `blockIdx.z`, which the WebGPU code generator reserves."""

from __future__ import annotations

from k3compile.targets import Target
from k3compile.targets.gpu import Limits, schedule_func

_NO_INT = "WGSL has no 8-, 16- or 64-bit integers"
LIMITS = Limits(
    "WGSL", max_threads=256, max_buffers=10, max_binding_bytes=128 * 2**20,
    no_dtypes=("uint8", "int8", "uint16", "int16", "uint64", "int64", "float64"), no_threads=("blockIdx.z",),
    no_buffer_dtypes=("bool",), pow_of_negative=False, infinity=False,
    why={**{t: _NO_INT for t in ("uint8", "int8", "uint16", "int16", "uint64", "int64")},
         "float64": "WGSL has no f64", "bool": "WGSL has no bool in a storage buffer"}, bitcast="bitcast<f32>")


def target() -> Target:
    return Target("webgpu", "webgpu", "words", schedule_func, 0, limits=LIMITS, source=("webgpu", ".wgsl"))
