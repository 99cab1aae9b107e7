"""Phase 2: dense weights in the target's panel layout (docs/toolchain.md, "CPU schedules").

A `matmul(x, W)` whose W is a weight (a parameter after the graph inputs, or a transpose / reshape of one) with a
static [K, N] shape, N a multiple of the target's panel width P, becomes a call of a `k3_packed_matmul` PrimFunc
over `W` re-laid as [N/P, K, P]: each panel of P output columns is one contiguous run of memory, so a thread
streams its panel instead of touching a new page every row (measured: the k3-small LM head 12 ms -> 6.5 ms at one
token, 1024x1024 0.11 -> 0.07 ms). The relayout is an expression of the weight only, which phase 3 moves to
compile time. A target with no panel width (P = 0) leaves every matmul as it is.

With the target's dense format bf16 (docs/architecture.md, "Dense weights") the panels hold each value's upper 16
bits (uint16: numpy has no bf16), also made at compile time, and the kernel widens them as it reads them (a 16-bit
shift into an fp32 register; a stage of its own, WIDENED, that the CPU schedule places: inline for one row, a
chunk at a time for several): half the bytes a decode step streams, the same fp32 arithmetic. The bits are cut, not
rounded: compile.py narrows only weights that hold bf16 values (a bf16 checkpoint, a preset), where cutting is
exact, and refuses the others.

With the dense format mxfp8 a matrix that holds MXFP8 values along its reduction dim K (an export made with
`--dense-weights mxfp8`: k3compile/quant/dense.py; compile.py lists them in the module attr MXFP8_WEIGHTS with
the axis of the parameter that is K) is stored as E4M3 codes [N/P, K, P] (uint8) and E8M0 scales [N/P, K/32, P]
(uint8), both made at compile time (`mxfp8_codes_te`, `mxfp8_scales_te`: the OCP floor rule, exact for such
values), and the kernel decodes each code with two bit operations (`mxfp8_code_value`), sums a block's 32
products and applies the block's scale once (`packed_mx_matmul_te`): a quarter of fp32's bytes. The other
packed matrices of such a build are stored as bf16 where they hold bf16 values (the attr BF16_WEIGHTS), else
fp32.
"""

from __future__ import annotations

import functools

OUT_ELEMWISE_FUSABLE = 4  # TVM's OpPatternKind kOutEWiseFusable: a matmul, which elementwise epilogues join
PACKED = "k3.dense_packed"  # module attr: {weight name: the format phase 2 stored it in} (compile.py checks them)
MXFP8_WEIGHTS = "k3.mxfp8_weights"  # module attr (mxfp8 builds): ["name:axis"], matrices holding MXFP8 along axis
BF16_WEIGHTS = "k3.bf16_weights"  # module attr (mxfp8 builds): the names of the weights that hold bf16 values
MX_BLOCK = 32  # values per E8M0 scale (OCP MX), along K
MX_PARTIAL = "k3_mx_partial"  # the TE stage of a block's partial sums (targets/llvm.py schedules it inside)
WIDENED = "k3_widened"  # the TE stage of the bf16 panels widened to fp32 (targets/llvm.py places it)
# x is scaled by 2^X_SHIFT in the partial sums (exact), so that x times a code's value (the E4M3 value times
# 2^-120) stays a normal fp32 down to |x * value| = 2^-70 instead of 2^-6; 2^64 * x overflows only past |x| = 2^64
X_SHIFT = 64
E4M3_EMAX = 8  # exponent of E4M3's largest normal value (448 = 1.75 * 2^8)


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


def mxfp8_scales_te(wp):
    """TE: the E8M0 scale byte of each 32-value block along K of panels wp [N/P, K, P] (fp32): the OCP floor rule,
    floor(log2(amax)) - 8 + 127, is the biased exponent of amax less 8 (0 for an all-zero block)."""
    from tvm import te, tirx

    npan, k_dim, panel = wp.shape
    r = te.reduce_axis((0, MX_BLOCK), "r")
    amax = te.compute((npan, k_dim // MX_BLOCK, panel), lambda a, b, c: te.max(
        tirx.abs(wp[a, b * MX_BLOCK + r, c]), axis=r), name="k3_mx_amax")
    return te.compute(amax.shape, lambda *i: tirx.max(
        (tirx.reinterpret("uint32", amax[i]) >> tirx.const(23, "uint32")).astype("int32") - E4M3_EMAX,
        0).astype("uint8"), name="k3_mx_scale")


def mxfp8_codes_te(wp, scales):
    """TE: the E4M3 code of each value of wp [N/P, K, P] under its block's scale. The value over the scale,
    v = w * 2^(127 - scale), is exact (a power of two) and, for a matrix that holds MXFP8 values, an E4M3 value:
    a normal one (|v| >= 2^-6) is its fp32 exponent rebiased (127 -> 7) and its top 3 mantissa bits, a subnormal
    one is |v| * 2^9 (0..7); the sign is bit 7."""
    from tvm import te, tirx

    u32 = lambda v: tirx.const(v, "uint32")  # noqa: E731

    def code(a, k, c):
        s = scales[a, k // MX_BLOCK, c].astype("uint32")
        v = wp[a, k, c] * tirx.reinterpret("float32", (u32(254) - s) << u32(23))
        bits = tirx.reinterpret("uint32", v)
        mag = tirx.abs(v)
        normal = ((bits >> u32(20)) & u32(0x7FF)) - u32(120 << 3)
        sub = (mag * tirx.const(512.0, "float32")).astype("uint32")
        return (((bits >> u32(31)) << u32(7)) | tirx.if_then_else(
            mag >= tirx.const(2.0 ** -6, "float32"), normal, sub)).astype("uint8")

    return te.compute(wp.shape, code, name="k3_mx_codes")


def mxfp8_code_value(code):
    """An E4M3 code as fp32 times 2^-120: the code sign-extended to 32 bits and shifted left 20 holds its sign in
    bit 31 (and in the bits the mask clears) and its 7 magnitude bits in bits 26..20 (a subnormal code gives an
    fp32 subnormal, exact). Three integer operations, one of them the load's own extension."""
    from tvm import tirx

    return tirx.reinterpret("float32", (code.astype("int8").astype("int32") << tirx.const(20, "int32"))
                            & tirx.const(0x87F00000 - (1 << 32), "int32"))


def mxfp8_factor(scale):
    """The fp32 bits of 2^(scale - 7 - X_SHIFT): a block's partial sum of (x * 2^X_SHIFT) * `mxfp8_code_value`
    is 2^(X_SHIFT - 120) times the block's sum of x * value, and the value under the E8M0 scale byte is
    value * 2^(scale - 127); so this factor turns the partial sum into the block's share of the output. Biased
    exponent scale + 56: a normal fp32 for every scale byte up to 198."""
    from tvm import tirx

    return (scale.astype("int32") + tirx.const(127 - 7 - X_SHIFT, "int32")) << tirx.const(23, "int32")


def packed_mx_matmul_te(x, codes, scales, panel: int):
    """TE, in two stages: a block's partial sums p[m, b, n] = sum over the 32 k of block b of x[m, k] * 2^X_SHIFT *
    code value(codes[n // P, k, n % P]) (m: the rows flattened), then y[..., n] = sum_b p[m, b, n] * factor(scale):
    the scale applied once per block, not per value (targets/llvm.py computes each p inside y's loop over the
    blocks, in four vector registers). Exact up to the order of the fp32 sums (tests/unit/test_mxfp8_panels.py)."""
    from tvm import te, tirx

    k_dim = codes.shape[1]
    n_dim = codes.shape[0] * panel
    lead = x.shape[:-1]
    rows = functools.reduce(lambda a, b: a * b, lead, 1)
    kr = te.reduce_axis((0, MX_BLOCK), "kr")
    # one row index (the leading dims flattened), so that the stage keeps affine bindings once computed inside the
    # matmul's loop over fused rows (a binding divided by a symbolic extent is not one: TVM refuses the schedule)
    shift = tirx.const(2.0 ** X_SHIFT, "float32")
    partial = te.compute((rows, k_dim // MX_BLOCK, n_dim), lambda m, b, n: te.sum(
        x[(*_unflatten(m, lead), b * MX_BLOCK + kr)] * shift * mxfp8_code_value(
            codes[n // panel, b * MX_BLOCK + kr, n % panel]),
        axis=kr), name=MX_PARTIAL)
    kb = te.reduce_axis((0, k_dim // MX_BLOCK), "kb")
    return te.compute((*lead, n_dim), lambda *i: te.sum(
        partial[_flatten(i[:-1], lead), kb, i[-1]] * tirx.reinterpret("float32", mxfp8_factor(
            scales[i[-1] // panel, kb, i[-1] % panel])), axis=kb), name="k3_packed_matmul")


def _flatten(index, shape):
    flat = 0
    for i, d in zip(index, shape):
        flat = flat * d + i
    return flat


def _unflatten(flat, shape):
    out = []
    for d in reversed(shape[1:]):
        out.append(flat % d)
        flat = flat // d
    return [flat, *reversed(out)]


def packed_matmul_te(x, wp, panel: int):
    """TE: y[..., n] = sum_k x[..., k] * wp[n // P, k, n % P] (wp fp32, or bf16 bits widened by a stage of their
    own, WIDENED: the CPU schedule widens a few k of a panel once for several rows, or computes it inline where one
    row reads it: targets/llvm.py)."""
    from tvm import te

    k_dim = wp.shape[1]
    n_dim = wp.shape[0] * panel
    if wp.dtype != "float32":
        wp = te.compute(wp.shape, lambda *i: widen(wp[i]), name=WIDENED)
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
    fmt = DenseFormat(target.dense_format)
    matmul = tvm.ir.Op.get("relax.matmul")
    einsum = tvm.ir.Op.get("relax.einsum")
    relayout = {tvm.ir.Op.get(n) for n in ("relax.permute_dims", "relax.reshape")}

    @mutator
    class Pack(PyExprMutator):
        def __init__(self, mod, weights):
            super().__init__(mod)
            self.weights = weights
            self.packed: dict[str, str] = {}
            attrs = mod.attrs if mod.attrs is not None else {}
            self.mx = {str(e) for e in attrs[MXFP8_WEIGHTS]} if MXFP8_WEIGHTS in attrs else set()
            self.bf16 = {str(e) for e in attrs[BF16_WEIGHTS]} if BF16_WEIGHTS in attrs else set()

        def _weight(self, expr):
            """The weight parameter `expr` is (or a transpose / reshape of), else None."""
            if isinstance(expr, relax.Var) and expr in self.weights:
                return expr
            bound = self.lookup_binding(expr) if isinstance(expr, relax.Var) else None
            if isinstance(bound, relax.Call) and any(bound.op.same_as(op) for op in relayout):
                return self._weight(bound.args[0])
            return None

        def _k_axis(self, expr):
            """The axis of the weight parameter that is the matmul's K when `expr` is that 2-D parameter (0) or
            its transpose (1); None for any other relayout."""
            if isinstance(expr, relax.Var) and expr in self.weights:
                return 0
            bound = self.lookup_binding(expr) if isinstance(expr, relax.Var) else None
            if (isinstance(bound, relax.Call) and bound.op.same_as(tvm.ir.Op.get("relax.permute_dims"))
                    and isinstance(bound.args[0], relax.Var) and bound.args[0] in self.weights
                    and len(bound.args[0].ty.shape) == 2
                    and (bound.attrs.axes is None or [int(a) for a in bound.attrs.axes] == [1, 0])):
                return 1
            return None

        def _format(self, w, param) -> str:
            """How this build stores the matrix `w` (the matmul's [K, N] operand, made from `param`)."""
            if fmt != DenseFormat.MXFP8:
                return fmt.value
            if int(w.ty.shape[0]) % MX_BLOCK == 0 and f"{param.name}:{self._k_axis(w)}" in self.mx:
                return DenseFormat.MXFP8.value
            return DenseFormat.BF16.value if param.name in self.bf16 else DenseFormat.FP32.value

        def _weight_only(self, expr) -> bool:
            """Whether `expr` is computed from the weights alone (phase 3 moves such work to compile time)."""
            if isinstance(expr, tvm.ir.expr.Constant) or (isinstance(expr, relax.Var) and expr in self.weights):
                return True
            if isinstance(expr, relax.TupleGetItem):
                return self._weight_only(expr.tuple_value)
            if isinstance(expr, relax.Tuple):
                return all(self._weight_only(f) for f in expr.fields)
            bound = self.lookup_binding(expr) if isinstance(expr, relax.Var) else None
            if isinstance(bound, (relax.TupleGetItem, relax.Tuple, tvm.ir.expr.Constant)):
                return self._weight_only(bound)
            return isinstance(bound, relax.Call) and isinstance(bound.op, tvm.ir.Op) and all(
                self._weight_only(a) for a in bound.args if isinstance(a, (relax.Var, relax.Tuple, relax.TupleGetItem)))

        def _einsum(self, call):
            """`einsum(x, W)` whose weight W does not hold the output's last index last (MLA's value projection,
            "bthc,hvc->bthv", whose sum runs along both operands' last index: TVM's schedule leaves each output a
            scalar dot product, 6 GFLOP/s) with W permuted to hold it last ("hcv"), a relayout of the weight alone,
            so the CPU matmul rule vectorizes the output along it (targets/llvm.py)."""
            lhs, out = str(call.attrs.subscripts).split("->")
            parts = lhs.split(",")
            if len(parts) != 2 or len(call.args[0].fields) != 2 or "." in lhs or not out:
                return call
            x, w = call.args[0].fields
            j = out[-1]
            if j not in parts[1] or parts[1][-1] == j or j in parts[0] or not self._weight_only(w):
                return call
            order = [i for i, c in enumerate(parts[1]) if c != j] + [parts[1].index(j)]
            wt = self.builder_.emit(relax.op.permute_dims(w, order))
            return relax.op.einsum((x, wt), f"{parts[0]},{''.join(parts[1][i] for i in order)}->{out}")

        def visit_call_(self, call):
            call = self.visit_expr_post_order(call)
            if panel and call.op.same_as(einsum) and isinstance(call.args[0], relax.Tuple):
                return self._einsum(call)
            if not (panel and call.op.same_as(matmul) and len(call.args) == 2):
                return call
            x, w = call.args
            shape = getattr(w.ty, "shape", None)
            if (shape is None or len(shape) != 2 or not all(isinstance(d, tvm.tirx.IntImm) for d in shape)
                    or int(shape[1]) % panel or x.ty.dtype != "float32" or w.ty.dtype != "float32"
                    or self._weight(w) is None):
                return call
            param = self._weight(w)
            stored = self.packed[param.name] = self._format(w, param)
            k_dim, n_dim = int(shape[0]), int(shape[1])
            wp = self.builder_.emit(relax.op.permute_dims(
                relax.op.reshape(w, [k_dim, n_dim // panel, panel]), [1, 0, 2]))
            if stored == DenseFormat.MXFP8:
                scales = self.builder_.emit_te(mxfp8_scales_te, wp, primfunc_name_hint="k3_mx_scales")
                codes = self.builder_.emit_te(mxfp8_codes_te, wp, scales, primfunc_name_hint="k3_mx_codes")
                return self.builder_.call_te(packed_mx_matmul_te, x, codes, scales, panel,
                                             primfunc_name_hint="k3_packed_matmul")
            if stored == DenseFormat.BF16:
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
        return mod.with_attr(PACKED, m.packed)

    return run
