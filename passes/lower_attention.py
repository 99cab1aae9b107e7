"""Part of phase 5 (passes/legalize_fuse.py runs it after passes/inplace_caches.py): on CPU targets MLA's attention
contractions are legalized to TIR kernels of k3compile's instead of TVM's einsum (docs/architecture.md, "The compile
path"; the kernels: k3compile/kernels/attention.py).

An `einsum` of the form "bthc,bsc->bhts" (a four-dim query, b t h c, against a three-dim cache, b s c, summed over
the cache's last letter, out b h t s) becomes `call_tir` of `kernels/attention.scores_kernel`, and one of the form
"bhts,bsc->bthc" (the weights against the cache, summed over s) of `kernels/attention.pv_kernel`: fp32, with the
heads and the width static (one kernel per distinct pair), the cache length passed as the kernels' scalar, opaque
to fusion (what followed the scores — the RoPE scores' add, the scale, the mask — is fused apart). A softmax over
the last axis of a four-dim fp32 tensor (the attention weights) becomes `kernels/attention.softmax_kernel`. Any
other einsum or softmax, and every one on a GPU target (dlight schedules them there), is left as it is. Last,
`fuse_masked_scores` takes MLA's whole pre-softmax chain (two score kernels, add, scale, mask) into
`kernels/attention.masked_scores_kernel`.
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
        return fuse_masked_scores(m.builder_.get())

    return run


def fuse_masked_scores(mod):
    """`mod` with every `where(masked, fill, multiply(add(s1, s2), scale))` whose s1 and s2 are calls of the score
    kernel (`k3_attention_scores_*`, any function of the module: main's and main_inplace's alike) over the same heads,
    rows and length, masked a bool [B, 1, T, S] and fill and scale 0-d fp32, replaced by one call of
    `kernels/attention.masked_scores_kernel` (the same bits; the masked tiles' products skipped); the chain's
    intermediates are then unused and removed. MLA's softmax input is that chain (model/mla.py: the latent and RoPE
    scores, the scale, masked_fill). Anything else is left as it is."""
    import tvm
    import tvm_ffi
    from tvm import relax
    from tvm.relax.expr_functor import PyExprMutator, mutator

    from k3compile.kernels.attention import masked_scores_kernel

    ops = {name: tvm.ir.Op.get(f"relax.{name}") for name in ("where", "multiply", "add", "call_tir")}

    @mutator
    class Fuse(PyExprMutator):
        def __init__(self, mod):
            super().__init__(mod)
            self.add_kernel = opaque_kernels(self.builder_)
            self.fused = 0

        def value(self, x):
            while isinstance(x, relax.Var):
                bound = self.lookup_binding(x)
                if bound is None:
                    return x
                x = bound
            return x

        def call_of(self, x, op: str):
            x = self.value(x)
            return x if isinstance(x, relax.Call) and x.op.same_as(ops[op]) else None

        def scores(self, x):
            """(q, k, length) of a call of the score kernel, else None."""
            x = self.call_of(x, "call_tir")
            if x is None or not isinstance(x.args[0], relax.GlobalVar):
                return None
            if not x.args[0].name_hint.startswith("k3_attention_scores_") or len(x.args[1].fields) != 3:
                return None
            return tuple(x.args[1].fields)

        def visit_call_(self, call):
            call = self.visit_expr_post_order(call)
            fused = self.fuse(call)
            return call if fused is None else fused

        def fuse(self, call):
            if not call.op.same_as(ops["where"]):
                return None
            masked, fill, scaled = call.args
            scaled = self.call_of(scaled, "multiply")
            total = None if scaled is None else self.call_of(scaled.args[0], "add")
            parts = [] if total is None else [self.scores(x) for x in total.args]
            if len(parts) != 2 or any(p is None for p in parts):
                return None
            (q, k, length), (qr, kr, length_r) = parts
            scale = scaled.args[1]
            out = call.ty
            same = tvm_ffi.structural_equal
            if not (same(length, length_r) and all(same(q.ty.shape[i], qr.ty.shape[i]) for i in range(3))
                    and out.ndim == 4 and same(out.shape[1], q.ty.shape[2])
                    and str(masked.ty.dtype) == "bool" and masked.ty.ndim == 4 and str(out.dtype) == "float32"
                    and all(same(a, b) for a, b in zip(masked.ty.shape, [out.shape[0], tvm.tirx.IntImm(
                        "int64", 1), out.shape[2], out.shape[3]]))
                    and all(x.ty.ndim == 0 and str(x.ty.dtype) == "float32" for x in (scale, fill))):
                return None
            heads, width, rope = q.ty.shape[2], k.ty.shape[2], kr.ty.shape[2]
            if not all(isinstance(d, tvm.tirx.IntImm) for d in (heads, width, rope)):
                return None
            heads, width, rope = int(heads), int(width), int(rope)
            gv = self.add_kernel(("masked_scores", heads, width, rope),
                                 lambda: masked_scores_kernel(heads, width, rope),
                                 f"k3_attention_masked_scores_{heads}_{width}_{rope}")
            self.fused += 1
            return relax.call_tir(gv, [q, k, qr, kr, masked, scale, fill, length], out)

    m = Fuse(mod)
    changed = []
    for gv, func in list(mod.functions_items()):
        if isinstance(func, relax.Function):
            before = m.fused
            new = m.visit_expr(func)
            if m.fused != before:
                changed.append((gv, relax.analysis.remove_all_unused(new)))
            else:
                changed.append((gv, new))
    for gv, func in changed:
        m.builder_.update_func(gv, func)
    return m.builder_.get()
