"""A small builder for the standard-ONNX function bodies of the k3 ops (domain `k3`, version 1).

Each k3 op ships a model-local FunctionProto whose body uses standard ops only, so onnxruntime and
`onnx.reference` run an exported model with no extra kernels. `Body` names intermediate values, makes constants
(also ones that read the calling node's attributes) and emits the FunctionProto or an If branch graph.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import AttributeProto, TensorProto, helper, numpy_helper

from k3compile.modes import Activation, ActQuant

DOMAIN = "k3"
VERSION = 1
ATTR_TYPES = {int: AttributeProto.INT, float: AttributeProto.FLOAT}


class Body:
    def __init__(self, prefix: str = "") -> None:
        self.nodes: list[onnx.NodeProto] = []
        self.prefix = prefix
        self._n = 0

    def _name(self, hint: str) -> str:
        self._n += 1
        return f"{self.prefix}{hint}_{self._n}"

    def op(self, op_type: str, *inputs: str, outputs: int = 1, domain: str = "", name: str | None = None,
           **attrs) -> str | list[str]:
        outs = [name or self._name(op_type.lower())] if outputs == 1 else [self._name(op_type.lower())
                                                                          for _ in range(outputs)]
        self.nodes.append(helper.make_node(op_type, list(inputs), outs, domain=domain, **attrs))
        return outs[0] if outputs == 1 else outs

    def const(self, value, dtype=np.float32) -> str:
        out = self._name("c")
        t = numpy_helper.from_array(np.array(value, dtype=dtype), out)
        self.nodes.append(helper.make_node("Constant", [], [out], value=t))
        return out

    def attr(self, ref: str, kind: type) -> str:
        """A scalar Constant holding the calling node's attribute `ref` (int -> int64, float -> float32)."""
        out = self._name(ref)
        key = "value_int" if kind is int else "value_float"
        node = helper.make_node("Constant", [], [out])
        node.attribute.append(helper.make_attribute_ref(key, ATTR_TYPES[kind], ref_attr_name=ref))
        self.nodes.append(node)
        return out

    def graph(self, name: str, outputs: list[str]) -> onnx.GraphProto:
        """This body as an If branch (no inputs; it reads outer-scope values)."""
        return helper.make_graph(self.nodes, name, [], [helper.make_tensor_value_info(o, TensorProto.FLOAT, None)
                                                        for o in outputs])

    def function(self, name: str, inputs: list[str], outputs: list[str], attributes: list[str],
                 opset: int, doc: str) -> onnx.FunctionProto:
        imports = [helper.make_opsetid("", opset), helper.make_opsetid(DOMAIN, VERSION)]
        return helper.make_function(DOMAIN, name, inputs, outputs, self.nodes, imports, attributes, doc_string=doc)


def select(b: Body, cond: str, then_fn, else_fn, hint: str) -> str:
    """If(cond) then then_fn(branch_body) else else_fn(branch_body): each returns its output value's name."""
    branches = []
    for i, fn in enumerate((then_fn, else_fn)):
        sub = Body(prefix=f"{b.prefix}{hint}{b._n}_{i}_")
        out = fn(sub)
        out = sub.op("Identity", out)
        branches.append(sub.graph(f"{hint}_{'then' if i == 0 else 'else'}", [out]))
    return b.op("If", cond, then_branch=branches[0], else_branch=branches[1])


def schema(name: str, inputs: list[tuple[str, str, bool]], outputs: list[tuple[str, str]],
           attributes: dict[str, type], types: dict[str, list[str]], doc: str) -> onnx.defs.OpSchema:
    """An OpSchema of domain k3 v1. inputs: (name, type var, optional); outputs: (name, type var)."""
    fp = onnx.defs.OpSchema.FormalParameter
    opt = onnx.defs.OpSchema.FormalParameterOption
    return onnx.defs.OpSchema(
        name, DOMAIN, VERSION, doc,
        inputs=[fp(n, t, param_option=opt.Optional if o else opt.Single) for n, t, o in inputs],
        outputs=[fp(n, t) for n, t in outputs],
        type_constraints=[(v, allowed, "") for v, allowed in types.items()],
        attributes=[onnx.defs.OpSchema.Attribute(a, ATTR_TYPES[k], "", required=True) for a, k in attributes.items()],
    )


def register(s: onnx.defs.OpSchema) -> None:
    """Register once per process (a second registration of the same op raises in onnx)."""
    try:
        onnx.defs.get_schema(s.name, s.since_version, s.domain)
    except onnx.defs.SchemaError:
        onnx.defs.register_schema(s)


NAN = float("nan")
# Integer attribute codes of the mode names (modes.py owns the names; ONNX attributes carry the codes).
ACT_QUANT_CODES = {q.value: i for i, q in enumerate(ActQuant)}  # none 0, e4m3 1, e5m2 2
ACTIVATION_CODES = {a.value: i for i, a in enumerate(Activation)}  # silu 0, situ 1


def matmul_transposed(b: Body, x: str, w: str) -> str:
    """x [..., M, K] @ w[..., N, K]^T -> [..., M, N], leading dims broadcast numpy-style (any ranks): MatMul with w's
    last two dims swapped (a one-input Einsum, valid for any rank of w)."""
    return b.op("MatMul", x, b.op("Einsum", w, equation="...nk->...kn"))
