"""Part of phase 5 (passes/legalize_fuse.py runs it first) on CPU targets: `power(x, e)` whose exponent is a scalar
weight holding 2 becomes `x * x` (docs/toolchain.md, "CPU schedules").

The RMS norms' squares reach the graph as ONNX `Pow(x, 2.0)`, the 2.0 an initializer, which the importer keeps as
a weight parameter; TVM lowers a power by a tensor to a libm `powf` call per element, which does not vectorize and
left `power` unfused: 1.2 s of a 2048-token k3-small prefill (12 %). The exponent's value is known when the module
is built: frontend.to_relax records every scalar float weight's value in the module attribute `frontend.SCALARS`,
and this pass reads it. x · x is powf(x, 2) exactly (both the correctly rounded square) and is what torch computes for
`x.pow(2)`. Every other power is left as it is; GPU targets have their own rewrite (passes/device_legalize.py).
"""

from __future__ import annotations


def exact_powers(target):
    """The pass (a tvm.transform.ModulePass) for `target` (a k3compile.targets.Target)."""
    import tvm
    from tvm import relax
    from tvm.relax.expr_functor import PyExprMutator, mutator

    from k3compile.frontend import SCALARS

    power = tvm.ir.Op.get("relax.power")

    @mutator
    class Square(PyExprMutator):
        def __init__(self, mod, twos):
            super().__init__(mod)
            self.twos = twos  # the parameters (Vars) of the function being visited that hold 2

        def visit_call_(self, call):
            call = self.visit_expr_post_order(call)
            if call.op.same_as(power) and any(call.args[1].same_as(p) for p in self.twos):
                x = call.args[0]
                return relax.op.multiply(x, x)
            return call

    @tvm.transform.module_pass(opt_level=0, name="K3ExactPowers")
    def run(mod, ctx):
        attrs = mod.attrs if mod.attrs is not None else {}
        if (target is not None and target.gpu) or SCALARS not in attrs:
            return mod
        twos = {str(name) for name, value in attrs[SCALARS].items() if float(value) == 2.0}
        m = None
        for gv, func in list(mod.functions_items()):
            if not isinstance(func, relax.Function) or func.attrs is None or "num_input" not in func.attrs:
                continue
            params = [p for p in func.params[int(func.attrs["num_input"]):] if p.name in twos]
            if params:
                m = m or Square(mod, [])
                m.twos = params
                m.builder_.update_func(gv, m.visit_expr(func))
        return mod if m is None else m.builder_.get()

    return run
