"""Phase 2: dense weights in the target's panel layout (docs/toolchain.md, "CPU schedules").

A `matmul(x, W)` whose W is a weight (a parameter after the graph inputs, or a transpose / reshape of one) with a
static [K, N] shape, N a multiple of the target's panel width P, becomes a call of a `k3_packed_matmul` PrimFunc
over `W` re-laid as [N/P, K, P]: each panel of P output columns is one contiguous run of memory, so a thread
streams its panel instead of touching a new page every row (measured: the k3-small LM head 12 ms -> 6.5 ms at one
token, 1024x1024 0.11 -> 0.07 ms). The relayout is an expression of the weight only, which phase 3 moves to
compile time. A target with no panel width (P = 0) leaves every matmul as it is.
"""

from __future__ import annotations


def packed_matmul_te(x, wp, panel: int):
    """TE: y[..., n] = sum_k x[..., k] * wp[n // P, k, n % P]."""
    from tvm import te

    k_dim = wp.shape[1]
    n_dim = wp.shape[0] * panel
    k = te.reduce_axis((0, k_dim), "k")
    return te.compute((*x.shape[:-1], n_dim), lambda *i: te.sum(
        x[(*i[:-1], k)] * wp[i[-1] // panel, k, i[-1] % panel], axis=k), name="k3_packed_matmul")


def pack_dense_weights(target):
    """The pass (a tvm.transform.ModulePass) for `target` (a k3compile.targets.Target)."""
    import tvm
    from tvm import relax
    from tvm.relax.expr_functor import PyExprMutator, mutator

    panel = target.dense_panel
    matmul = tvm.ir.Op.get("relax.matmul")
    relayout = {tvm.ir.Op.get(n) for n in ("relax.permute_dims", "relax.reshape")}

    @mutator
    class Pack(PyExprMutator):
        def __init__(self, mod, weights):
            super().__init__(mod)
            self.weights = weights

        def _is_weight(self, expr) -> bool:
            if isinstance(expr, relax.Var) and expr in self.weights:
                return True
            bound = self.lookup_binding(expr) if isinstance(expr, relax.Var) else None
            return (isinstance(bound, relax.Call) and any(bound.op.same_as(op) for op in relayout)
                    and self._is_weight(bound.args[0]))

        def visit_call_(self, call):
            call = self.visit_expr_post_order(call)
            if not (panel and call.op.same_as(matmul) and len(call.args) == 2):
                return call
            x, w = call.args
            shape = getattr(w.ty, "shape", None)
            if (shape is None or len(shape) != 2 or not all(isinstance(d, tvm.tirx.IntImm) for d in shape)
                    or int(shape[1]) % panel or x.ty.dtype != "float32" or w.ty.dtype != "float32"
                    or not self._is_weight(w)):
                return call
            k_dim, n_dim = int(shape[0]), int(shape[1])
            wp = self.builder_.emit(relax.op.permute_dims(
                relax.op.reshape(w, [k_dim, n_dim // panel, panel]), [1, 0, 2]))
            return self.builder_.call_te(packed_matmul_te, x, wp, panel, primfunc_name_hint="k3_packed_matmul")

    @tvm.transform.module_pass(opt_level=0, name="K3PackDenseWeights")
    def run(mod, ctx):
        funcs = [(gv, f) for gv, f in mod.functions_items() if isinstance(f, relax.Function)]
        m = None
        for gv, func in funcs:
            if func.attrs is None or "num_input" not in func.attrs:
                continue
            m = m or Pack(mod, set())
            m.weights = set(func.params[int(func.attrs["num_input"]):])
            m.builder_.update_func(gv, m.visit_expr(func))
        return m.builder_.get() if m is not None else mod

    return run
