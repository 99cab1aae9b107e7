"""Phase 1: lower the extern calls of k3 ops to TIR kernels (docs/architecture.md, "The compile path").

The frontend leaves each k3 node as `R.call_dps_packed("k3.<op>", args, out_ty)`, its attributes among the
arguments. For every symbol with a kernel factory, this pass replaces the call with `R.call_tir` of a PrimFunc built
for the call's static sizes and attributes (one PrimFunc per distinct key, added to the module once). A factory
that cannot cover a call returns `Declined(reason)` (a size that is not static, an attribute that is not a constant,
what the format or the eager op itself refuses); such a call, and a k3 symbol without a factory, stays extern and its
reason is kept in the module attribute `k3.declined` (symbol -> reasons), which the build reads after the phases to
refuse it with the reason (k3compile/compile.py: `_no_extern_calls`): an artifact never calls an extern k3 op. The
collectives (`extern_by_design()`, ops/collectives.py) are extern by design: the distributed runtime serves them.

A factory takes the call's argument expressions and the target and returns (key, make, tensor_args), a `Composite`
or a `Declined`: `key` names the specialization, `make()` builds the PrimFunc, `tensor_args` are the arguments the
kernel takes. An argument may be a Relax op on a weight (the target's layout: the CPU expert kernel reads the packed
experts in column tiles; float experts cast to float32 and zero-padded to whole 32-blocks) or on an activation (a
reshape, a zero pad); the pass binds it before the call, and phase 3 moves the weight ones to compile time. A
factory may add a fourth element, the kernel's output type, when its shape differs from the call's (the matmul
kernel takes x as [M, K]); the pass reshapes the kernel's result to the call's shape.

A `Composite` is several PrimFuncs (stages; one, named "", for a kernel that needs Relax around it) and a function
that emits their calls in order: the GPU MoE (MXFP8 quantization, gate-up, down), a kernel run at padded sizes (z
padded with zero columns, y sliced back). On a GPU target ("words" layout) the factories build the thread-bound
kernels of k3compile/kernels/gpu.py and repack the MXFP4 weights into uint32 words (`words`, `scale_words`), also an
expression of the weight that phase 3 lifts.

Widths that are not multiples of 32 (docs/architecture.md, "The compile path"): float experts are zero-padded to
whole 32-blocks (I and D), which changes nothing the kernel computes: a zero gate and up row gives act(0, 0) = 0
under SiTU and SiLU (ops/activations.py) and meets zero down-projection columns, the padded input columns meet zero z
columns, and the padded output columns are sliced off. MXFP4 blocks are 32 wide by the format (config.py validates
it), and MXFP8 activations quantize 32-blocks that the eager op refuses to cut (ops/latent_moe_dispatch.py): those
are reasons, not tails. The GPU matmul's scale words hold 4 output columns: N is padded to a multiple of 4.
"""

from __future__ import annotations

import functools
import operator
from collections.abc import Callable
from dataclasses import dataclass

DECLINED = "k3.declined"  # the module attribute: symbol -> the reasons its calls were declined
NO_FACTORY = "no kernel is written for this op"
BLOCK = 32  # the MX block, and the kernels' reduction step


@functools.cache
def extern_by_design() -> frozenset[str]:
    """The k3 symbols that stay extern in every build: the collectives (k3.all_reduce, k3.all_to_all), which the
    distributed runtime registers (ops/collectives.py; docs/architecture.md, "Sharding and the runtime")."""
    from k3compile.ops.collectives import SYMBOLS

    return frozenset(SYMBOLS.values())


@dataclass(frozen=True)
class Composite:
    """Stages for one call: `funcs` maps a stage name to a PrimFunc maker; `emit(builder, call)` emits the stages,
    `call(stage, args, out_ty)` binding one call_tir, and returns the expression that replaces the k3 call."""

    key: tuple
    funcs: dict
    emit: Callable


@dataclass(frozen=True)
class Declined:
    """A factory's answer when no kernel covers the call: why, in words the build error can print after the op
    (`k3.<op> has no <target> kernel: <reason>`)."""

    reason: str


def _static(dim) -> int | None:
    import tvm

    return int(dim) if isinstance(dim, tvm.tirx.IntImm) else None


def _dims(*dims) -> str:
    """Sizes as a reason prints them: "(h, 8, 8)" for a symbolic h."""
    return "(" + ", ".join(str(d if _static(d) is None else _static(d)) for d in dims) + ")"


def _value(expr):
    """The Python value of a constant attribute argument (an IntImm / FloatImm / StringImm), else None."""
    import tvm

    if isinstance(expr, tvm.ir.StringImm):
        return expr.value
    if isinstance(expr, (tvm.tirx.IntImm, tvm.tirx.FloatImm)):
        return expr.value
    return None


def _gpu(target) -> bool:
    return target is not None and target.expert_layout == "words"


def _up(n: int, m: int = BLOCK) -> int:
    return -(-n // m) * m


def words(codes):
    """Packed E2M1 codes [E, R, C/2] (uint8, element 2i low) -> the GPU word layout [E, C/8, R] uint32: word
    [k / 8, r] holds the codes of k .. k + 7 of row r, the lowest first (kernels/gpu.py)."""
    from tvm import relax

    e, r, half = (int(d) for d in codes.ty.shape)
    t = relax.op.reshape(relax.op.permute_dims(codes, [0, 2, 1]), [e, half // 4, 4, r])
    return relax.op.sum(relax.op.multiply(relax.op.astype(t, "uint32"), _byte_weights([1, 1, 4, 1])), axis=[2])


def scale_words(scales):
    """E8M0 scales [E, R, C/32] (uint8) -> [E, C/32, R/4] uint32: word [b, r / 4] holds rows r .. r + 3."""
    from tvm import relax

    e, r, blocks = (int(d) for d in scales.ty.shape)
    t = relax.op.reshape(relax.op.permute_dims(scales, [0, 2, 1]), [e, blocks, r // 4, 4])
    return relax.op.sum(relax.op.multiply(relax.op.astype(t, "uint32"), _byte_weights([1, 1, 1, 4])), axis=[3])


def _byte_weights(shape):
    import numpy as np
    from tvm import relax

    return relax.const(np.array([1, 1 << 8, 1 << 16, 1 << 24], np.uint32).reshape(shape))


def float_experts(w13, w2, experts: int, inter: int, width: int, ip: int, dp: int):
    """Float experts as the kernels take them: float32 (a float16 / bfloat16 checkpoint cast here, lifted to compile
    time like the rest), w13 [E, 2I, D] -> [E, 2Ip, Dp] with the gate and the up rows each padded to Ip, w2 [E, D, I]
    -> [E, Dp, Ip]; the padding is zeros (module docstring)."""
    from tvm import relax

    w13, w2 = (t if str(t.ty.dtype) == "float32" else relax.op.astype(t, "float32") for t in (w13, w2))
    if (ip, dp) == (inter, width):
        return w13, w2
    w13 = relax.op.reshape(relax.op.nn.pad(relax.op.reshape(w13, [experts, 2, inter, width]),
                                           [0, 0, 0, 0, 0, ip - inter, 0, dp - width]), [experts, 2 * ip, dp])
    return w13, relax.op.nn.pad(w2, [0, 0, 0, dp - width, 0, ip - inter])


def _columns(x, width: int, padded: int):
    """x [N, width] with zero columns up to `padded` (an activation: at run time)."""
    from tvm import relax

    return x if padded == width else relax.op.nn.pad(x, [0, 0, 0, padded - width])


def _first_columns(y, width: int, padded: int):
    """y [N, padded] -> y[:, :width]."""
    from tvm import relax

    return y if padded == width else relax.op.strided_slice(y, axes=[1], begin=[0], end=[width])


def kda_factory(args, target=None):
    """k3.kda_recurrence(q, k, v, g, beta, state): the chunked kernel (its tail runs decode's single token),
    specialized to (H, K, V); on a GPU the thread-per-column kernel. Any H, K, V."""
    from k3compile.kernels.gpu import kda_gpu_kernel
    from k3compile.kernels.kda import kda_chunked_kernel

    q, v = args[0].ty.shape, args[2].ty.shape
    sizes = (_static(q[2]), _static(q[3]), _static(v[3]))
    if None in sizes:
        return Declined(f"the head count and widths (H, K, V) = {_dims(q[2], q[3], v[3])} are not all static")
    return sizes, lambda: (kda_gpu_kernel if _gpu(target) else kda_chunked_kernel)(*sizes), list(args)


MOE_ATTRIBUTES = ("expert_offset", "activation", "situ_beta", "situ_linear_beta", "act_quant")


def moe_factory(args, target=None, mx: bool = True):
    """k3.latent_moe_dispatch_mxfp4(z, idx, w, w13, w2, s13, s2, offset, activation, beta, linear_beta, act_quant),
    or k3.latent_moe_dispatch (float experts, no scales): specialized to (E, I, D, offset, activation, betas,
    act_quant), I and D those of the kernel (float experts padded to 32-blocks: module docstring). The kernel reads
    the expert arrays in column tiles (`_expert_tiles`); float experts get two one-byte placeholders for the
    scales."""
    import numpy as np
    from tvm import relax

    from k3compile.kernels.moe import moe_kernel
    from k3compile.ops.mxfp4_matmul import ACT_QUANT

    n = 7 if mx else 5
    tensors, attrs = list(args[:n]), [_value(a) for a in args[n:]]
    for name, value in zip(MOE_ATTRIBUTES, attrs):
        if value is None:
            return Declined(f"its attribute {name} is not a constant")
    w13 = tensors[3].ty.shape
    sizes = (_static(w13[0]), _static(w13[1]), _static(tensors[0].ty.shape[1]))
    if None in sizes:
        return Declined(f"the expert count and widths (E, 2I, D) = {_dims(w13[0], w13[1], tensors[0].ty.shape[1])} "
                        "are not all static")
    offset, activation, beta, linear_beta, act_quant = int(attrs[0]), attrs[1], float(attrs[2]), float(attrs[3]), \
        attrs[4]
    if act_quant not in ACT_QUANT:
        return Declined(f"act_quant {act_quant!r} is not one of {', '.join(ACT_QUANT)}")
    experts, inter, width = sizes[0], sizes[1] // 2, sizes[2]
    if mx and (inter % BLOCK or width % BLOCK):
        return Declined(f"MXFP4 experts come in blocks of {BLOCK} along both widths, got I={inter}, D={width}")
    if act_quant != "none" and (inter % BLOCK or width % BLOCK):
        return Declined(f"MXFP8 activations ({act_quant}) quantize blocks of {BLOCK} along both widths, got "
                        f"I={inter}, D={width} (the eager op refuses them too)")
    if not mx:
        dtypes = {str(t.ty.dtype) for t in tensors[3:5]}
        if not all(d.startswith(("float", "bfloat")) for d in dtypes):
            return Declined(f"float experts of dtype {', '.join(sorted(dtypes))}, not a float type")
        if sizes[1] % 2:
            return Declined(f"w13 has {sizes[1]} rows, not gate and up halves")
    ip, dp = _up(inter), _up(width)  # MXFP4 and MXFP8 widths are whole blocks already
    key = (experts, ip, dp, offset, activation, beta, linear_beta, act_quant)
    if not mx:
        tensors[3:5] = float_experts(tensors[3], tensors[4], experts, inter, width, ip, dp)
    if _gpu(target):
        return _moe_gpu(tensors, key, mx, width)
    per = 2 if mx else 1  # [out, in] of an expert: w13, w2 (packed two codes a byte), then s13, s2
    dims = [(2 * ip, dp // per), (dp, ip // per)] + ([(2 * ip, dp // BLOCK), (dp, ip // BLOCK)] if mx else [])
    tensors[3:] = [_expert_tiles(t, experts, *d) for t, d in zip(tensors[3:], dims)]
    if not mx:
        tensors += [relax.const(np.zeros((1, 1, 1, 1), np.uint8))] * 2
    z, rows = tensors[0], tensors[0].ty.shape[0]

    def emit(bb, call):
        y = call("", [_columns(z, width, dp), *tensors[1:]], relax.TensorType([rows, dp], "float32"))
        return _first_columns(y, width, dp)

    return Composite(key, {"": lambda: moe_kernel(experts, ip, dp, offset, activation == "situ", beta, linear_beta,
                                                  act_quant, mx, target)}, emit)


def _expert_tiles(t, experts: int, out: int, inner: int):
    """An expert array [E, out, in] -> [E, out/c, in, c], c = column_tile(out): the CPU MoE kernel's layout
    (kernels/moe.py: `expert_tiles`, the same rearrangement in numpy). The sizes come from the caller: `t` may be an
    expression not yet normalized (the float experts' cast and pad)."""
    from tvm import relax

    from k3compile.kernels.moe import column_tile

    c = column_tile(out)
    return relax.op.permute_dims(relax.op.reshape(t, [experts, out // c, c, inner]), [0, 1, 3, 2])


def mxfp4_matmul_factory(args, target=None):
    """k3.mxfp4_matmul(x [..., K], packed [N, K/2], scale [N, K/32], act_quant): specialized to (K, N, act_quant);
    x is flattened to [M, K] and the weight read in the "kn" layout ([K/2, N], [K/32, N]). Any N (on a GPU padded to
    a multiple of 4); K is whole MXFP4 blocks by the format."""
    import tvm
    from tvm import relax

    from k3compile.kernels.mxfp4_matmul import mxfp4_matmul_kernel
    from k3compile.ops.mxfp4_matmul import ACT_QUANT

    x, packed, scale, act_quant = args[0], args[1], args[2], _value(args[3])
    if len(packed.ty.shape) != 2:
        return Declined(f"its weight is stacked ({len(packed.ty.shape)}-D); the kernel takes one [N, K/2] matrix "
                        "(the MoE's stacked experts are the dispatch's own kernel)")
    if act_quant not in ACT_QUANT:
        return Declined(f"act_quant {act_quant!r} is not a constant one of {', '.join(ACT_QUANT)}")
    n, k = _static(packed.ty.shape[0]), _static(x.ty.shape[-1])
    if None in (n, k):
        return Declined(f"its sizes (K, N) = {_dims(x.ty.shape[-1], packed.ty.shape[0])} are not both static")
    if k % BLOCK:
        return Declined(f"MXFP4 weights come in blocks of {BLOCK} along K, got K={k}")
    xs = x.ty.shape  # a ShapeExpr indexes but does not slice
    rows = functools.reduce(operator.mul, [xs[i] for i in range(len(xs) - 1)], tvm.tirx.IntImm("int64", 1))
    if _gpu(target):
        return _mxfp4_matmul_gpu(x, packed, scale, act_quant, rows, k, n)
    tensors = [relax.op.reshape(x, [rows, k]), relax.op.permute_dims(packed, [1, 0]),
               relax.op.permute_dims(scale, [1, 0])]
    out = relax.TensorType([rows, n], "float32")
    return (k, n, act_quant), lambda: mxfp4_matmul_kernel(k, n, act_quant), tensors, out


def _mxfp4_matmul_gpu(x, packed, scale, act_quant, rows, k, n) -> Composite:
    """The GPU matmul: [MXFP8 x] -> x · W, the weight as uint32 words; N padded to the 4 columns of a scale word
    (zero codes and scales: the padded columns are zero, and sliced off)."""
    from tvm import relax

    from k3compile.kernels import gpu

    np_ = _up(n, 4)
    funcs = {"mm": lambda: gpu.mxfp4_matmul_gpu_kernel(k, np_)}
    if act_quant != "none":
        funcs["quant"] = lambda: gpu.mxfp8_quant_gpu_kernel(k, act_quant)

    def emit(bb, call):
        p, sc = packed, scale
        if np_ != n:
            p, sc = (bb.emit(relax.op.nn.pad(t, [0, np_ - n, 0, 0])) for t in (packed, scale))
        w = words(bb.emit(relax.op.expand_dims(p, [0])))  # bound first: `words` reads its argument's shape
        s = scale_words(bb.emit(relax.op.expand_dims(sc, [0])))
        x2 = bb.emit(relax.op.reshape(x, [rows, k]))
        if act_quant != "none":
            x2 = call("quant", [x2], relax.TensorType([rows, k], "float32"))
        y = call("mm", [x2, w, s], relax.TensorType([rows, np_], "float32"))
        if np_ != n:
            y = bb.emit(_first_columns(y, n, np_))
        return relax.op.reshape(y, [*[x.ty.shape[i] for i in range(len(x.ty.shape) - 1)], n])

    return Composite((k, np_, act_quant), funcs, emit)


def _moe_gpu(tensors, key, mx: bool, width: int) -> Composite:
    """The GPU MoE: [MXFP8 z] -> gate-up + activation -> [MXFP8 h] -> down, expert ids as int32; float experts
    padded by the factory, z padded and y sliced here (module docstring)."""
    import numpy as np
    from tvm import relax

    from k3compile.kernels import gpu

    experts, inter, padded, offset, activation, beta, linear_beta, act_quant = key
    z, idx, w, w13, w2, *scales = tensors
    n, k = z.ty.shape[0], idx.ty.shape[1]
    if mx:
        w13, w2, s13, s2 = words(w13), words(w2), scale_words(scales[0]), scale_words(scales[1])
    else:
        w13, w2 = (relax.op.permute_dims(t, [0, 2, 1]) for t in (w13, w2))
        s13 = s2 = relax.const(np.zeros((1, 1, 1), np.uint32))
    funcs = {"up": lambda: gpu.moe_up_gpu_kernel(experts, inter, padded, offset, activation == "situ", beta,
                                                 linear_beta, mx),
             "down": lambda: gpu.moe_down_gpu_kernel(experts, inter, padded, offset, mx)}
    if act_quant != "none":
        funcs["quant_d"] = lambda: gpu.mxfp8_quant_gpu_kernel(padded, act_quant)
        funcs["quant_i"] = lambda: gpu.mxfp8_quant_gpu_kernel(inter, act_quant)

    def emit(bb, call):
        ids = bb.emit(relax.op.astype(idx, "int32"))
        zp = bb.emit(_columns(z, width, padded)) if padded != width else z
        zq = call("quant_d", [zp], relax.TensorType([n, padded], "float32")) if act_quant != "none" else zp
        h = call("up", [zq, ids, w13, s13], relax.TensorType([n, k, inter], "float32"))
        if act_quant != "none":
            hq = call("quant_i", [relax.op.reshape(h, [n * k, inter])], relax.TensorType([n * k, inter], "float32"))
            h = bb.emit(relax.op.reshape(hq, [n, k, inter]))
        y = call("down", [h, ids, w, w2, s2], relax.TensorType([n, padded], "float32"))
        return _first_columns(y, width, padded)

    return Composite(key, funcs, emit)


KERNELS: dict[str, Callable] = {
    "k3.kda_recurrence": kda_factory,
    "k3.latent_moe_dispatch_mxfp4": moe_factory,
    "k3.latent_moe_dispatch": functools.partial(moe_factory, mx=False),
    "k3.mxfp4_matmul": mxfp4_matmul_factory,
}


def _tag(func, symbol: str, key: tuple, stage: str):
    """The kernel's origin as attributes (`k3.op`, `k3.key` as JSON, `k3.stage`): what `verify --device` reads to
    rebuild a kernel's inputs and references (k3compile/device_check.py)."""
    import json

    return func.with_attrs({"k3.op": symbol, "k3.key": json.dumps(list(key)), "k3.stage": stage})


def _name(symbol: str, key: tuple, stage: str) -> str:
    return "_".join([symbol.replace(".", "_"), *([stage] if stage else []), *(str(k).replace(".", "p") for k in key)])


def declined(mod) -> dict[str, list[str]]:
    """The `k3.declined` attribute of a module this pass ran on: symbol -> the reasons its calls stayed extern."""
    attrs = mod.attrs if mod.attrs is not None else {}
    if DECLINED not in attrs:
        return {}
    return {str(s): [str(r) for r in reasons] for s, reasons in attrs[DECLINED].items()}


def lower_k3_calls(target=None, kernels: dict[str, Callable] | None = None):
    """The pass (a tvm.transform.ModulePass) for `target` (a k3compile.targets.Target)."""
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
            self.declined: dict[str, list[str]] = declined(mod)

        def _func(self, symbol, key, stage, make):
            if (symbol, key, stage) not in self.added:
                name = _name(symbol, key, stage)
                func = _tag(make().with_attr("global_symbol", name), symbol, key, stage)
                self.added[(symbol, key, stage)] = self.builder_.add_func(func, name)
            return self.added[(symbol, key, stage)]

        def _stage(self, symbol, made, stage, args, out):
            func = self._func(symbol, made.key, stage, made.funcs[stage])
            args = [self.builder_.emit(a) if isinstance(a, relax.Call) else a for a in args]
            return self.builder_.emit(relax.call_tir(func, relax.Tuple(args), out_ty=out))

        def _decline(self, symbol, reason: str):
            if reason not in self.declined.setdefault(symbol, []):
                self.declined[symbol].append(reason)

        def visit_call_(self, call):
            call = self.visit_expr_post_order(call)
            if not (call.op.same_as(call_dps) and isinstance(call.args[0], relax.ExternFunc)):
                return call
            symbol = call.args[0].global_symbol
            if symbol in extern_by_design():
                return call
            if symbol not in kernels:
                if symbol.startswith("k3."):
                    self._decline(symbol, NO_FACTORY)
                return call
            made = kernels[symbol](list(call.args[1].fields), target)
            if isinstance(made, Declined):
                self._decline(symbol, made.reason)
                return call
            if made is None:  # lesson 6 of the house style: a factory says why it declines
                raise TypeError(f"the kernel factory of {symbol} returned None; it returns a kernel or Declined")
            if isinstance(made, Composite):
                return made.emit(self.builder_, functools.partial(self._stage, symbol, made))
            key, make, tensor_args, *kernel_out = made
            func = self._func(symbol, key, "", make)
            out = list(call.ty.fields) if isinstance(call.ty, relax.TupleType) else call.ty
            tensor_args = [self.builder_.emit(a) if isinstance(a, relax.Call) else a for a in tensor_args]
            if not kernel_out:
                return relax.call_tir(func, relax.Tuple(tensor_args), out_ty=out)
            y = self.builder_.emit(relax.call_tir(func, relax.Tuple(tensor_args), out_ty=kernel_out[0]))
            return relax.op.reshape(y, call.ty.shape)

    @tvm.transform.module_pass(opt_level=0, name="LowerK3Calls")
    def lower(mod, ctx):
        m = Lower(mod)
        for gv, func in mod.functions_items():
            if isinstance(func, relax.Function):
                m.builder_.update_func(gv, m.visit_expr(func))
        out = m.builder_.get()
        return out.with_attr(DECLINED, m.declined) if m.declined else out

    return lower
