"""Phase 4: main's ops in forms the target's device language stores and computes exactly (WGSL: docs/architecture.md,
"GPU targets"): 64-bit integers narrowed to 32 bits, boolean tensors kept as int32 between kernels, and `power` by
a small whole exponent written as products. A target that needs none of it (llvm, OpenCL, CUDA) is left as it is.

K3's graph carries int64 where ONNX and torch.export put it: the token ids and the mask (main's inputs), positions
(`arange`), the router's top-k expert indices, the shapes turned into tensors (`shape_to_tensor`), the constants
they meet, and the lifted integer weights. Every one holds a small number, so main is rebuilt with int32 in their
place and the ops between them (add, where, less, take, gather, concat, ...) re-typed by Relax's own inference:

- main's int64 parameters (ids < the vocabulary, the 0 / 1 mask, lifted integer weights) become int32; a weight's
  values are checked when the build casts it (compile.py: `narrow_weights`);
- `astype(x, "int64")`, `arange(..., dtype="int64")` and `topk(..., dtype="int64")` produce int32: positions run to
  past + seq, which the executor refuses past 2^31 − 1 (2000 times K3's 1M-token window); top-k indices are below
  the scored axis's static extent, checked here;
- `shape_to_tensor(shape)` becomes an int32 kernel of its own (a TE compute over the shape's expressions);
- int64 constants become int32 ones, refused here (naming the value) where one does not fit;
- a host function's int64 results (`call_dps_packed`: a sharded rank's collectives return what they are given)
  become int32 (the all-to-all itself moves fp32 rows, its expert ids among them: nothing int64 crosses).

WGSL has `bool` values but no `bool` in a storage buffer (TVM would write `array<i8>`, which WGSL lacks too), so a
boolean tensor main passes from one kernel to the next (the attention mask, a comparison) is stored as int32 0 / 1:
the op that makes it is followed by `astype(int32)`, and an op that reads truth values (where's condition,
logical_and / or / xor / not) gets `astype(bool)` in front; both are elementwise, so phase 5's fusion puts them
inside the producing and the reading kernels. Every other op (slices, reshapes, broadcasts, casts, comparisons)
moves or reads the 0 / 1 int32 as it is, so no bool buffer is left. A boolean parameter (a lifted weight) becomes
int32 the same way. `where(c, b, False)` on booleans is written `logical_and(c, b)` (and `where(c, True, b)` as
`logical_or`): a boolean constant would reach a kernel as a buffer.

WGSL cannot write an infinite constant (TVM's code generator prints `inff`, which the shader compiler refuses), and
TVM lowers `isfinite(x)` through a comparison with infinity: ONNX's float-to-integer Cast, as TVM's importer takes
it, is guarded by one. On such a target (`Limits.infinity` False) `isfinite(x)` becomes |x| <= the dtype's largest
finite value (false for ±inf and for NaN, which compares false), a constant that `targets/gpu.exact_constants` then
writes exactly.

WGSL's and Metal's `pow(x, y)` are undefined for x < 0 (lavapipe gives NaN), where torch's x ** 2 is x · x: the
RMS norms' squares came out NaN for every negative activation. On such a target (`Limits.pow_of_negative` False)
`power(x, c)` with c a constant whole number 1..4 becomes the product of c factors of x, and any other power takes
pow of |x| and puts the sign back for a whole exponent (the norms' exponent 2 is a lifted weight by then, not a
constant); a fractional exponent of a negative base stays NaN, as in torch.

What the pass cannot rewrite (an op that makes int64 by definition and is not listed above, a boolean constant
elsewhere) is left alone, and the target's limits check (targets/gpu.py: `check`) refuses the kernel that would hold
it, naming it.
"""

from __future__ import annotations

import numpy as np

from k3compile.interface import ExportError

WIDE, NARROW, BOOL = "int64", "int32", "bool"
REFUSED = "k3.refused"  # the module attribute a phase's refusal travels in (passes.run_phases raises it)
_LIMIT = 2**31 - 1


def needed(target) -> bool:
    """Whether `target` (a k3compile.targets.Target) lacks 64-bit integers, boolean buffers or a pow of negative
    numbers, and so takes this pass."""
    limits = target.limits
    return limits is not None and (WIDE in limits.no_dtypes or BOOL in limits.no_buffer_dtypes
                                   or not limits.pow_of_negative or not limits.infinity)


def narrows_int64(target) -> bool:
    """Whether the pass narrows `target`'s int64 to int32 (its graphs then take and give int32 ids)."""
    return target.limits is not None and WIDE in target.limits.no_dtypes


def _narrow_constant(c):
    """An int64 relax.Constant as int32; ExportError (naming the value) where one does not fit."""
    from tvm import relax

    value = np.asarray(c.value.numpy() if hasattr(c.value, "numpy") else c.value, np.int64)
    if value.size and (value.min() < -_LIMIT - 1 or value.max() > _LIMIT):
        worst = value.max() if value.max() > _LIMIT else value.min()
        raise ExportError(f"an int64 constant of the graph ({int(worst)}) does not fit in 32 bits, which the target "
                          "needs")
    return relax.const(value.astype(np.int32), NARROW)


def shape_tensor_te(values):
    """TE: the int32 tensor [len(values)] of a shape's integer expressions (shape_to_tensor, narrowed)."""
    from tvm import te, tirx

    def element(i):
        out = tirx.const(0, NARROW)
        for j in reversed(range(len(values))):
            out = tirx.Select(i == j, tirx.Cast(NARROW, values[j]), out)
        return out

    return te.compute((len(values),), element, name="k3_shape_to_tensor_i32")


def device_legalize(target):
    """The pass (a tvm.transform.ModulePass) for `target`: identity where the target needs none of it (`needed`)."""
    import tvm
    from tvm import relax
    from tvm.relax.expr_functor import PyExprMutator, mutator

    ops = {name: tvm.ir.Op.get(f"relax.{name}")
           for name in ("astype", "arange", "topk", "shape_to_tensor", "where", "power", "call_dps_packed",
                        "isfinite")}
    logical = [tvm.ir.Op.get(f"relax.logical_{name}") for name in ("and", "or", "xor", "not")]

    def is_bool(e) -> bool:
        return isinstance(e.ty, relax.TensorType) and str(e.ty.dtype) == BOOL

    def bool_constant(e):
        """The value of a scalar boolean constant, else None."""
        if isinstance(e, tvm.ir.expr.Constant) and is_bool(e) and len(e.ty.shape) == 0:
            v = e.value
            return bool(v.numpy() if hasattr(v, "numpy") else v)
        return None

    narrow = narrows_int64(target)
    bool_storage = target.limits is not None and BOOL in target.limits.no_buffer_dtypes
    products = target.limits is not None and not target.limits.pow_of_negative
    no_infinity = target.limits is not None and not target.limits.infinity

    def whole_exponent(e):
        """c of a scalar float constant 1..4 that is a whole number, else None."""
        if isinstance(e, tvm.ir.expr.Constant) and isinstance(e.ty, relax.TensorType) and len(e.ty.shape) == 0:
            v = e.value
            v = float(v.numpy() if hasattr(v, "numpy") else v)
            return int(v) if v in (1.0, 2.0, 3.0, 4.0) else None
        return None

    @mutator
    class Legalize(PyExprMutator):
        def __init__(self, mod, params):
            super().__init__(mod)
            self.params = params  # main's parameters stored as int32 (by handle): int64 or bool ones
            self.refusals: list[str] = []  # values that do not fit

        def visit_var_def_(self, var):
            if var.__chandle__() in self.params:  # an int64 or a boolean parameter: int32
                return relax.Var(var.name, relax.TensorType(var.ty.shape, NARROW))
            return var

        def _signed_power(self, x, y):
            """x ** y with pow taken of |x| only: for a whole y, the sign (-1)^y put back where x < 0; for another y
            pow(x, y) as it is (NaN for x < 0, as in torch). Elementwise: fused into one kernel with its reader."""
            op = relax.op
            emit = self.builder_.emit
            r = emit(op.power(op.abs(x), y))
            zero, two, half = (relax.const(v, str(x.ty.dtype)) for v in (0.0, 2.0, 0.5))
            whole = emit(op.equal(op.floor(y), y))
            odd = emit(op.not_equal(op.multiply(op.floor(op.multiply(y, half)), two), y))
            signed = emit(op.where(emit(op.logical_and(emit(op.less(x, zero)), odd)), op.negative(r), r))
            return op.where(whole, signed, op.power(x, y))

        def _stored(self, value):
            """A boolean result as it is stored: int32 0 / 1."""
            value = self.builder_.normalize(value)
            return relax.op.astype(self.builder_.emit(value), NARROW) if is_bool(value) else value

        def _read(self, arg, was_bool: bool):
            """An argument that held a boolean tensor (now stored as int32) read as bool again."""
            if was_bool and not is_bool(arg) and isinstance(arg.ty, relax.TensorType):
                return self.builder_.emit(relax.op.astype(arg, BOOL))
            return arg

        def _arg(self, a):
            if isinstance(a, tvm.ir.expr.Constant) and isinstance(a.ty, relax.TensorType) and str(a.ty.dtype) == WIDE:
                try:
                    return _narrow_constant(a)
                except ExportError as e:  # (raised here it would cross TVM's FFI as a RuntimeError)
                    self.refusals.append(str(e))
                    return relax.const(0, NARROW)  # a stand-in, so the walk goes on: the module is refused
            return a  # (a tuple's constants are attributes: strided_slice's axes and bounds stay int64)

        def visit_call_(self, call):
            if no_infinity and call.op.same_as(ops["isfinite"]):  # |x| <= the largest finite value: NaN compares false
                x = self.visit_expr(call.args[0])
                dtype = str(x.ty.dtype)
                out = relax.op.less_equal(self.builder_.emit(relax.op.abs(x)), relax.const(np.finfo(dtype).max, dtype))
                return self._stored(out) if bool_storage else out
            if products and call.op.same_as(ops["power"]) and whole_exponent(call.args[1]) is not None:
                x = self.visit_expr(call.args[0])
                out = x
                for _ in range(whole_exponent(call.args[1]) - 1):
                    out = relax.op.multiply(self.builder_.emit(out) if out is not x else x, x)
                return out
            if products and call.op.same_as(ops["power"]):
                return self._signed_power(self.visit_expr(call.args[0]), self.visit_expr(call.args[1]))
            if call.op.same_as(ops["where"]) and all(map(is_bool, call.args)):
                c, a, b = call.args  # where(c, a, False) = c and a; where(c, True, b) = c or b
                if bool_constant(b) is False:
                    call = relax.op.logical_and(c, a)
                elif bool_constant(a) is True:
                    call = relax.op.logical_or(c, b)
            if not bool_storage:
                return self._narrow(call)
            # the arguments visited here, not by visit_expr_post_order, which would infer the call's type with an
            # int32-stored boolean before it is read as bool again
            args = [self.visit_expr(a) for a in call.args]
            args = [self._arg(a) for a in args] if narrow else args
            reads = (0,) if call.op.same_as(ops["where"]) else range(len(args)) if any(
                call.op.same_as(op) for op in logical) else ()  # the arguments read as truth values
            args = [self._read(a, i in reads and is_bool(old)) for i, (a, old) in enumerate(zip(args, call.args))]
            call = self.builder_.normalize(relax.Call(call.op, args, call.attrs, call.ty_args))
            return self._stored(self._narrow(call, visited=True))

        def _narrow(self, call, visited: bool = False):
            call = call if visited else self.visit_expr_post_order(call)
            args = [self._arg(a) for a in call.args] if narrow else list(call.args)
            attrs = call.attrs
            dtype = str(getattr(attrs, "dtype", "")) if attrs is not None else ""
            if not narrow:
                return call
            if call.op.same_as(ops["astype"]) and dtype == WIDE:
                return relax.op.astype(args[0], NARROW)
            if call.op.same_as(ops["arange"]) and dtype == WIDE:
                return relax.op.arange(*args, dtype=NARROW)
            if call.op.same_as(ops["topk"]) and dtype == WIDE:
                extent = args[0].ty.shape[int(attrs.axis)]
                if isinstance(extent, tvm.tirx.IntImm) and int(extent) > _LIMIT:
                    self.refusals.append(f"top-k over {int(extent)} entries: its indices do not fit in 32 bits")
                    return call
                return relax.op.topk(args[0], int(attrs.k), int(attrs.axis), str(attrs.ret_type),
                                     bool(attrs.largest), NARROW)
            if call.op.same_as(ops["shape_to_tensor"]):
                values = getattr(args[0].ty, "values", None)
                if values is not None:
                    return self.builder_.call_te(shape_tensor_te, list(values),
                                                 primfunc_name_hint="k3_shape_to_tensor_i32")
            ty_args = call.ty_args
            if call.op.same_as(ops["call_dps_packed"]):  # a host function (a rank's collective: dtype-generic)
                ty_args = [narrow_type(t) for t in ty_args]  # returns what it is given: int32 in, int32 out
            if any(a is not b for a, b in zip(args, call.args)) or any(
                    not a.same_as(b) for a, b in zip(ty_args, call.ty_args)):
                return relax.Call(call.op, args, call.attrs, ty_args)
            return call

    def narrow_type(ty):
        if isinstance(ty, relax.TupleType):
            return relax.TupleType([narrow_type(f) for f in ty.fields])
        if isinstance(ty, relax.TensorType) and str(ty.dtype) == WIDE:
            return relax.TensorType(ty.shape, NARROW)
        return ty

    @tvm.transform.module_pass(opt_level=0, name="K3DeviceLegalize")
    def run(mod, ctx):
        if not needed(target):
            return mod
        m = None
        for gv, func in mod.functions_items():
            if not isinstance(func, relax.Function) or gv.name_hint != "main":
                continue
            wide = {p.__chandle__() for p in func.params if isinstance(p.ty, relax.TensorType)
                    and ((narrow and str(p.ty.dtype) == WIDE) or (bool_storage and str(p.ty.dtype) == BOOL))}
            m = Legalize(mod, wide)
            m.builder_.update_func(gv, m.visit_expr(func))
            if m.refusals:  # run_phases raises it
                return mod.with_attr(REFUSED, m.refusals[0])
        return relax.transform.DeadCodeElimination()(m.builder_.get()) if m is not None else mod

    return run
