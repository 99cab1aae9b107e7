"""Phase 1: lower the extern calls of k3 ops to TIR kernels (docs/architecture.md, "The compile path").

The frontend leaves each k3 node as `R.call_dps_packed("k3.<op>", args, out_ty)`, its attributes among the
arguments. For every symbol with a kernel factory, this pass replaces the call with `R.call_tir` of a PrimFunc built
for the call's static sizes and attributes (one PrimFunc per distinct key, added to the module once); calls without a
kernel, or that a factory declines (a size that is not static, an attribute the kernel does not cover), stay extern
(served by the op's reference implementation).

A factory takes the call's argument expressions and the target and returns (key, make, tensor_args) or None: `key`
names the specialization, `make()` builds the PrimFunc, `tensor_args` are the arguments the kernel takes. An
argument may be a Relax op on a weight (the target's layout: the CPU expert kernel reads the packed experts
transposed) or on an activation (a reshape); the pass binds it before the call, and phase 2 moves the weight ones
to compile time. A factory may add a fourth element, the kernel's output type, when its shape differs from the
call's (the matmul kernel takes x as [M, K]); the pass reshapes the kernel's result to the call's shape.

A factory may instead return a `Composite`: several PrimFuncs (stages) and a function that emits their calls in
order (the GPU MoE: MXFP8 quantization, gate-up, down). On a GPU target ("words" layout) the factories build the
thread-bound kernels of k3compile/kernels/gpu.py and repack the MXFP4 weights into uint32 words (`words`,
`scale_words`), also an expression of the weight that phase 3 lifts.
"""

from __future__ import annotations

import functools
import operator
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class Composite:
    """Stages for one call: `funcs` maps a stage name to a PrimFunc maker; `emit(builder, call)` emits the stages,
    `call(stage, args, out_ty)` binding one call_tir, and returns the expression that replaces the k3 call."""

    key: tuple
    funcs: dict
    emit: Callable


def _static(dim) -> int | None:
    import tvm

    return int(dim) if isinstance(dim, tvm.tirx.IntImm) else None


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


def kda_factory(args, target=None):
    """k3.kda_recurrence(q, k, v, g, beta, state): the chunked kernel (its tail runs decode's single token),
    specialized to (H, K, V); on a GPU the thread-per-column kernel."""
    from k3compile.kernels.gpu import kda_gpu_kernel
    from k3compile.kernels.kda import kda_chunked_kernel

    q, v = args[0].ty.shape, args[2].ty.shape
    sizes = (_static(q[2]), _static(q[3]), _static(v[3]))
    if None in sizes:
        return None
    return sizes, lambda: (kda_gpu_kernel if _gpu(target) else kda_chunked_kernel)(*sizes), list(args)


def moe_factory(args, target=None, mx: bool = True):
    """k3.latent_moe_dispatch_mxfp4(z, idx, w, w13, w2, s13, s2, offset, activation, beta, linear_beta, act_quant),
    or k3.latent_moe_dispatch (float32 experts, no scales): specialized to (E, I, D, offset, activation, betas,
    act_quant). The kernel reads the expert arrays in the "kn" layout ([E, rows, cols] -> [E, cols, rows]); float
    experts get two one-byte placeholders for the scales."""
    import numpy as np
    from tvm import relax

    from k3compile.kernels.moe import moe_kernel
    from k3compile.ops.mxfp4_matmul import ACT_QUANT

    n = 7 if mx else 5
    tensors, attrs = list(args[:n]), [_value(a) for a in args[n:]]
    w13 = tensors[3].ty.shape
    sizes = (_static(w13[0]), _static(w13[1]), _static(tensors[0].ty.shape[1]))
    if None in sizes or None in attrs or attrs[4] not in ACT_QUANT or sizes[1] % 64 or sizes[2] % 32:
        return None
    if not mx and not (str(tensors[3].ty.dtype) == str(tensors[4].ty.dtype) == "float32"):
        return None
    experts, inter, width = sizes[0], sizes[1] // 2, sizes[2]
    offset, activation, beta, linear_beta, act_quant = int(attrs[0]), attrs[1], float(attrs[2]), float(attrs[3]), \
        attrs[4]
    key = (experts, inter, width, offset, activation, beta, linear_beta, act_quant)
    if _gpu(target):
        return _moe_gpu(tensors, key, mx)
    tensors[3:] = [relax.op.permute_dims(t, [0, 2, 1]) for t in tensors[3:]]
    if not mx:
        tensors += [relax.const(np.zeros((1, 1, 1), np.uint8))] * 2
    return key, lambda: moe_kernel(experts, inter, width, offset, activation == "situ", beta, linear_beta,
                                   act_quant, mx), tensors


def mxfp4_matmul_factory(args, target=None):
    """k3.mxfp4_matmul(x [..., K], packed [N, K/2], scale [N, K/32], act_quant): specialized to (K, N, act_quant);
    x is flattened to [M, K] and the weight read in the "kn" layout ([K/2, N], [K/32, N])."""
    import tvm
    from tvm import relax

    from k3compile.kernels.mxfp4_matmul import mxfp4_matmul_kernel
    from k3compile.ops.mxfp4_matmul import ACT_QUANT

    x, packed, scale, act_quant = args[0], args[1], args[2], _value(args[3])
    if len(packed.ty.shape) != 2 or act_quant not in ACT_QUANT:
        return None
    n, k = _static(packed.ty.shape[0]), _static(x.ty.shape[-1])
    if None in (n, k) or k % 32 or (_gpu(target) and n % 4):
        return None
    xs = x.ty.shape  # a ShapeExpr indexes but does not slice
    rows = functools.reduce(operator.mul, [xs[i] for i in range(len(xs) - 1)], tvm.tirx.IntImm("int64", 1))
    if _gpu(target):
        return _mxfp4_matmul_gpu(x, packed, scale, act_quant, rows, k, n)
    tensors = [relax.op.reshape(x, [rows, k]), relax.op.permute_dims(packed, [1, 0]),
               relax.op.permute_dims(scale, [1, 0])]
    out = relax.TensorType([rows, n], "float32")
    return (k, n, act_quant), lambda: mxfp4_matmul_kernel(k, n, act_quant), tensors, out


def _mxfp4_matmul_gpu(x, packed, scale, act_quant, rows, k, n) -> Composite:
    """The GPU matmul: [MXFP8 x] -> x · W, the weight as uint32 words."""
    from tvm import relax

    from k3compile.kernels import gpu

    funcs = {"mm": lambda: gpu.mxfp4_matmul_gpu_kernel(k, n)}
    if act_quant != "none":
        funcs["quant"] = lambda: gpu.mxfp8_quant_gpu_kernel(k, act_quant)
    w = words(relax.op.expand_dims(packed, [0]))
    s = scale_words(relax.op.expand_dims(scale, [0]))

    def emit(bb, call):
        x2 = bb.emit(relax.op.reshape(x, [rows, k]))
        if act_quant != "none":
            x2 = call("quant", [x2], relax.TensorType([rows, k], "float32"))
        y = call("mm", [x2, w, s], relax.TensorType([rows, n], "float32"))
        return relax.op.reshape(y, [*[x.ty.shape[i] for i in range(len(x.ty.shape) - 1)], n])

    return Composite((k, n, act_quant), funcs, emit)


def _moe_gpu(tensors, key, mx: bool) -> Composite:
    """The GPU MoE: [MXFP8 z] -> gate-up + activation -> [MXFP8 h] -> down, expert ids as int32."""
    import numpy as np
    from tvm import relax

    from k3compile.kernels import gpu

    experts, inter, width, offset, activation, beta, linear_beta, act_quant = key
    z, idx, w, w13, w2, *scales = tensors
    n, k = z.ty.shape[0], idx.ty.shape[1]
    if mx:
        w13, w2, s13, s2 = words(w13), words(w2), scale_words(scales[0]), scale_words(scales[1])
    else:
        w13, w2 = (relax.op.permute_dims(t, [0, 2, 1]) for t in (w13, w2))
        s13 = s2 = relax.const(np.zeros((1, 1, 1), np.uint32))
    funcs = {"up": lambda: gpu.moe_up_gpu_kernel(experts, inter, width, offset, activation == "situ", beta,
                                                 linear_beta, mx),
             "down": lambda: gpu.moe_down_gpu_kernel(experts, inter, width, offset, mx)}
    if act_quant != "none":
        funcs["quant_d"] = lambda: gpu.mxfp8_quant_gpu_kernel(width, act_quant)
        funcs["quant_i"] = lambda: gpu.mxfp8_quant_gpu_kernel(inter, act_quant)

    def emit(bb, call):
        ids = bb.emit(relax.op.astype(idx, "int32"))
        zq = call("quant_d", [z], relax.TensorType([n, width], "float32")) if act_quant != "none" else z
        h = call("up", [zq, ids, w13, s13], relax.TensorType([n, k, inter], "float32"))
        if act_quant != "none":
            hq = call("quant_i", [relax.op.reshape(h, [n * k, inter])], relax.TensorType([n * k, inter], "float32"))
            h = bb.emit(relax.op.reshape(hq, [n, k, inter]))
        return call("down", [h, ids, w, w2, s2], relax.TensorType([n, width], "float32"))

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

        def _stage(self, symbol, made, stage, args, out):
            if (symbol, made.key, stage) not in self.added:
                name = "_".join([symbol.replace(".", "_"), stage, *(str(k).replace(".", "p") for k in made.key)])
                func = _tag(made.funcs[stage]().with_attr("global_symbol", name), symbol, made.key, stage)
                self.added[(symbol, made.key, stage)] = self.builder_.add_func(func, name)
            args = [self.builder_.emit(a) if isinstance(a, relax.Call) else a for a in args]
            return self.builder_.emit(relax.call_tir(self.added[(symbol, made.key, stage)], relax.Tuple(args),
                                                     out_ty=out))

        def visit_call_(self, call):
            call = self.visit_expr_post_order(call)
            if not (call.op.same_as(call_dps) and isinstance(call.args[0], relax.ExternFunc)):
                return call
            symbol = call.args[0].global_symbol
            made = kernels[symbol](list(call.args[1].fields), target) if symbol in kernels else None
            if made is None:
                return call
            if isinstance(made, Composite):
                return made.emit(self.builder_, functools.partial(self._stage, symbol, made))
            key, make, tensor_args, *kernel_out = made
            if (symbol, key) not in self.added:
                name = "_".join([symbol.replace(".", "_"), *(str(k).replace(".", "p") for k in key)])
                self.added[(symbol, key)] = self.builder_.add_func(
                    _tag(make().with_attr("global_symbol", name), symbol, key, ""), name)
            out = list(call.ty.fields) if isinstance(call.ty, relax.TupleType) else call.ty
            tensor_args = [self.builder_.emit(a) if isinstance(a, relax.Call) else a for a in tensor_args]
            if not kernel_out:
                return relax.call_tir(self.added[(symbol, key)], relax.Tuple(tensor_args), out_ty=out)
            y = self.builder_.emit(relax.call_tir(self.added[(symbol, key)], relax.Tuple(tensor_args),
                                                  out_ty=kernel_out[0]))
            return relax.op.reshape(y, call.ty.shape)

    @tvm.transform.module_pass(opt_level=0, name="LowerK3Calls")
    def lower(mod, ctx):
        m = Lower(mod)
        for gv, func in mod.functions_items():
            if isinstance(func, relax.Function):
                m.builder_.update_func(gv, m.visit_expr(func))
        return m.builder_.get()

    return lower
