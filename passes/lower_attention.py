"""Part of phase 5 (passes/legalize_fuse.py runs it first): on CPU targets MLA's score contractions are legalized to
a TIR kernel of k3compile's instead of TVM's einsum (docs/architecture.md, "The compile path"; the kernel:
k3compile/kernels/attention.py).

An `einsum` of the form "bthc,bsc->bhts" (a four-dim query, b t h c, against a three-dim cache, b s c, summed over
the cache's last letter, out b h t s), fp32, with the heads static and the summed width static and a multiple of
16, becomes `call_tir` of `kernels/attention.scores_kernel` (one per distinct heads and width), opaque to fusion
(what followed it — the RoPE scores' add, the scale, the mask — is fused apart). A softmax over the last axis of a
four-dim fp32 tensor (the attention weights) becomes `kernels/attention.softmax_kernel`. Any other einsum or
softmax, and every one on a GPU target (dlight schedules them there), is left as it is.
"""

from __future__ import annotations

OPAQUE = 8  # TVM's OpPatternKind kOpaque: FuseOps leaves the call alone


def scores_form(subscripts: str) -> bool:
    """Whether einsum `subscripts` is the score contraction: "xyzw,xvw->xzyv", seven distinct roles (b t h c, s)."""
    try:
        inputs, out = subscripts.replace(" ", "").split("->")
        a, k = inputs.split(",")
    except ValueError:
        return False
    if len(a) != 4 or len(k) != 3 or len(set(a)) != 4 or len(set(k)) != 3:
        return False
    b, t, h, c = a
    s = k[1]
    return k[0] == b and k[2] == c and s not in a and out == b + h + t + s


def lower_attention(target):
    """The pass (a tvm.transform.ModulePass) for `target` (a k3compile.targets.Target)."""
    import tvm
    from tvm import relax
    from tvm.relax.expr_functor import PyExprMutator, mutator

    from k3compile.kernels.attention import LANES, scores_kernel, softmax_kernel

    einsum = tvm.ir.Op.get("relax.einsum")
    softmax = tvm.ir.Op.get("relax.nn.softmax")

    @mutator
    class Lower(PyExprMutator):
        def __init__(self, mod):
            super().__init__(mod)
            self.kernels: dict[object, object] = {}  # key -> the GlobalVar of its kernel

        def _kernel(self, key, make, name: str):
            if key not in self.kernels:
                self.kernels[key] = self.builder_.add_func(make().with_attr("op_pattern", OPAQUE), name)
            return self.kernels[key]

        def visit_call_(self, call):
            call = self.visit_expr_post_order(call)
            if call.op.same_as(softmax):
                x = call.args[0]
                if (str(x.ty.dtype) == "float32" and x.ty.ndim == 4 and int(call.attrs.axis) in (-1, 3)):
                    return relax.call_tir(self._kernel("softmax", softmax_kernel, "k3_attention_softmax"), [x],
                                          relax.TensorType(x.ty.shape, "float32"))
                return call
            if not (call.op.same_as(einsum) and scores_form(str(call.attrs.subscripts))):
                return call
            q, k = call.args[0].fields if isinstance(call.args[0], relax.Tuple) else (None, None)
            if q is None or any(str(x.ty.dtype) != "float32" for x in (q, k)):
                return call
            heads, width = q.ty.shape[2], q.ty.shape[3]
            if not all(isinstance(d, tvm.tirx.IntImm) for d in (heads, width)) or int(width) % LANES:
                return call
            key = (int(heads), int(width))
            gv = self._kernel(key, lambda: scores_kernel(*key), f"k3_attention_scores_{key[0]}_{key[1]}")
            out = relax.TensorType([q.ty.shape[0], heads, q.ty.shape[1], k.ty.shape[1]], "float32")
            return relax.call_tir(gv, [q, k], out)

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
