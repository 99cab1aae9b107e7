"""Phase 1: lower the extern calls of k3 ops to TIR kernels (docs/architecture.md, "The compile path").

The frontend leaves each k3 node as `R.call_dps_packed("k3.<op>", args, out_ty)`. For every symbol with a kernel
factory, this pass replaces the call with `R.call_tir` of a PrimFunc built for the call's static sizes (one
PrimFunc per distinct size set, added to the module once); calls without a kernel stay extern (served by the op's
reference implementation). A factory takes the call's argument types and returns a PrimFunc, or None when it cannot
specialize (a size that is not static), leaving that call alone.
"""

from __future__ import annotations

from collections.abc import Callable


def _static(dim) -> int | None:
    import tvm

    return int(dim) if isinstance(dim, tvm.tirx.IntImm) else None


def kda_factory(arg_types):
    """k3.kda_recurrence(q, k, v, g, beta, state): specialized to (H, K, V)."""
    from k3compile.kernels.kda import kda_recurrence_kernel

    q, v = arg_types[0].shape, arg_types[2].shape
    sizes = (_static(q[2]), _static(q[3]), _static(v[3]))
    if None in sizes:
        return None, None
    return sizes, lambda: kda_recurrence_kernel(*sizes)


KERNELS: dict[str, Callable] = {"k3.kda_recurrence": kda_factory}


def lower_k3_calls(kernels: dict[str, Callable] | None = None):
    """The pass (a tvm.transform.ModulePass)."""
    import tvm
    from tvm import relax
    from tvm.relax.expr_functor import PyExprMutator, mutator

    kernels = KERNELS if kernels is None else kernels
    call_dps = tvm.ir.Op.get("relax.call_dps_packed")

    @mutator
    class Lower(PyExprMutator):
        def __init__(self, mod):
            super().__init__(mod)
            self.added: dict = {}

        def visit_call_(self, call):
            call = self.visit_expr_post_order(call)
            if not (call.op.same_as(call_dps) and isinstance(call.args[0], relax.ExternFunc)):
                return call
            symbol = call.args[0].global_symbol
            if symbol not in kernels:
                return call
            args = call.args[1]
            key, make = kernels[symbol]([a.ty for a in args.fields])
            if key is None:
                return call
            if (symbol, key) not in self.added:
                name = symbol.replace(".", "_") + "_" + "_".join(map(str, key))
                self.added[(symbol, key)] = self.builder_.add_func(make().with_attr("global_symbol", name), name)
            out = list(call.ty.fields) if isinstance(call.ty, relax.TupleType) else call.ty
            return relax.call_tir(self.added[(symbol, key)], args, out_ty=out)

    @tvm.transform.module_pass(opt_level=0, name="LowerK3Calls")
    def lower(mod, ctx):
        m = Lower(mod)
        for gv, func in mod.functions_items():
            if isinstance(func, relax.Function):
                m.builder_.update_func(gv, m.visit_expr(func))
        return m.builder_.get()

    return lower
