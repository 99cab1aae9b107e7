"""Run the device code TVM generates for a GPU target outside TVM (docs/architecture.md, "GPU targets": this TVM
wheel has no OpenCL or WebGPU runtime): the OpenCL C on any OpenCL platform through pyopencl (PoCL here), the WGSL on
any WebGPU adapter through wgpu (Mesa's lavapipe here: Vulkan on the CPU), whose shader validator checks the WGSL when
the module is created.

`run(func, target, inputs, outputs, driver)` lowers one PrimFunc for the target (targets/gpu.py: lower), binds its
shape variables from the input shapes, and launches each of its device kernels in the host's order with the scalar
arguments and grid / workgroup sizes the host code computes; it returns the output arrays. `run_main` does that for
every call of a compiled module's `main` in turn: a whole model step, kernel by kernel. `driver(name)` opens the
platform once per process; a platform that cannot load raises DeviceError with the reason.
"""

from __future__ import annotations

import functools

import numpy as np

from k3compile.executors.opencl import DeviceError, OpenCLDriver  # one error type for every device here
from k3compile.executors.webgpu import WebGPUDriver

DRIVERS = ("opencl", "webgpu")


@functools.cache
def driver(name: str):
    """The driver for `name` ("opencl" / "webgpu"), opened once."""
    if name == "opencl":
        return OpenCL()
    if name == "webgpu":
        return WebGPU()
    raise DeviceError(f"no device driver for {name!r} (drivers: {', '.join(DRIVERS)})")


def run(func, target, inputs: list, outputs: list[tuple[tuple[int, ...], str]], dev=None, lowered=None,
        scalars: tuple = ()) -> list[np.ndarray]:
    """Run PrimFunc `func` (its parameters: the inputs, then the outputs, destination-passing style, then any
    scalar `scalars`) built for `target` (a k3compile.targets.Target) on the target's driver; an input is an array
    or, for a scalar parameter, an int; `outputs`: (shape, dtype) of each output. Returns the outputs."""
    import tvm

    from k3compile.targets.gpu import is_buffer, lower

    dev = dev or driver(target.name)
    if lowered is None:
        name = str(func.attrs["global_symbol"]) if func.attrs is not None and "global_symbol" in func.attrs \
            else "k3_kernel"
        lowered = lower(tvm.IRModule({name: func}), target)[name]
    values = [*inputs, *(np.zeros(s, d) for s, d in outputs), *scalars]
    if len(values) != len(func.params):
        raise ValueError(f"{lowered.name}: takes {len(func.params)} arguments, given {len(values)}")
    buffers, sizes = {}, {}
    for i, (param, value) in enumerate(zip(func.params, values)):
        if not is_buffer(param):
            sizes[param.name] = int(value)
            continue
        array = np.asarray(value, order="C")  # (np.ascontiguousarray makes a 0-d array 1-d)
        if len(param.shape) != array.ndim or str(param.dtype) != str(array.dtype):
            raise ValueError(f"{lowered.name}: {param.name} takes {param.dtype}{list(param.shape)}, "
                             f"given {array.dtype}{list(array.shape)}")
        for dim, n in zip(param.shape, array.shape):
            if hasattr(dim, "value"):
                if int(dim.value) != n:
                    raise ValueError(f"{lowered.name}: {param.name} has {n} where {int(dim.value)} is expected")
            elif hasattr(dim, "name"):
                sizes[dim.name] = n
        if hasattr(param.elem_offset, "name"):  # a symbolic offset: the runner's buffers start at 0
            sizes[param.elem_offset.name] = 0
        buffers[i] = array
    handles = {i: dev.upload(a) for i, a in buffers.items()}
    for key, (shape, dtype) in lowered.workspace_shapes(sizes).items():
        handles[key] = dev.upload(np.zeros(shape, dtype))
    for launch in lowered.launches(sizes):
        if launch.grid[0] * launch.grid[1] * launch.grid[2]:
            dev.launch(launch, target, [handles[b] for b in launch.buffers])
    return [dev.download(handles[i], buffers[i]) for i in range(len(inputs), len(inputs) + len(outputs))]


def run_main(mod, target, args: list[np.ndarray], dev=None, progress=None) -> list[np.ndarray]:
    """Run a module's `main` (after the compile phases: call_tir bindings, tuples and their items) kernel by kernel
    on the target's driver; `args`: main's parameters (graph inputs, then weights). The intermediate tensors go
    through host memory between kernels (simple, not fast). Returns main's outputs (a tuple: a list)."""
    import tvm
    import tvm.sym
    from tvm import relax, tirx

    from k3compile.targets.gpu import lower

    dev = dev or driver(target.name)
    main = mod["main"]
    lowered = lower(mod, target)
    env: dict = {}
    analyzer = tvm.sym.Analyzer()
    for param, value in zip(main.params, args):
        env[param.__chandle__()] = value  # keyed by object (a Var's == builds an expression)
        for dim, n in zip(param.ty.shape, value.shape):
            if isinstance(dim, tirx.Var):
                analyzer.bind(dim, tirx.const(n, str(dim.ty)))
    call_tir = tvm.ir.Op.get("relax.call_tir")

    def number(expr) -> int:
        return int(analyzer.simplify(expr).value)

    def spec(ty):
        return tuple(number(d) for d in ty.shape), str(ty.dtype)

    def value_of(expr):
        if isinstance(expr, relax.Var) and expr.__chandle__() in env:
            return env[expr.__chandle__()]
        if not isinstance(expr, (relax.Var, relax.Tuple)) and hasattr(expr, "value") and hasattr(expr.value, "numpy"):
            return expr.value.numpy()  # a constant
        if str(expr.ty).startswith(("int", "uint")):  # a shape variable or expression: a scalar argument
            return number(expr)
        if isinstance(expr, relax.Tuple):
            return [value_of(f) for f in expr.fields]
        raise DeviceError(f"main: cannot evaluate {type(expr).__name__} {expr} on the device runner")

    bindings = [b for block in main.body.blocks for b in block.bindings]
    for n, binding in enumerate(bindings):
        value = binding.value
        if isinstance(value, relax.Call) and value.op.same_as(call_tir):
            gv = value.args[0]
            args_in = [value_of(a) for a in value.args[1].fields]
            scalars = [number(v) for v in value.args[2].values] if len(value.args) > 2 else []
            out_ty = binding.var.ty
            outs = [spec(t) for t in out_ty.fields] if isinstance(out_ty, relax.TupleType) else [spec(out_ty)]
            if progress is not None:
                progress(f"kernel {n + 1}/{len(bindings)}: {gv.name_hint}")
            got = run(mod[gv], target, args_in, outs, dev, lowered[gv.name_hint], tuple(scalars))
            env[binding.var.__chandle__()] = got if isinstance(out_ty, relax.TupleType) else got[0]
        elif isinstance(value, relax.TupleGetItem):
            env[binding.var.__chandle__()] = value_of(value.tuple_value)[value.index]
        else:
            env[binding.var.__chandle__()] = value_of(value)
    result = value_of(main.body.body)
    return result if isinstance(result, list) else [result]


class OpenCL(OpenCLDriver):
    """The executors' OpenCL driver (executors/opencl.py), launching lowered kernels (targets/gpu.py) one at a time:
    each kernel's source is generated and built on its first launch."""

    def __init__(self) -> None:
        super().__init__(0)
        self._built: dict = {}  # kernels by _key: lowered kernels of one name differ in their signature

    def download(self, handle, like: np.ndarray) -> np.ndarray:
        raw = super().download(handle, like.nbytes)
        return np.frombuffer(raw, np.uint8).view(like.dtype).reshape(like.shape).copy()

    def launch(self, launch, target, handles) -> None:
        from k3compile.targets.gpu import kernel_source

        key = _key(launch.kernel)
        if key not in self._built:
            self._built[key] = self.build(launch.kernel.name, kernel_source(launch.kernel, target.tvm()))
        self.enqueue(self._built[key], [p.dtype for p in launch.kernel.params if not p.buffer], handles,
                     list(launch.scalars), launch.grid, launch.block)
        self.sync()


class WebGPU(WebGPUDriver):
    """The executors' WebGPU driver (executors/webgpu.py), launching lowered kernels (targets/gpu.py) one at a time:
    each kernel's WGSL is generated and its pipeline made on its first launch."""

    def __init__(self) -> None:
        super().__init__(None)
        self.cache_groups = False  # the runner's buffers live for one kernel call
        self._built: dict = {}  # pipelines by _key: lowered kernels of one name differ in their code

    def download(self, handle, like: np.ndarray) -> np.ndarray:
        raw = super().download(handle, like.nbytes)
        return np.frombuffer(raw, np.uint8).view(like.dtype).reshape(like.shape).copy()

    def pipeline(self, kernel, target) -> tuple:
        """(pipeline, Interface, layout) of a lowered kernel, made once; an invalid WGSL raises DeviceError."""
        from k3compile.targets.gpu import kernel_source

        key = _key(kernel)
        if key not in self._built:
            self._built[key] = self.build(kernel.name, kernel_source(kernel, target.tvm()))
        return self._built[key]

    def launch(self, launch, target, handles) -> None:
        pipeline, iface, layout = self.pipeline(launch.kernel, target)
        names = [p.name for p in launch.kernel.params if p.buffer]
        values = dict(zip((p.name for p in launch.kernel.params if not p.buffer), launch.scalars))
        self.dispatch(launch.kernel.name, pipeline, iface, layout, names, handles, values, launch.grid)
        self.flush()


def _key(kernel):
    """A kernel's identity for the caches: its name and its lowered code (names repeat across modules)."""
    import tvm_ffi

    return kernel.name, tvm_ffi.structural_hash(kernel.func)
