"""Part of phase 5 (passes/legalize_fuse.py runs it before lower_attention): on CPU targets the module gets a second
entry point, `main_inplace`, that keeps MLA's decode caches in preallocated buffers instead of concatenating them
into a new `present` every step (docs/architecture.md, "In-place decode caches").

`main` takes each MLA cache as `past.{i}.latent [B, P, C]` and returns `present` = concat(past, new rows) [B, P+T,
C]: every decode step copies the whole cache, and its attention reads the copy. `main_inplace` takes the same
inputs except that each such cache is a buffer `[B, capacity, C]` whose first P rows hold the past, and one more
input, `past_length` (a shape: P, which its buffers cannot say). Each concat becomes `call_tir_inplace` of
kernels/attention.write_rows_kernel (the T new rows written at [P, P + T) of the buffer, which is that call's
result), and the attention contractions that read the concatenation read the buffer's first P + T rows
(kernels/attention scores and pv kernels, the length as their scalar). The buffer is returned where `present` was.
The weights and everything else are `main`'s.

`main_inplace_last` is `main_inplace` with logits for each row's last position only, `[B, 1, V]`: the LM head (the
result's logits are one row-wise call of its final hidden states) is applied to the last position's hidden state
alone. That is all generation reads, and a prefill of T tokens skips T − 1 rows of the largest matmul (k3-small:
32768 × 1024 per row). It is made only when the logits have that form.

A cache is taken only when its graph is the one K3's MLA exports: a graph input used once, as the first operand of a
concat along axis 1 whose result feeds only score and weighted-sum einsums (passes/lower_attention.py's forms)
and the function's result. Anything else (another op reading the cache, a model without MLA) leaves the module
without `main_inplace`, and the runtime runs `main` (backends/tvm.py).
"""

from __future__ import annotations

from k3compile.library import INPLACE_FUNC, LAST_FUNC  # the runtimes' names for them, owned by the reader

__all__ = ["INPLACE_FUNC", "LAST_FUNC", "PAST_LENGTH", "inplace_caches"]

PAST_LENGTH = "past_length"


def _num_input(func) -> int:
    """The graph inputs of a Relax function: its params before the weights (all of them without `num_input`)."""
    attrs = func.attrs
    return int(attrs["num_input"]) if attrs is not None and "num_input" in attrs else len(func.params)


def _cache_inputs(main) -> dict | None:
    """{param: (its concat's bound var)} for the MLA caches of `main`, when every one has the exported form; {} when
    there is none; None when one is used otherwise (no main_inplace then)."""
    import tvm
    from k3compile.passes.lower_attention import pv_form, scores_form
    from tvm import relax

    concat = tvm.ir.Op.get("relax.concat")
    einsum = tvm.ir.Op.get("relax.einsum")
    inputs = list(main.params[: _num_input(main)])
    uses: dict = {}  # var -> [(the var bound, its value) of each binding using it]
    bound: dict = {}  # var -> its value
    for block in main.body.blocks:
        for binding in block.bindings:
            if not isinstance(binding, relax.VarBinding):
                return None
            bound[binding.var] = binding.value
            for v in relax.analysis.free_vars(binding.value):
                uses.setdefault(v, []).append((binding.var, binding.value))
    result = main.body.body
    result_tuple = bound.get(result) if isinstance(result, relax.Var) else result

    caches = {}
    for p in inputs:
        users = uses.get(p, [])
        if len(users) != 1:
            continue
        var, call = users[0]
        if not (isinstance(call, relax.Call) and call.op.same_as(concat) and int(call.attrs.axis) == 1
                and isinstance(call.args[0], relax.Tuple) and len(call.args[0].fields) == 2
                and call.args[0].fields[0].same_as(p) and p.ty.ndim == 3 and str(p.ty.dtype) == "float32"
                and isinstance(p.ty.shape[1], tvm.tirx.Var)):
            continue
        for _, use in uses.get(var, []):
            if use.same_as(result_tuple):
                continue
            ok = (isinstance(use, relax.Call) and use.op.same_as(einsum) and isinstance(use.args[0], relax.Tuple)
                  and len(use.args[0].fields) == 2 and use.args[0].fields[1].same_as(var)
                  and not use.args[0].fields[0].same_as(var)
                  and (scores_form(str(use.attrs.subscripts)) or pv_form(str(use.attrs.subscripts))))
            if not ok:
                return None
        caches[p] = var
    return caches


def with_inplace_function(mod):
    """`mod` with `main_inplace` of its `main` (and the kernels it calls) added; `mod` itself when `main` has no MLA
    cache of the exported form."""
    import tvm
    from k3compile.passes.lower_attention import attention_call, attention_kernels, opaque_kernels
    from tvm import relax
    from tvm.relax.expr_functor import PyExprMutator, mutator
    from tvm.relax.utils import copy_with_new_vars

    from k3compile.kernels.attention import write_rows_kernel

    main = mod["main"]
    caches = _cache_inputs(main)
    if not caches:
        return mod
    past = next(iter(caches)).ty.shape[1]  # the past-length variable every cache shares
    if any(not p.ty.shape[1].same_as(past) for p in caches):
        return mod
    capacity = tvm.tirx.Var("capacity", "int64")
    buffers = {p: relax.Var(p.name, relax.TensorType([p.ty.shape[0], capacity, p.ty.shape[2]], "float32"))
               for p in caches}
    past_length = relax.Var(PAST_LENGTH, relax.ShapeType([past]))
    concat = tvm.ir.Op.get("relax.concat")
    einsum = tvm.ir.Op.get("relax.einsum")

    @mutator
    class InPlace(PyExprMutator):
        def __init__(self, mod):
            super().__init__(mod)
            self.add = opaque_kernels(self.builder_)
            self.kernel_for = attention_kernels(self.add)

        def visit_call_(self, call):
            if call.op.same_as(concat) and isinstance(call.args[0], relax.Tuple) and call.args[0].fields[0] in caches:
                p, new = call.args[0].fields
                buf = buffers[p]
                width = int(p.ty.shape[2])
                write = self.add(("write", width), lambda: write_rows_kernel(width), f"k3_cache_write_rows_{width}")
                return relax.call_tir_inplace(write, [buf, self.visit_expr(new), relax.prim_value(past)], [0], buf.ty)
            new_call = self.visit_expr_post_order(call)
            if new_call.op.same_as(einsum) and isinstance(new_call.args[0], relax.Tuple):
                q, k = new_call.args[0].fields
                if k.ty.ndim == 3 and k.ty.shape[1].same_as(capacity):
                    length = call.args[0].fields[1].ty.shape[1]  # the concatenation's length: P + T
                    lowered = attention_call(self.kernel_for, str(call.attrs.subscripts), q, k, length)
                    if lowered is None:  # _cache_inputs admitted only the kernels' forms
                        raise ValueError(f"an einsum of the cache ({call.attrs.subscripts}) has no kernel")
                    return lowered
            return new_call

    m = InPlace(mod)
    body = m.visit_expr(main.body)
    n = _num_input(main)
    params = [buffers.get(p, p) for p in main.params[:n]] + [past_length] + list(main.params[n:])
    attrs = dict(main.attrs.items()) if main.attrs is not None else {}
    attrs.update(num_input=n + 1, global_symbol=INPLACE_FUNC)
    # a function of its own: fresh variables everywhere (FuseOps, among others, wants each defined once per module)
    func = copy_with_new_vars(relax.Function(params, body, is_pure=main.is_pure).with_attrs(attrs))
    m.builder_.add_func(func, INPLACE_FUNC)
    last = _last_position_logits(func, m.builder_.get())
    if last is not None:
        m.builder_.add_func(last, LAST_FUNC)
    return m.builder_.get()


def _last_position_logits(func, mod):
    """`func` (main_inplace, of module `mod`) with its logits computed for the last position only, or None when
    its logits are not one call of a row-wise matmul (a packed matmul of phase 2, or Relax's matmul) of a
    [B, T, D] tensor."""
    import tvm
    from tvm import relax
    from tvm.relax.expr_functor import PyExprMutator, mutator
    from tvm.relax.utils import copy_with_new_vars

    bound = {b.var: b.value for block in func.body.blocks for b in block.bindings}
    result = func.body.body
    fields = bound.get(result) if isinstance(result, relax.Var) else result
    if not isinstance(fields, relax.Tuple) or not fields.fields:
        return None
    head = bound.get(fields.fields[0])
    call_tir, matmul = tvm.ir.Op.get("relax.call_tir"), tvm.ir.Op.get("relax.matmul")
    if not isinstance(head, relax.Call):
        return None
    if head.op.same_as(call_tir):
        callee, args = head.args[0], head.args[1].fields
        if not callee.name_hint.startswith("k3_packed_matmul") or len(args) != 2:
            return None
    elif not head.op.same_as(matmul):
        return None
    x = head.args[1].fields[0] if head.op.same_as(call_tir) else head.args[0]
    out = head.ty
    if x.ty.ndim != 3 or len(out.shape) != 3 or not x.ty.shape[1].same_as(out.shape[1]):
        return None
    seq = x.ty.shape[1]

    @mutator
    class Last(PyExprMutator):
        def visit_call_(self, call):
            if not call.same_as(head):
                return self.visit_expr_post_order(call)
            rows = self.visit_expr(x)
            last = self.builder_.emit(
                relax.op.strided_slice(rows, axes=[1], begin=[seq - 1], end=[seq], assume_inbound=True))
            if head.op.same_as(call_tir):
                shape = [out.shape[0], 1, out.shape[2]]
                return relax.call_tir(callee, [last, self.visit_expr(head.args[1].fields[1])],
                                      relax.TensorType(shape, out.dtype))
            return relax.op.matmul(last, self.visit_expr(head.args[1]))

    body = Last(mod).visit_expr(func.body)
    new = relax.Function(list(func.params), body, is_pure=func.is_pure).with_attrs(
        {**dict(func.attrs.items()), "global_symbol": LAST_FUNC})
    return copy_with_new_vars(new)


def inplace_caches(target):
    """The pass (a tvm.transform.ModulePass) for `target` (a k3compile.targets.Target): adds `main_inplace` (and
    `main_inplace_last`) on CPU targets."""
    import tvm

    @tvm.transform.module_pass(opt_level=0, name="K3InplaceCaches")
    def run(mod, ctx):
        if (target is not None and target.gpu) or "main" not in [gv.name_hint for gv in mod.get_global_vars()]:
            return mod
        return with_inplace_function(mod)

    return run
