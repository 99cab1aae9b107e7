"""ONNX -> TVM Relax: the k3 graph imported with its symbolic batch / sequence / past dims (docs/architecture.md,
"The compile path").

TVM's ONNX importer has no hook for custom converters and looks ops up by name only, so `to_relax` wraps the
module-level `_get_convert_map()` for the duration of one import (restored after, even on error) with:
- a converter for every k3 node, taken from the op registry (`OpSpec.tvm_converters`): each emits a Relax call of
  the op's extern symbol `k3.<op>` with the node's attributes as arguments;
- two fixes for standard ops as torch.export writes them, where the 0.27 importer loses a shape (and fails later on
  a Reshape of a tensor of unknown shape):
  * `Reshape` of a scalar taken from a shape (Shape -> Squeeze -> Sub): the importer keeps such a scalar as a
    symbolic PrimExpr but its Reshape takes only tensors; the scalar becomes a one-element shape value, which stays
    symbolic, instead.
  * `Slice` with an "until the end" bound (INT64_MAX) and a symbolic start: the importer assumes in-bound indices,
    so the extent came out as INT64_MAX - start; the bound becomes the dimension itself.
  * `Gather` (the embedding lookup) as a take in mode "clip" rather than TVM's default "fast", whose legalization
    prints "Fast mode segfaults when there are out-of-bounds indices" on every compile (`_take_clipped`).
  * `Einsum` as Relax's `einsum` op rather than the importer's TE call: its subscripts stay visible, so phase 5 can
    give MLA's score contraction a kernel of its own (passes/lower_attention.py); LegalizeOps lowers the others to
    the same TE the importer wrote.
Model-local function bodies are never read (the k3 converters replace them).
"""

from __future__ import annotations

import contextlib
import warnings

from k3compile.interface import ExportError

INT64_OPEN = 2**62  # a Slice end at least this large means "to the end of the axis"


def _fixed_converters(base: dict) -> dict:
    import tvm
    from tvm import relax

    reshape, slice_, gather, einsum = base["Reshape"], base["Slice"], base["Gather"], base["Einsum"]

    class Reshape(reshape):
        @classmethod
        def _impl_v13(cls, bb, inputs, attr, params):
            data = inputs[0]
            if isinstance(getattr(data, "ty", None), tvm.ir.PrimType):  # a scalar computed from a shape
                inputs = [relax.ShapeExpr([data]), *inputs[1:]]
            return reshape._impl_v13(bb, inputs, attr, params)

    class Slice(slice_):
        @classmethod
        def _impl_v13(cls, bb, inputs, attr, params):
            data, ends = inputs[0], inputs[2]
            axes = inputs[3] if len(inputs) > 3 else None
            shape = getattr(getattr(data, "ty", None), "shape", None)
            if isinstance(ends, tvm.ir.GenericConst) and shape is not None:
                e = ends.value.numpy().tolist()
                if any(v >= INT64_OPEN for v in e):
                    ax = axes.value.numpy().tolist() if isinstance(axes, tvm.ir.GenericConst) else list(range(len(e)))
                    dims = [shape[a % len(shape)] if v >= INT64_OPEN else tvm.tirx.IntImm("int64", v)
                            for v, a in zip(e, ax)]
                    inputs = [inputs[0], inputs[1], relax.ShapeExpr(dims), *inputs[3:]]
            return slice_._impl_v13(bb, inputs, attr, params)

    class Gather(gather):
        @classmethod
        def _impl_v13(cls, bb, inputs, attr, params):
            return _take_clipped(gather._impl_v13(bb, inputs, attr, params))

    class Einsum(einsum):
        @classmethod
        def _impl_v12(cls, bb, inputs, attr, params):
            return relax.op.einsum(list(inputs), attr["equation"].decode("utf-8"))

    return {"Reshape": Reshape, "Slice": Slice, "Gather": Gather, "Einsum": Einsum}


def _take_clipped(expr):
    """A take in TVM's default mode "fast" (no bounds handling) as the same take in mode "clip". The "fast" mode has
    topi print a warning on every compile (C++ LOG(WARNING) to stderr, with no switch) about out-of-bounds indices
    segfaulting. It does not apply here: the only such take is the embedding lookup, whose token ids every backend
    checks against the vocabulary before each step (interface.check_step), so "clip" never clips; it costs a min and
    a max per element, and an unchecked id past the vocabulary would read the last row instead of other memory."""
    from tvm import relax

    if isinstance(expr, relax.Call) and getattr(expr.op, "name", None) == "relax.take" and expr.attrs.mode == "fast":
        return relax.op.take(expr.args[0], expr.args[1], expr.attrs.axis, mode="clip")
    return expr


def _k3_converters() -> dict:
    from tvm.relax.frontend.onnx import onnx_frontend as ofe

    from k3compile.ops import tvm_converters

    def converter(name, convert):
        def impl(cls, bb, inputs, attr, params):
            return convert(bb, inputs, attr)

        return type(name, (ofe.OnnxOpConverter,), {"_impl_v1": classmethod(impl)})

    return {name: converter(name, convert) for name, convert in tvm_converters().items()}


@contextlib.contextmanager
def k3_frontend():
    """The importer's convert map with the k3 converters and the fixes, for the duration of the block."""
    from tvm.relax.frontend.onnx import onnx_frontend as ofe

    original = ofe._get_convert_map
    extra = {**_fixed_converters(original()), **_k3_converters()}
    ofe._get_convert_map = lambda: {**original(), **extra}
    try:
        yield
    finally:
        ofe._get_convert_map = original


def _integer_initializers_as_constants(model_proto):
    """A copy whose int64 initializers (shapes, indices, axes) are Constant nodes: lifted to parameters they would
    no longer be constants to the importer, and every Reshape to such a shape would lose its shape."""
    import onnx
    from onnx import TensorProto, helper

    m = onnx.ModelProto()
    m.CopyFrom(model_proto)
    ints = [i for i in m.graph.initializer if i.data_type == TensorProto.INT64]
    weights = [i for i in m.graph.initializer if i.data_type != TensorProto.INT64]
    nodes = [helper.make_node("Constant", [], [i.name], value=i) for i in ints] + list(m.graph.node)
    del m.graph.initializer[:]
    m.graph.initializer.extend(weights)
    del m.graph.node[:]
    m.graph.node.extend(nodes)
    return m


SCALARS = "k3.scalar_weights"  # module attr: {name: value} of the 0-d float weights (passes/exact_powers.py)


def to_relax(model_proto, keep_params: bool = False):
    """The Relax IRModule of a k3 ONNX ModelProto: `main(input_ids, attention_mask, past...)` with symbolic batch,
    seq and past, each k3 node a call of its extern symbol. The weights are constants in the module, or with
    `keep_params` parameters after the graph inputs: then returns (module, weight names, weight tensors)."""
    import tvm
    from tvm.relax.frontend import detach_params
    from tvm.relax.frontend.onnx import from_onnx

    if keep_params:
        model_proto = _integer_initializers_as_constants(model_proto)
    with k3_frontend(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            mod = from_onnx(model_proto, keep_params_in_input=keep_params)
        except tvm.error.OpNotImplemented as e:
            raise ExportError(f"TVM cannot import this graph: {str(e).splitlines()[0]}") from None
    if not keep_params:
        return mod
    mod, params = detach_params(mod)
    main = mod["main"]
    names = [p.name for p in main.params[int(main.attrs["num_input"]):]]
    weights = list(params["main"])
    # the scalar float weights' values, for the passes that need a constant (passes/exact_powers.py)
    scalars = {n: float(w.numpy()) for n, w in zip(names, weights)
               if len(w.shape) == 0 and str(w.dtype) in ("float32", "float64")}
    return mod.with_attr(SCALARS, scalars), names, weights
