"""Part of phase 5 (passes/legalize_fuse.py runs it after passes/inplace_caches.py): on CPU targets MLA's attention
contractions are legalized to TIR kernels of k3compile's instead of TVM's einsum (docs/architecture.md, "The compile
path"; the kernels: k3compile/kernels/attention.py).

An `einsum` of the form "bthc,bsc->bhts" (a four-dim query, b t h c, against a three-dim cache, b s c, summed over
the cache's last letter, out b h t s) becomes `call_tir` of `kernels/attention.scores_kernel`, and one of the form
"bhts,bsc->bthc" (the weights against the cache, summed over s) of `kernels/attention.pv_kernel`: fp32, with the
heads and the width static (one kernel per distinct pair), the cache length passed as the kernels' scalar, opaque
to fusion (what followed the scores — the RoPE scores' add, the scale, the mask — is fused apart). A softmax over
the last axis of a four-dim fp32 tensor (the attention weights) becomes `kernels/attention.softmax_kernel`. Any
other einsum or softmax, and every one on a GPU target (dlight schedules them there), is left as it is.
"""

from __future__ import annotations

OPAQUE = 8  # TVM's OpPatternKind kOpaque: FuseOps leaves the call alone


def _operands(subscripts: str) -> tuple[str, str, str] | None:
    """(the four-dim operand's letters, the three-dim one's, the output's) of einsum `subscripts` when both operands
    have distinct letters, else None."""
    try:
        inputs, out = subscripts.replace(" ", "").split("->")
        a, k = inputs.split(",")
    except ValueError:
        return None
    if len(a) != 4 or len(k) != 3 or len(set(a)) != 4 or len(set(k)) != 3:
        return None
    return a, k, out


def scores_form(subscripts: str) -> bool:
    """Whether einsum `subscripts` is the score contraction: "xyzw,xvw->xzyv", seven distinct roles (b t h c, s)."""
    parts = _operands(subscripts)
    if parts is None:
        return False
    (b, t, h, c), k, out = parts
    s = k[1]
    return k[0] == b and k[2] == c and s not in (b, t, h, c) and out == b + h + t + s


def pv_form(subscripts: str) -> bool:
    """Whether einsum `subscripts` is the weighted sum over the cache: "xyzw,xwv->xzyv" (b h t s, b s c -> b t h c)."""
    parts = _operands(subscripts)
    if parts is None:
        return False
    (b, h, t, s), k, out = parts
    c = k[2]
    return k[0] == b and k[1] == s and c not in (b, h, t, s) and out == b + t + h + c


def attention_call(kernel_for, subscripts: str, q, k, length):
    """`call_tir` of the kernel for einsum `subscripts` ((scores_form or pv_form) of q (or the weights) and the cache
    k, fp32, heads and width static), reading `length` rows of k; None when the einsum is no such form.
    `kernel_for(kind, heads, width)` gives the kernel's GlobalVar."""
    import tvm
    from tvm import relax

    scores = scores_form(subscripts)
    if not (scores or pv_form(subscripts)) or any(str(x.ty.dtype) != "float32" for x in (q, k)):
        return None
    heads = q.ty.shape[2] if scores else q.ty.shape[1]
    width = k.ty.shape[2]
    if not all(isinstance(d, tvm.tirx.IntImm) for d in (heads, width)):
        return None
    gv = kernel_for("scores" if scores else "pv", int(heads), int(width))
    b, x = q.ty.shape[0], q.ty.shape[1] if scores else q.ty.shape[2]
    shape = [b, heads, x, length] if scores else [b, x, heads, width]
    return relax.call_tir(gv, [q, k, relax.prim_value(length)], relax.TensorType(shape, "float32"))


def opaque_kernels(builder):
    """`add(key, make, name)`: the GlobalVar of kernel `make()` in `builder`, added once per key, opaque to fusion."""
    kernels: dict = {}

    def add(key, make, name: str):
        if key not in kernels:
            kernels[key] = builder.add_func(make().with_attr("op_pattern", OPAQUE), name)
        return kernels[key]

    return add


def attention_kernels(add):
    """`kernel_for(kind, heads, width)` of `attention_call`, each kernel added through `add` (opaque_kernels)."""
    from k3compile.kernels.attention import pv_kernel, scores_kernel

    def kernel_for(kind: str, heads: int, width: int):
        make = scores_kernel if kind == "scores" else pv_kernel
        return add((kind, heads, width), lambda: make(heads, width), f"k3_attention_{kind}_{heads}_{width}")

    return kernel_for


def lower_attention(target):
    """The pass (a tvm.transform.ModulePass) for `target` (a k3compile.targets.Target)."""
    import tvm
    from tvm import relax
    from tvm.relax.expr_functor import PyExprMutator, mutator

    from k3compile.kernels.attention import softmax_kernel

    einsum = tvm.ir.Op.get("relax.einsum")
    softmax = tvm.ir.Op.get("relax.nn.softmax")

    @mutator
    class Lower(PyExprMutator):
        def __init__(self, mod):
            super().__init__(mod)
            self.add = opaque_kernels(self.builder_)
            self.kernel_for = attention_kernels(self.add)

        def visit_call_(self, call):
            call = self.visit_expr_post_order(call)
            if call.op.same_as(softmax):
                x = call.args[0]
                if (str(x.ty.dtype) == "float32" and x.ty.ndim == 4 and int(call.attrs.axis) in (-1, 3)):
                    return relax.call_tir(self.add("softmax", softmax_kernel, "k3_attention_softmax"), [x],
                                          relax.TensorType(x.ty.shape, "float32"))
                return call
            if not call.op.same_as(einsum) or not isinstance(call.args[0], relax.Tuple):
                return call
            q, k = call.args[0].fields
            subscripts = str(call.attrs.subscripts)
            length = k.ty.shape[1]  # the functional graph's cache: every row is read
            lowered = attention_call(self.kernel_for, subscripts, q, k, length)
            return call if lowered is None else lowered

    @tvm.transform.module_pass(opt_level=0, name="K3LowerAttention")
    def run(mod, ctx):
        if target is not None and target.gpu:
            return mod
        m = Lower(mod)
        for gv, func in list(mod.functions_items()):
            if isinstance(func, relax.Function):
                m.builder_.update_func(gv, m.visit_expr(func))
        return m.builder_.get()

    return run
