"""The collectives inside a rank's graph (docs/architecture.md, "Sharding and the runtime"): where a rank's graph
talks to the other ranks of its stage (expert parallelism) or of its tensor-parallel group.

- `k3::all_reduce(x, tag, part)`: the sum of x over a group. Expert parallelism by all-reduce: each rank's latent
  partial sum of its expert slice goes through it before the latent norm, over the stage's ranks (`part` 0); with
  tensor parallelism the attention's and the MLP's / MoE layer's partial outputs, the embedding's lookups and a
  latent MoE's down projection's partial latent, over the tp group (`part` 1, 2, 3, 4: sharding/plan.py's
  AR_PARTS).
- `k3::all_to_all(x, tag, part)`: x is [G, C, ...], one block per rank of the group; block g goes to rank g, and
  the result's block g is what rank g sent here. Expert parallelism by dispatch: the latent tokens, their expert
  ids and weights go to the ranks holding those experts (`part` 0, 1, 2), the weighted expert outputs come back
  (`part` 3).

How they run:
- eager and single process (no collective installed): a world of one rank, so both are the identity: a rank's
  graph runs anywhere for inspection, and onnxruntime runs its ONNX (the function bodies are `Identity`);
- in a worker of `k3compile run` (runtime/worker.py): `set_collective` installs torch.distributed calls over the
  group, which the eager ops and the compiled graph's extern calls both reach; TVM's output is filled in place
  through DLPack (no copy besides the one into the output that all-reduce needs). A GPU rank's launch plan calls
  them as host functions (`host_functions`): the executor downloads x and uploads what they fill
  (executors/plan.py).

`tag` (the decoder layer) and `part` let the runtime check each call against its step schedule and count its bytes.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from k3compile.ops.spec import OpSpec

# (op, x, out, tag, part): fill `out` with the collective of x over the group ("all_reduce" or "all_to_all")
Collective = Callable[[str, Tensor, Tensor, int, int], None]
_collective: Collective | None = None


def set_collective(fn: Collective | None) -> None:
    """Install (or with None remove) this process's collectives."""
    global _collective
    _collective = fn


def _run(op: str, x: Tensor, out: Tensor, tag: int, part: int = 0) -> None:
    if _collective is None:
        out.copy_(x)
    else:
        _collective(op, x, out, int(tag), int(part))


def all_reduce_eager(x: Tensor, tag: int = 0, part: int = 0) -> Tensor:
    out = torch.empty_like(x)
    _run("all_reduce", x.contiguous(), out, tag, part)
    return out


def all_to_all_eager(x: Tensor, tag: int = 0, part: int = 0) -> Tensor:
    out = torch.empty_like(x)
    _run("all_to_all", x.contiguous(), out, tag, part)
    return out


all_reduce = torch.library.custom_op("k3::all_reduce", all_reduce_eager, mutates_args=())
all_to_all = torch.library.custom_op("k3::all_to_all", all_to_all_eager, mutates_args=())


@all_reduce.register_fake
def _(x, tag=0, part=0):
    return torch.empty_like(x)


@all_to_all.register_fake
def _(x, tag=0, part=0):
    return torch.empty_like(x)


# ---- ONNX: k3.AllReduce(x) {tag, part}, k3.AllToAll(x) {tag, part}; bodies Identity (a group of one) -------------
ALL_REDUCE = "AllReduce"
ALL_TO_ALL = "AllToAll"
ATTRIBUTES = {ALL_REDUCE: {"tag": int, "part": int}, ALL_TO_ALL: {"tag": int, "part": int}}


def onnx_schemas():
    from k3compile.ops.onnx_body import schema

    return [
        schema(ALL_REDUCE, [("x", "T", False)], [("y", "T")], ATTRIBUTES[ALL_REDUCE], {"T": ["tensor(float)"]},
               "Sum of x over a group of ranks (tag, part: which call and group, for the runtime's schedule). "
               "A single process is a group of one: the identity."),
        schema(ALL_TO_ALL, [("x", "T", False)], [("y", "T")], ATTRIBUTES[ALL_TO_ALL],
               {"T": ["tensor(float)", "tensor(int64)"]},
               "x [G, C, ...]: block g goes to rank g of the expert-parallel group; y's block g came from rank g "
               "(tag, part: which call). A single process is a group of one: the identity."),
    ]


def onnx_function(name: str, opset: int):
    from k3compile.ops.onnx_body import Body

    b = Body()
    b.op("Identity", "x", name="y")
    doc = next(s.doc for s in onnx_schemas() if s.name == name)
    return b.function(name, ["x"], ["y"], list(ATTRIBUTES[name]), opset, doc)


def all_reduce_translation(x, tag=0, part=0):
    from onnxscript.values import Opset

    return getattr(Opset("k3", 1), ALL_REDUCE)(x, tag=int(tag), part=int(part))


def all_to_all_translation(x, tag=0, part=0):
    from onnxscript.values import Opset

    return getattr(Opset("k3", 1), ALL_TO_ALL)(x, tag=int(tag), part=int(part))


# ---- TVM: calls of the externs `k3.all_reduce` / `k3.all_to_all`, served by the collectives installed -------------
SYMBOLS = {ALL_REDUCE: "k3.all_reduce", ALL_TO_ALL: "k3.all_to_all"}


def tvm_convert(name: str):
    def convert(bb, inputs, attrs):
        import tvm
        from tvm import relax

        (x,) = inputs
        args = [x, *(relax.prim_value(tvm.tirx.IntImm("int64", int(attrs[a]))) for a in ATTRIBUTES[name])]
        return relax.call_dps_packed(SYMBOLS[name], args, relax.TensorType(x.ty.shape, x.ty.dtype))

    return convert


def _tvm_all_reduce(x, tag, part, out) -> None:
    _run("all_reduce", torch.from_dlpack(x), torch.from_dlpack(out), tag, part)


def _tvm_all_to_all(x, tag, part, out) -> None:
    _run("all_to_all", torch.from_dlpack(x), torch.from_dlpack(out), tag, part)


def host_functions() -> dict:
    """symbol -> the collective on host arrays (x, tag, part, out), as a GPU rank's launch plan calls it."""
    def wrap(fn):
        return lambda *a: fn(*(torch.from_numpy(x) if hasattr(x, "__array_interface__") else x for x in a))

    return {SYMBOLS[ALL_REDUCE]: wrap(_tvm_all_reduce), SYMBOLS[ALL_TO_ALL]: wrap(_tvm_all_to_all)}


ALL_REDUCE_SPEC = OpSpec(
    "k3::all_reduce", lambda: onnx_schemas()[:1], {ALL_REDUCE: lambda opset: onnx_function(ALL_REDUCE, opset)},
    all_reduce_translation, tvm_converters={ALL_REDUCE: tvm_convert(ALL_REDUCE)},
    tvm_references={SYMBOLS[ALL_REDUCE]: _tvm_all_reduce},
)
ALL_TO_ALL_SPEC = OpSpec(
    "k3::all_to_all", lambda: onnx_schemas()[1:], {ALL_TO_ALL: lambda opset: onnx_function(ALL_TO_ALL, opset)},
    all_to_all_translation, tvm_converters={ALL_TO_ALL: tvm_convert(ALL_TO_ALL)},
    tvm_references={SYMBOLS[ALL_TO_ALL]: _tvm_all_to_all},
)
