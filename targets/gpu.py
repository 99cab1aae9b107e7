"""What the GPU targets share (docs/architecture.md, "GPU targets"): their limits, checked at compile time, and
the lowering of a module's PrimFuncs to device kernels, read back as data (name, parameters, launch extents, source)
so that a kernel can be launched outside TVM (k3compile/devices.py) and its limits checked before code is emitted.

The standard ops are scheduled by dlight inside phase 4 (TVM's GPU legalization runs its Matmul, GEMV, Reduction,
GeneralReduction and Fallback rules on every fused PrimFunc); the k3 kernels are written bound
(k3compile/kernels/gpu.py). A PrimFunc left unbound would compile as host code reading device memory, which TVM does
not report: `check` refuses any PrimFunc whose lowered host function still loads or stores a buffer.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

from k3compile.interface import ExportError


@dataclass(frozen=True)
class Limits:
    """What one target's kernels may use; a kernel over a limit is refused at compile time (`check`)."""

    language: str                        # the device language, for messages ("WGSL", "OpenCL C")
    max_threads: int                     # threads of a workgroup
    max_buffers: int | None = None       # buffer arguments of one kernel
    max_binding_bytes: int | None = None  # bytes of one buffer argument (static sizes)
    no_dtypes: tuple[str, ...] = ()      # element types the language lacks
    no_threads: tuple[str, ...] = ()     # thread axes the language lacks
    no_buffer_dtypes: tuple[str, ...] = ()  # element types the language has as values but cannot store in a buffer
    pow_of_negative: bool = True         # pow(x, 2) is x * x for x < 0 (WGSL's and Metal's pow: undefined)
    infinity: bool = True                # the language can write an infinite constant (WGSL cannot: TVM's `inff`)
    why: dict = field(default_factory=dict)  # dtype / axis -> the reason, for the message
    bitcast: str = ""                    # the language's uint32 -> float bit cast (see exact_constants)


@dataclass(frozen=True)
class Param:
    name: str
    dtype: str       # element type of a buffer, or the scalar's type
    buffer: bool


@dataclass(frozen=True)
class DeviceKernel:
    """One device kernel as lowered: its entry name, parameters in the kernel's order, launch extents (thread tag ->
    a TIR expression of the scalar parameters) and the element types it touches."""

    name: str
    params: tuple[Param, ...]
    extents: tuple[tuple[str, object], ...]
    dtypes: frozenset
    func: object     # the device PrimFunc (codegen input)

    @property
    def threads(self) -> int:
        """Threads of a workgroup (the threadIdx extents, constants in every kernel TVM binds)."""
        return math.prod(int(extent) for tag, extent in self.extents if tag.startswith("threadIdx"))


@dataclass(frozen=True)
class Launch:
    """One kernel launch of a lowered PrimFunc, as its host code makes it: the buffers (PrimFunc parameter indices,
    or workspace keys), the scalar arguments and the grid / workgroup sizes, for given sizes of its shape variables."""

    kernel: DeviceKernel
    buffers: tuple
    scalars: tuple[int, ...]
    grid: tuple[int, int, int]
    block: tuple[int, int, int]


@dataclass(frozen=True)
class Lowered:
    """A PrimFunc lowered for a GPU target: its device kernels in launch order with the host's call arguments, the
    host's bindings (let variables: the common subexpressions it passes to kernels), and whether its host part
    still touches buffer memory (an unbound loop nest)."""

    name: str
    kernels: tuple[DeviceKernel, ...]
    host_memory: bool
    calls: tuple = ()     # per kernel: the host call's arguments (buffers, scalars, launch extents)
    binds: tuple = ()     # (var, value) in the host's order
    workspace: tuple = ()  # (name, dtype, shape): device buffers the host allocates (a sort's scratch)
    buffers: tuple = ()   # per kernel: the PrimFunc parameter index (or workspace key) of each buffer argument

    def workspace_shapes(self, sizes: dict[str, int]) -> dict[str, tuple[tuple[int, ...], str]]:
        """name -> (shape, dtype) of each workspace buffer for `sizes`."""
        number = self._numbers(sizes)
        return {name: (tuple(number(d) for d in shape), dtype) for name, dtype, shape in self.workspace}

    def _numbers(self, sizes: dict[str, int]):
        """A function evaluating a host expression to an int, given `sizes` (shape variable name -> value)."""
        import tvm.sym
        from tvm import tirx

        analyzer = tvm.sym.Analyzer()
        for var, value in self.binds:
            if not str(var.ty).startswith(("int", "uint")):
                continue
            if var.name in sizes:
                analyzer.bind(var, tirx.const(sizes[var.name], str(var.ty)))
                continue
            value = analyzer.simplify(value)
            if isinstance(value, tirx.IntImm):
                analyzer.bind(var, value)

        def number(expr) -> int:
            value = analyzer.simplify(expr)
            if not isinstance(value, tirx.IntImm):
                raise ValueError(f"{self.name}: a launch argument depends on more than the shapes {sorted(sizes)}: "
                                 f"{value}")
            return int(value.value)

        return number

    def launches(self, sizes: dict[str, int]) -> list[Launch]:
        """The launches for `sizes` (shape variable name -> value)."""
        number = self._numbers(sizes)
        out = []
        for kernel, args, names in zip(self.kernels, self.calls, self.buffers):
            buffers = [p for p in kernel.params if p.buffer]
            scalars = [number(a) for a in args[len(buffers):len(kernel.params)]]
            tags = [str(t) for t in kernel.func.attrs["tirx.kernel_launch_params"]]
            dims = dict(zip(tags, (number(a) for a in args[len(kernel.params):])))
            grid = tuple(dims.get(f"blockIdx.{a}", 1) for a in "xyz")
            block = tuple(dims.get(f"threadIdx.{a}", 1) for a in "xyz")
            out.append(Launch(kernel, names, tuple(scalars), grid, block))
        return out


def _root(arg, decls: dict) -> int:
    """The buffer (its object handle) a kernel's buffer argument points into: the argument is buffer_data(b), and b
    may be a flattened re-declaration of another buffer (its data buffer_data(parent)); the root is a parameter of
    the PrimFunc or a host allocation."""
    buf = arg.args[0]
    for _ in range(len(decls)):
        data = decls.get(buf.__chandle__())
        if data is None or getattr(getattr(data, "op", None), "name", "") != "tirx.buffer_data":
            break
        buf = data.args[0]
    return buf.__chandle__()


def _dtype_of(ty) -> str:
    m = re.match(r'T\.handle\("(\w+)"', str(ty))
    return m.group(1) if m else str(ty)


def exact_constants(target):
    """A pass replacing every float32 constant of the (lowered) device code that TVM's C-like code generators would
    print inexactly by the bit cast of its bits. They print 7 significant digits (`-3.402823e+38f` for -FLT_MAX,
    which is -3.4028235e+38): a max-reduction starting there never takes a masked score, and softmax divides 0 by 0.
    A constant is kept when its 7-digit text reads back as the same float. It runs last, after the TIR pipeline's
    reductions are lowered (their identity element must stay a constant until then)."""
    import numpy as np
    import tvm
    import tvm_ffi
    from tvm import tirx

    cast = target.limits.bitcast

    def exact(node):
        if str(node.ty) != "float32":
            return node
        value = np.float32(node.value)
        if not np.isfinite(value) or np.float32(float(f"{float(value):.6e}")) == value:
            return node
        return tirx.call_pure_extern("float32", cast, tirx.const(int(value.view(np.uint32)), "uint32"))

    @tvm.transform.module_pass(opt_level=0, name="K3ExactConstants")
    def run(mod, ctx):
        if not cast:
            return mod
        return tvm.IRModule({gv: tvm_ffi.structural.structural_map(f, ((tirx.FloatImm, exact),))
                             if isinstance(f, tirx.PrimFunc) else f for gv, f in mod.functions_items()},
                            attrs=mod.attrs)

    return run


def import_tensor_intrinsics() -> None:
    """Imports tvm.s_tir.tensor_intrin, which dlight's Metal matmul rule imports on its first call, in ~3 s where a
    plain import takes ~28 (docs/toolchain.md, "TVM's tensor intrinsics"). Each of its ~530 TVMScript functions
    calls inspect.stack(), and for every import-machinery frame ("<frozen importlib._bootstrap>") the stack asks
    inspect.getmodule, which finds no file by that name and walks all of sys.modules each time. For the import only,
    getmodule keeps its answer for such names (never a file of a module: the answer cannot change meanwhile)."""
    import inspect
    import sys

    if "tvm.s_tir.tensor_intrin" in sys.modules:
        return
    plain = inspect.getmodule
    known: dict = {}

    def getmodule(obj, _filename=None):
        if _filename is None or not _filename.startswith("<"):
            return plain(obj, _filename)
        if _filename not in known:
            known[_filename] = plain(obj, _filename)
        return known[_filename]

    inspect.getmodule = getmodule
    try:
        import tvm.s_tir.tensor_intrin  # noqa: F401 - registers the intrinsics the rule looks up
    finally:
        inspect.getmodule = plain


def tir_pipeline(target) -> str:
    """The name of the TIR pipeline to build `target`'s kernels with (registered once): TVM's default, with
    `exact_constants` after the device passes."""
    import tvm
    from tvm.tirx import compilation_pipeline as pipelines

    name = f"k3-{target.name}"
    if name not in pipelines.PIPELINE_MAP:
        def make():
            pipeline, finalize_host, finalize_device = pipelines.get_tir_pipeline("s_tir")
            return pipeline, finalize_host, lambda: tvm.transform.Sequential([finalize_device(),
                                                                              exact_constants(target)])

        pipelines.register_tir_pipeline(name, make)
    return name


def lower(mod, target) -> dict[str, Lowered]:
    """The PrimFuncs of `mod` (an IRModule; Relax functions are skipped) lowered by `target`'s TIR pipeline
    (`tir_pipeline`) and split into host and device functions, as `tvm.compile` does before code generation."""
    import tvm
    from tvm import tirx
    from tvm.tirx.build import split_host_device_mods

    funcs = {gv.name_hint: f.with_attr("global_symbol", gv.name_hint) for gv, f in mod.functions_items()
             if isinstance(f, tirx.PrimFunc)}
    if not funcs:
        return {}
    tvm_target = target.tvm().with_host(tvm.target.Target("llvm"))
    prim = tirx.transform.BindTarget(tvm_target)(tvm.IRModule(funcs))
    pipeline, _, finalize_device = tvm.tirx.get_tir_pipeline(tir_pipeline(target))
    host, devices = split_host_device_mods(pipeline(prim))
    device_funcs = {}
    for device_mod in devices.values():
        for gv, f in finalize_device()(device_mod).functions_items():
            device_funcs[gv.name_hint] = f
    out = {}
    for gv, hf in host.functions_items():
        calls, binds, allocs, decls, memory = [], [], [], {}, [False]

        def visit(node, calls=calls, binds=binds, allocs=allocs, decls=decls, memory=memory):
            if isinstance(node, tvm.ir.Call) and getattr(node.op, "name", "") == "tirx.call_ffi_kernel":
                calls.append((node.args[0].value, tuple(node.args[1:])))
            elif isinstance(node, tirx.stmt.DeclBuffer):
                decls[node.buffer.__chandle__()] = node.data  # keyed by object: Var == Var builds an expression
            elif isinstance(node, tirx.Bind):
                binds.append((node.var, node.value))
            elif isinstance(node, tirx.stmt.AllocBuffer):
                allocs.append((node.buffer.__chandle__(), str(node.buffer.dtype), tuple(node.buffer.shape)))
            elif isinstance(node, (tvm.ir.expr.TensorLoad, tirx.BufferStore)):
                memory[0] = True

        _walk(hf.body, visit, order="pre")
        name = gv.name_hint
        if name not in funcs:
            continue
        kernels = tuple(_kernel(device_funcs[c]) for c, _ in calls)
        # buffers by identity, never by name (two parameters of a fused function can share one): a parameter's
        # index, or a workspace's key "workspace<j>"
        where = {p.__chandle__(): i for i, p in enumerate(funcs[name].params)}
        where.update({h: f"workspace{j}" for j, (h, _, _) in enumerate(allocs)})
        buffers = tuple(tuple(where[_root(a, decls)] for a in args[:sum(p.buffer for p in k.params)])
                        for k, (_, args) in zip(kernels, calls))
        out[name] = Lowered(name, kernels, memory[0], tuple(a for _, a in calls), tuple(binds),
                            tuple((f"workspace{j}", d, shape) for j, (_, d, shape) in enumerate(allocs)), buffers)
    return out


def _walk(root, visit, order: str = "post") -> None:
    """Call visit(node) on every node under root (this TVM has no Python TIR visitor; tvm_ffi walks any object)."""
    import tvm_ffi

    tvm_ffi.structural.structural_walk(root, lambda node: visit(node), order=order)


def _kernel(func) -> DeviceKernel:
    import tvm
    from tvm import tirx

    extents, dtypes = [], set()

    def visit(node):
        if isinstance(node, tirx.AttrStmt) and node.attr_key == "thread_extent":
            extents.append((node.node.thread_tag, node.value))
        elif isinstance(node, tvm.ir.expr.TensorLoad):
            dtypes.add(str(node.ty))
        elif isinstance(node, tirx.Cast) and not str(node.ty).startswith(("int64", "uint64")):
            dtypes.add(str(node.ty))  # (64-bit index arithmetic is narrowed to 32 bits by the WGSL generator)
        elif isinstance(node, tirx.BufferStore):
            dtypes.add(str(node.value.ty))

    _walk(func.body, visit)
    params = tuple(Param(p.name, _dtype_of(p.ty), str(p.ty).startswith("T.handle")) for p in func.params)
    return DeviceKernel(str(func.attrs["global_symbol"]), params, tuple(extents), frozenset(dtypes), func)


def check(mod, target, lowered: dict[str, Lowered] | None = None) -> dict[str, Lowered]:
    """Refuse (ExportError, one line naming the function and the limit) any PrimFunc of `mod` that the target
    cannot run: unbound (host code over device memory), or over one of its Limits. Returns the lowering."""
    limits = target.limits
    lowered = lower(mod, target) if lowered is None else lowered
    shapes = {gv.name_hint: f for gv, f in mod.functions_items() if hasattr(f, "body")}
    for name, low in lowered.items():
        where = f"target {target.name!r}: kernel {name!r}"
        if low.host_memory or not low.kernels:
            raise ExportError(f"{where} has no thread binding (it would run as host code over device memory)")
        for k in low.kernels:
            if k.threads > limits.max_threads:
                raise ExportError(f"{where} uses workgroups of {k.threads} threads; {limits.language} allows "
                                  f"{limits.max_threads}")
            for tag, _ in k.extents:
                if tag in limits.no_threads:
                    raise ExportError(f"{where} uses {tag}, which {limits.language} lacks")
            buffers = [p for p in k.params if p.buffer]
            if limits.max_buffers is not None and len(buffers) > limits.max_buffers:
                raise ExportError(f"{where} takes {len(buffers)} storage buffers; {limits.language} allows "
                                  f"{limits.max_buffers} per kernel")
            stored = {p.dtype for p in k.params if p.buffer}
            for dtype in sorted(stored | k.dtypes):
                if dtype.split("x")[0] in limits.no_dtypes or (
                        dtype in stored and dtype in limits.no_buffer_dtypes):
                    raise ExportError(f"{where} uses {dtype} ({limits.why.get(dtype.split('x')[0], 'unsupported')})")
        if limits.max_binding_bytes is not None and name in shapes:
            for buf in shapes[name].params:  # a PrimFunc parameter is its buffer
                if is_buffer(buf) and all(hasattr(d, "value") for d in buf.shape):
                    size = math.prod(int(d.value) for d in buf.shape) * _bytes(buf.dtype)
                    if size > limits.max_binding_bytes:
                        raise ExportError(
                            f"{where} binds {buf.name} of {size / 2**20:.0f} MiB; {limits.language} devices "
                            f"guarantee {limits.max_binding_bytes // 2**20} MiB per binding (shard the experts)")
    return lowered


def is_buffer(param) -> bool:
    """A PrimFunc parameter that is a buffer (in this TVM the parameter is its buffer), not a scalar."""
    try:
        return param.shape is not None
    except AttributeError:
        return False


def _bytes(dtype) -> int:
    import numpy as np

    return np.dtype(str(dtype)).itemsize


def kernel_source(kernel: DeviceKernel, tvm_target) -> str:
    """The device source of one kernel alone (the target's code generator on a module of that kernel)."""
    import tvm

    build = tvm.get_global_func(f"target.build.{tvm_target.kind.name}")
    return build(tvm.IRModule({kernel.name: kernel.func}), tvm_target).inspect_source()


def device_source(executable, kind: str) -> str:
    """The device source TVM generated for an executable (the module of `kind` among its imports)."""

    def find(m):
        if m.kind == kind:
            return m
        for child in m.imports:
            found = find(child)
            if found is not None:
                return found
        return None

    found = find(executable.mod)
    return found.inspect_source() if found is not None else ""


def schedule_func(func):
    """Phase 5 on a GPU target: the standard ops were scheduled by dlight in phase 4; nothing is left to do."""
    return func
