"""A GPU build written down as data: the launch plan every GPU artifact carries (docs/architecture.md, "GPU
artifacts and their executors").

TVM generates the device kernels, but this TVM wheel has no runtime that can launch them, so k3compile's executors
(k3compile/executors/) do, from this plan alone: no TVM, no ONNX import and no re-lowering at load. `launch_plan(mod,
target)` reads the compiled module (after the phases: `main` is a sequence of call_tir bindings) and its lowering
(targets/gpu.py: `lower`) and returns a JSON document:

- `main`: its parameters (graph inputs, then weights: dtype and shape, each dimension a number or a shape variable
  such as `batch`), its bindings in order (`call`: a PrimFunc, the values it takes, its scalar arguments and the
  shapes of what it returns; `extern`: a host function by its symbol, which only the collectives are
  (ops/collectives.py: the executor downloads its tensor arguments, the function fills its results in host memory,
  which are uploaded); `item`: an element of a tuple; `const`: one of the module's constants, saved beside the
  plan) and what it returns;
- `funcs`: per PrimFunc, its parameters (buffers with their shapes in the PrimFunc's own variables, scalars), the
  host's let-bindings, the workspace it allocates, and per device kernel its name, parameters, the PrimFunc
  parameter (or workspace) each buffer argument is, its scalar arguments and its grid / workgroup extents;
- `kernels`: each kernel's device source (OpenCL C, WGSL, ...) by name.
Every size is an expression (`expr`: numbers, variable names, and nested lists [op, ...]), evaluated by the
executor when the shapes are known (executors/plan.py: `evaluate`).
"""

from __future__ import annotations

import numpy as np

from k3compile.interface import ExportError

PLAN_VERSION = 1

_BINARY = {"Add": "+", "Sub": "-", "Mul": "*", "FloorDiv": "//", "FloorMod": "%", "Div": "/", "Mod": "rem",
           "Min": "min", "Max": "max", "LT": "<", "LE": "<=", "GT": ">", "GE": ">=", "EQ": "==", "NE": "!=",
           "And": "and", "Or": "or"}


def expr(e):
    """A TIR integer expression as plan data (see the module docstring); raises ExportError on anything else."""
    from tvm import tirx

    if isinstance(e, int):
        return e
    if isinstance(e, tirx.IntImm):
        return int(e.value)
    if isinstance(e, tirx.Var):
        return e.name
    kind = type(e).__name__
    if kind in _BINARY:
        return [_BINARY[kind], expr(e.a), expr(e.b)]
    if kind == "Not":
        return ["not", expr(e.a)]
    if kind == "Cast":
        return expr(e.value)  # an index narrowed or widened: the same integer
    if kind == "Select":
        return ["select", expr(e.condition), expr(e.true_value), expr(e.false_value)]
    raise ExportError(f"the launch plan cannot write the size expression {e} ({kind})")


def launch_plan(mod, target, lowered: dict | None = None) -> tuple[dict, dict[str, np.ndarray]]:
    """(plan, constants) of a GPU module after the phases (see the module docstring)."""
    import tvm
    from k3compile.passes.lower_k3_calls import extern_by_design
    from k3compile.targets.gpu import is_buffer, kernel_source, lower
    from tvm import relax

    lowered = lower(mod, target) if lowered is None else lowered
    main = mod["main"]
    ids: dict[int, str] = {}  # a Relax var (by object) -> its value's name in the plan
    constants: dict[str, np.ndarray] = {}
    call_tir = tvm.ir.Op.get("relax.call_tir")
    call_dps = tvm.ir.Op.get("relax.call_dps_packed")

    def spec(ty) -> dict:
        return {"dtype": str(ty.dtype), "shape": [expr(d) for d in ty.shape]}

    def results(ty) -> list[dict]:  # what a call returns: one tensor, or a tuple's fields
        return [spec(t) for t in ty.fields] if isinstance(ty, relax.TupleType) else [spec(ty)]

    def ref(e):
        """A value main passes: a variable, a constant (saved), a tuple of them, or an integer (a shape value)."""
        if isinstance(e, relax.Var) and e.__chandle__() in ids:
            return ids[e.__chandle__()]
        if str(e.ty).startswith(("int", "uint")):  # a shape variable or expression, or an integer attribute (a
            # collective's tag), passed as a scalar
            return {"int": expr(e)}
        if isinstance(e, relax.Tuple):
            return {"tuple": [ref(f) for f in e.fields]}
        if hasattr(e, "value") and hasattr(e.value, "numpy"):
            name = f"const{len(constants)}"
            constants[name] = e.value.numpy()
            return {"const": name}
        if isinstance(e, relax.Var):
            raise ExportError(f"main: {e} is used before it is bound")
        raise ExportError(f"main: the launch plan cannot pass {type(e).__name__} {e}")

    params = []
    for i, p in enumerate(main.params):
        ids[p.__chandle__()] = f"p{i}"
        params.append({"name": p.name, **spec(p.ty)})
    bindings, used = [], set()
    for block in main.body.blocks:
        for b in block.bindings:
            name = f"v{len(bindings)}"
            value = b.value
            out_ty = b.var.ty
            is_tuple = isinstance(out_ty, relax.TupleType)
            if isinstance(value, relax.Call) and value.op.same_as(call_tir):
                func = value.args[0].name_hint
                used.add(func)
                scalars = [expr(v) for v in value.args[2].values] if len(value.args) > 2 else []
                bindings.append({"op": "call", "out": name, "func": func, "scalars": scalars,
                                 "results": results(out_ty), "args": [ref(a) for a in value.args[1].fields],
                                 "tuple": is_tuple})
            elif (isinstance(value, relax.Call) and value.op.same_as(call_dps)
                  and isinstance(value.args[0], relax.ExternFunc)):
                symbol = str(value.args[0].global_symbol)
                if symbol not in extern_by_design():
                    raise ExportError(f"main calls the host function {symbol}, which no executor provides")
                bindings.append({"op": "extern", "out": name, "symbol": symbol, "results": results(out_ty),
                                 "args": [ref(a) for a in value.args[1].fields], "tuple": is_tuple})
            elif isinstance(value, relax.TupleGetItem):
                bindings.append({"op": "item", "out": name, "of": ref(value.tuple_value), "index": int(value.index)})
            else:
                bindings.append({"op": "value", "out": name, "value": ref(value)})
            ids[b.var.__chandle__()] = name
    funcs, kernels = {}, {}
    for name in sorted(used):
        if name not in lowered:
            raise ExportError(f"main calls {name}, which has no device lowering")
        low, prim = lowered[name], mod[name]
        fparams = []
        for p in prim.params:
            if is_buffer(p):
                fparams.append({"buffer": True, "dtype": str(p.dtype), "shape": [expr(d) for d in p.shape],
                                "offset": expr(p.elem_offset)})
            else:
                fparams.append({"buffer": False, "name": p.name, "dtype": str(p.ty)})
        launches = []
        for kernel, args, bufs in zip(low.kernels, low.calls, low.buffers):
            n_buf = sum(q.buffer for q in kernel.params)
            tags = [str(t) for t in kernel.func.attrs["tirx.kernel_launch_params"]]
            launches.append({
                "kernel": kernel.name,
                "params": [{"name": q.name, "dtype": q.dtype, "buffer": q.buffer} for q in kernel.params],
                "buffers": list(bufs), "scalars": [expr(a) for a in args[n_buf:len(kernel.params)]],
                "extents": {tag: expr(a) for tag, a in zip(tags, args[len(kernel.params):])},
            })
            if kernel.name not in kernels:
                kernels[kernel.name] = kernel_source(kernel, target.tvm())
        funcs[name] = {
            "params": fparams,
            "binds": _binds(low.binds),
            "workspace": [{"name": w, "dtype": d, "shape": [expr(x) for x in shape]} for w, d, shape in low.workspace],
            "launches": launches,
        }
    plan = {"version": PLAN_VERSION, "target": target.name, "language": target.limits.language,
            "main": {"params": params, "num_input": int(main.attrs["num_input"]), "bindings": bindings,
                     "result": ref(main.body.body)},
            "funcs": funcs, "kernels": kernels}
    return plan, constants


def _binds(binds) -> list:
    """The host's integer let-bindings that are sizes (an expression the plan can write); others (pointer
    arithmetic, calls) are no launch argument's and are left out."""
    out = []
    for v, value in binds:
        if str(v.ty).startswith(("int", "uint")):
            try:
                out.append([v.name, expr(value)])
            except ExportError:
                continue
    return out
