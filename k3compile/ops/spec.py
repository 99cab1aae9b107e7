"""What one k3 op declares, so that the exporter (and the compile path's converters) iterate a registry instead of
hand-kept tables: its torch op, its ONNX node names with their schemas and function-body builders, and the
translation torch.onnx uses. A leaf (docs/architecture.md, "The op registry")."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass(frozen=True)
class OpSpec:
    torch_op: str  # "k3::kda_recurrence": the torch.library op the model calls
    schemas: Callable[[], list]  # its ONNX OpSchemas (domain k3, version 1), one per node name
    bodies: dict[str, Callable[[int], object]]  # ONNX node name -> builder(opset) of its standard-op FunctionProto
    translation: Callable  # torch.onnx custom translation: the op's arguments -> a k3 node
    calls: dict[str, tuple[str, ...]] = field(default_factory=dict)  # node name -> k3 nodes inside its body
    # TVM: ONNX node name -> converter(bb, inputs, attrs) emitting a Relax call of the extern symbol `k3.<op>`
    # (frontend.py), and extern symbol -> the reference implementation registered under that name (the eager
    # op through DLPack) until a lowering pass replaces the call with a TIR kernel (docs/architecture.md).
    tvm_converters: dict[str, Callable] = field(default_factory=dict)
    tvm_references: dict[str, Callable] = field(default_factory=dict)

    @property
    def onnx_names(self) -> tuple[str, ...]:
        return tuple(self.bodies)
