"""The k3 custom ops (torch.library namespace `k3`): where K3 departs from what ONNX and TVM already know.

Each op is one module owning its levels: the eager torch reference(s), the fake (shape) implementation that
lets `torch.export` trace the model with the op as one node, its ONNX schema, standard-op function body and the
translation torch.onnx uses, all declared in the module's `SPEC` (spec.OpSpec). Importing a module registers its
torch op. `SPECS` is the registry, callees first (a body's k3 nodes must be defined before the body calling them).
"""

from __future__ import annotations

from k3compile.ops import collectives, kda_recurrence, latent_moe_dispatch, mxfp4_matmul
from k3compile.ops.spec import OpSpec

SPECS: tuple[OpSpec, ...] = (mxfp4_matmul.SPEC, kda_recurrence.SPEC, latent_moe_dispatch.SPEC,
                               collectives.ALL_REDUCE_SPEC, collectives.ALL_TO_ALL_SPEC)


def torch_op(spec: OpSpec):
    import torch

    namespace, name = spec.torch_op.split("::")
    return getattr(getattr(torch.ops, namespace), name).default


def translation_table() -> dict:
    """torch op -> translation, for torch.onnx.export's custom_translation_table."""
    return {torch_op(s): s.translation for s in SPECS}


def register_schemas() -> None:
    """Register every k3 ONNX schema (once per process) so that onnx's checker and onnx.reference know them."""
    from k3compile.ops.onnx_body import register

    for spec in SPECS:
        for schema in spec.schemas():
            register(schema)


def function_bodies(opset: int, used: set[str]) -> list:
    """The FunctionProtos of the k3 nodes a graph uses and of the nodes their bodies call, callees first."""
    calls = {name: callees for s in SPECS for name, callees in s.calls.items()}
    need, todo = set(), list(used)
    while todo:
        name = todo.pop()
        if name not in need:
            need.add(name)
            todo += calls.get(name, ())
    return [make(opset) for s in SPECS for name, make in s.bodies.items() if name in need]


def tvm_converters() -> dict:
    """ONNX node name -> converter(bb, inputs, attrs) emitting the Relax call of the op's extern symbol."""
    return {name: conv for s in SPECS for name, conv in s.tvm_converters.items()}


def register_tvm_references() -> list[str]:
    """Register each op's reference implementation (the eager op) under its extern symbol; returns the symbols."""
    import tvm

    for s in SPECS:
        for symbol, fn in s.tvm_references.items():
            tvm.register_global_func(symbol, fn, override=True)
    return [symbol for s in SPECS for symbol in s.tvm_references]
