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
"""

from __future__ import annotations

import functools
import operator
from collections.abc import Callable


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


def kda_factory(args, target=None):
    """k3.kda_recurrence(q, k, v, g, beta, state): the chunked kernel (its tail runs decode's single token),
    specialized to (H, K, V)."""
    from k3compile.kernels.kda import kda_chunked_kernel

    q, v = args[0].ty.shape, args[2].ty.shape
    sizes = (_static(q[2]), _static(q[3]), _static(v[3]))
    if None in sizes:
        return None
    return sizes, lambda: kda_chunked_kernel(*sizes), list(args)


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
    if target is not None and target.expert_layout != "kn":
        return None
    key = (experts, inter, width, offset, activation, beta, linear_beta, act_quant)
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
    if None in (n, k) or k % 32 or (target is not None and target.expert_layout != "kn"):
        return None
    xs = x.ty.shape  # a ShapeExpr indexes but does not slice
    rows = functools.reduce(operator.mul, [xs[i] for i in range(len(xs) - 1)], tvm.tirx.IntImm("int64", 1))
    tensors = [relax.op.reshape(x, [rows, k]), relax.op.permute_dims(packed, [1, 0]),
               relax.op.permute_dims(scale, [1, 0])]
    out = relax.TensorType([rows, n], "float32")
    return (k, n, act_quant), lambda: mxfp4_matmul_kernel(k, n, act_quant), tensors, out


KERNELS: dict[str, Callable] = {
    "k3.kda_recurrence": kda_factory,
    "k3.latent_moe_dispatch_mxfp4": moe_factory,
    "k3.latent_moe_dispatch": functools.partial(moe_factory, mx=False),
    "k3.mxfp4_matmul": mxfp4_matmul_factory,
}


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

        def visit_call_(self, call):
            call = self.visit_expr_post_order(call)
            if not (call.op.same_as(call_dps) and isinstance(call.args[0], relax.ExternFunc)):
                return call
            symbol = call.args[0].global_symbol
            made = kernels[symbol](list(call.args[1].fields), target) if symbol in kernels else None
            if made is None:
                return call
            key, make, tensor_args, *kernel_out = made
            if (symbol, key) not in self.added:
                name = "_".join([symbol.replace(".", "_"), *(str(k).replace(".", "p") for k in key)])
                self.added[(symbol, key)] = self.builder_.add_func(make().with_attr("global_symbol", name), name)
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
