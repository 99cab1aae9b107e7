"""Phase 2: dense weights in the target's panel layout (docs/toolchain.md, "CPU schedules").

A `matmul(x, W)` whose W is a weight (a parameter after the graph inputs, or a transpose / reshape of one) with a
static [K, N] shape, N a multiple of the target's panel width P, becomes a call of a `k3_packed_matmul` PrimFunc
over `W` re-laid as [N/P, K, P]: each panel of P output columns is one contiguous run of memory, so a thread
streams its panel instead of touching a new page every row (measured: the k3-small LM head 12 ms -> 6.5 ms at one
token, 1024x1024 0.11 -> 0.07 ms). The relayout is an expression of the weight only, which phase 3 moves to
compile time. A target with no panel width (P = 0) leaves every matmul as it is.

With the target's dense format bf16 (docs/architecture.md, "Dense weights") the panels hold each value's upper 16
bits (uint16: numpy has no bf16), also made at compile time, and the kernel widens them as it reads them (a 16-bit
shift into an fp32 register): half the bytes a decode step streams, the same fp32 arithmetic. The bits are cut, not
rounded: compile.py narrows only weights that hold bf16 values (a bf16 checkpoint, a preset), where cutting is
exact, and refuses the others.
"""

from __future__ import annotations

OUT_ELEMWISE_FUSABLE = 4  # TVM's OpPatternKind kOutEWiseFusable: a matmul, which elementwise epilogues join
PACKED = "k3.dense_packed"  # module attr: the names of the weights phase 2 re-laid (compile.py checks them)


def widen(value):
    """A stored dense value as fp32: a bf16 pattern (uint16) shifted into the upper half of an fp32 word."""
    from tvm import tirx

    if value.dtype == "float32":
        return value
    return tirx.reinterpret("float32", value.astype("uint32") << tirx.const(16, "uint32"))


def bf16_bits_te(w):
    """TE: the upper 16 bits of each fp32 value (its bf16 pattern when it holds a bf16 value)."""
    from tvm import te, tirx

    return te.compute(w.shape, lambda *i: (tirx.reinterpret("uint32", w[i]) >> tirx.const(16, "uint32")).astype(
        "uint16"), name="k3_bf16_bits")


def packed_matmul_te(x, wp, panel: int):
    """TE: y[..., n] = sum_k x[..., k] * wp[n // P, k, n % P] (wp fp32, or bf16 bits widened as read)."""
    from tvm import te

    k_dim = wp.shape[1]
    n_dim = wp.shape[0] * panel
    k = te.reduce_axis((0, k_dim), "k")
    return te.compute((*x.shape[:-1], n_dim), lambda *i: te.sum(
        x[(*i[:-1], k)] * widen(wp[i[-1] // panel, k, i[-1] % panel]), axis=k), name="k3_packed_matmul")


def pack_dense_weights(target):
    """The pass (a tvm.transform.ModulePass) for `target` (a k3compile.targets.Target)."""
    import tvm
    from tvm import relax
    from tvm.relax.expr_functor import PyExprMutator, mutator

    from k3compile.modes import DenseFormat

    panel = target.dense_panel
    bf16 = target.dense_format == DenseFormat.BF16
    matmul = tvm.ir.Op.get("relax.matmul")
    relayout = {tvm.ir.Op.get(n) for n in ("relax.permute_dims", "relax.reshape")}

    @mutator
    class Pack(PyExprMutator):
        def __init__(self, mod, weights):
            super().__init__(mod)
            self.weights = weights
            self.packed: list[str] = []

        def _weight(self, expr):
            """The weight parameter `expr` is (or a transpose / reshape of), else None."""
            if isinstance(expr, relax.Var) and expr in self.weights:
                return expr
            bound = self.lookup_binding(expr) if isinstance(expr, relax.Var) else None
            if isinstance(bound, relax.Call) and any(bound.op.same_as(op) for op in relayout):
                return self._weight(bound.args[0])
            return None

        def visit_call_(self, call):
            call = self.visit_expr_post_order(call)
            if not (panel and call.op.same_as(matmul) and len(call.args) == 2):
                return call
            x, w = call.args
            shape = getattr(w.ty, "shape", None)
            if (shape is None or len(shape) != 2 or not all(isinstance(d, tvm.tirx.IntImm) for d in shape)
                    or int(shape[1]) % panel or x.ty.dtype != "float32" or w.ty.dtype != "float32"
                    or self._weight(w) is None):
                return call
            self.packed.append(self._weight(w).name)
            k_dim, n_dim = int(shape[0]), int(shape[1])
            wp = self.builder_.emit(relax.op.permute_dims(
                relax.op.reshape(w, [k_dim, n_dim // panel, panel]), [1, 0, 2]))
            if bf16:
                wp = self.builder_.emit_te(bf16_bits_te, wp, primfunc_name_hint="k3_bf16_bits")
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
        if m is None:
            return mod
        mod = m.builder_.get()
        for gv, func in list(mod.functions_items()):
            # Fused as a matmul (its elementwise consumers join it, its producers do not): TVM's pattern analysis
            # calls the bf16 form (a reinterpret in the product) a plain reduction, and FuseOps then inlined the SiTU
            # chain in front of it, recomputed for every 64-column strip (k3-small prefill 137 -> 92 tok/s). Set
            # once the calls are built, so that equal kernels stay one function.
            if isinstance(func, tvm.tirx.PrimFunc) and gv.name_hint.startswith("k3_packed_matmul"):
                mod[gv] = func.with_attr("op_pattern", OUT_ELEMWISE_FUSABLE)
        return mod.with_attr(PACKED, sorted(set(m.packed)))

    return run
