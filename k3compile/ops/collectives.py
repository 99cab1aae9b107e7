"""`k3::all_reduce`: the sum of a tensor over the ranks of an expert-parallel group (docs/architecture.md,
"Sharding and the runtime").

A rank of expert parallelism holds a slice of every layer's routed experts; the latent partial sum of its slice
goes through this op, which returns the sum over all slices. The op is where a rank's graph talks to the others:

- eager and single process (no reducer installed): the identity (a world of one rank), so a rank's graph runs
  anywhere for inspection, and onnxruntime runs its ONNX (the function body is `Identity`);
- in a worker of `k3compile run` (runtime/worker.py): `set_reducer` installs an in-place all-reduce over
  torch.distributed, which the eager op and the compiled graph's extern call both reach. The TVM call writes the
  result into its output through DLPack (no copy besides that one into the output).

`tag` numbers the call (the decoder layer), so that the runtime can check each collective against its step schedule
and account for its bytes.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from k3compile.ops.spec import OpSpec

Reducer = Callable[[Tensor, int], None]  # (tensor, tag): reduce in place
_reducer: Reducer | None = None


def set_reducer(fn: Reducer | None) -> None:
    """Install (or with None remove) this process's all-reduce."""
    global _reducer
    _reducer = fn


def _reduce_into(out: Tensor, tag: int) -> None:
    if _reducer is not None:
        _reducer(out, int(tag))


def all_reduce_eager(x: Tensor, tag: int = 0) -> Tensor:
    out = x.clone()
    _reduce_into(out, tag)
    return out


all_reduce = torch.library.custom_op("k3::all_reduce", all_reduce_eager, mutates_args=())


@all_reduce.register_fake
def _(x, tag=0):
    return torch.empty_like(x)


# ---- ONNX: k3.AllReduce(x) {tag} -> y, body Identity (one rank) ----------------------------------------------------
ONNX_NAME = "AllReduce"


def onnx_schemas():
    from k3compile.ops.onnx_body import schema

    return [schema(ONNX_NAME, [("x", "T", False)], [("y", "T")], {"tag": int}, {"T": ["tensor(float)"]},
                   "Sum of x over the ranks of the expert-parallel group (tag: which call, for the runtime's "
                   "schedule). A single process is a group of one: the identity.")]


def onnx_function(opset: int):
    from k3compile.ops.onnx_body import Body

    b = Body()
    b.op("Identity", "x", name="y")
    return b.function(ONNX_NAME, ["x"], ["y"], ["tag"], opset, onnx_schemas()[0].doc)


def onnx_translation(x, tag=0):
    from onnxscript.values import Opset

    return getattr(Opset("k3", 1), ONNX_NAME)(x, tag=int(tag))


# ---- TVM: a call of the extern `k3.all_reduce`, served in every process by the reducer installed there -------------
TVM_SYMBOL = "k3.all_reduce"


def tvm_convert(bb, inputs, attrs):
    import tvm
    from tvm import relax

    (x,) = inputs
    return relax.call_dps_packed(TVM_SYMBOL, [x, relax.prim_value(tvm.tirx.IntImm("int64", int(attrs["tag"])))],
                                 relax.TensorType(x.ty.shape, x.ty.dtype))


def _tvm_reference(x, tag, out) -> None:
    y = torch.from_dlpack(out)
    y.copy_(torch.from_dlpack(x))
    _reduce_into(y, tag)


SPEC = OpSpec(
    "k3::all_reduce", onnx_schemas, {ONNX_NAME: onnx_function}, onnx_translation,
    tvm_converters={ONNX_NAME: tvm_convert}, tvm_references={TVM_SYMBOL: _tvm_reference},
)
