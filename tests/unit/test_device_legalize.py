"""Phase 4, device-legalize (passes/device_legalize.py): for WebGPU, main's int64 becomes int32, its boolean tensors
are stored as int32 between kernels and `power` takes no negative base, while the program computes the same numbers.

The numbers: the module before and after the phase, both compiled for this CPU (the rewrite is plain Relax), on the
same inputs: integer results equal exactly, float ones to 1e-6 relative (x·x·x against pow(x, 3): a rounding or
two). What reaches the device: after phases 4-6 for WebGPU, no kernel of main takes or makes an int64 or bool tensor.
"""

from __future__ import annotations

import numpy as np
import pytest
import tvm
from k3compile.passes import run_phases
from k3compile.passes.device_legalize import device_legalize, needed
from k3compile.targets import resolve
from tvm import relax

from k3compile.interface import ExportError

LLVM = resolve()
VOCAB = 256


def _module(big_constant: int = VOCAB):
    """main(ids int64 [b, s], mask int64 [b, s], x f32 [b, s] | e f32 [] (a lifted exponent), flag bool []):
    what K3's graph does with integers and truth values: negative ids wrapped, positions from arange, the mask as
    bool and-ed with a flag, top-k indices, a shape as a tensor, squares through power."""
    b, s = tvm.tirx.Var("batch", "int64"), tvm.tirx.Var("seq", "int64")
    ids = relax.Var("ids", relax.TensorType([b, s], "int64"))
    mask = relax.Var("mask", relax.TensorType([b, s], "int64"))
    x = relax.Var("x", relax.TensorType([b, s], "float32"))
    e = relax.Var("e", relax.TensorType([], "float32"))
    flag = relax.Var("flag", relax.TensorType([], "bool"))
    op = relax.op
    bb = relax.BlockBuilder()
    with bb.function("main", [ids, mask, x, e, flag], attrs={"num_input": 3}):
        with bb.dataflow():
            wrapped = bb.emit(op.where(op.less(ids, relax.const(0, "int64")),
                                       op.add(ids, relax.const(big_constant, "int64")), ids))
            pos = bb.emit(op.reshape(op.arange(0, s, 1, dtype="int64"), [1, s]))
            keep = bb.emit(op.logical_and(op.astype(mask, "bool"), op.broadcast_to(flag, [b, s])))
            keep = bb.emit(op.where(keep, op.broadcast_to(flag, [b, s]), relax.const(False, "bool")))
            top = bb.emit(op.topk(x, 1, -1, "both", True, "int64"))
            idx = bb.emit(relax.TupleGetItem(top, 1))  # [b, 1]
            shape = bb.emit(op.shape_to_tensor(op.shape_of(x)))
            squares = bb.emit(op.add(op.power(x, e), op.power(x, relax.const(3.0, "float32"))))
            seq = bb.emit(op.take(shape, relax.const(1, "int64"), axis=0))
            ints = bb.emit(op.add(op.add(op.add(wrapped, pos), idx), seq))
            out = bb.emit(op.where(keep, op.add(squares, op.astype(ints, "float32")), relax.const(-1.0, "float32")))
            out = bb.emit_output(relax.Tuple([out, ints]))
        bb.emit_func_output(out)
    return bb.get()


def _run(mod, args):
    mod = run_phases(mod, LLVM, start="legalize-fuse")
    ex = tvm.compile(mod, target=LLVM.tvm(), relax_pipeline=tvm.transform.Sequential(LLVM.finish_passes()))
    vm = relax.VirtualMachine(ex, tvm.cpu())
    return [t.numpy() for t in vm["main"](*(tvm.runtime.tensor(a) for a in args))]


def _args(narrow: bool):
    rng = np.random.default_rng(0)
    ids = np.array([[3, -2, 7, 250], [-256, 0, 9, 1]], np.int64)
    mask = np.array([[0, 1, 1, 1], [1, 1, 0, 1]], np.int64)
    x = rng.standard_normal((2, 4)).astype(np.float32)  # negative bases included
    e, flag = np.array(2.0, np.float32), np.array(True)
    if narrow:
        return [ids.astype(np.int32), mask.astype(np.int32), x, e, flag.astype(np.int32)]
    return [ids, mask, x, e, flag]


def test_the_phase_applies_only_where_the_language_lacks_the_types():
    assert needed(resolve("webgpu")) and not needed(LLVM) and not needed(resolve("opencl"))
    mod = _module()
    assert device_legalize(LLVM)(mod).same_as(mod)  # left as it is, not rebuilt


def test_the_legalized_program_computes_the_same_numbers():
    before = _module()
    after = device_legalize(resolve("webgpu"))(before)
    main = after["main"]
    assert [str(p.ty.dtype) for p in main.params] == ["int32", "int32", "float32", "float32", "int32"]
    assert "int64" not in str(main.ret_ty)
    want = _run(before, _args(narrow=False))
    got = _run(after, _args(narrow=True))
    assert got[1].dtype == np.int32 and np.array_equal(got[1], want[1])  # the integers, exactly
    np.testing.assert_allclose(got[0], want[0], rtol=1e-6, atol=1e-6)
    assert np.isfinite(got[0]).all()  # pow of a negative base: squares, not NaN


def test_after_fusion_no_kernel_of_main_takes_int64_or_bool():
    mod = run_phases(device_legalize(resolve("webgpu"))(_module()), resolve("webgpu"), start="legalize-fuse")
    call_tir = tvm.ir.Op.get("relax.call_tir")
    seen = set()

    def visit(expr):
        if isinstance(expr, relax.Call) and expr.op.same_as(call_tir):
            for t in [*expr.args[1].fields, expr]:
                ty = t.ty
                for f in ty.fields if isinstance(ty, relax.TupleType) else [ty]:
                    if isinstance(f, relax.TensorType):
                        seen.add(str(f.dtype))

    relax.analysis.post_order_visit(mod["main"], visit)
    assert seen and not seen & {"int64", "bool"}, seen


def test_a_constant_that_does_not_fit_is_refused_naming_it():
    with pytest.raises(ExportError, match=r"int64 constant of the graph \(4294967296\) does not fit in 32 bits"):
        run_phases(_module(big_constant=2**32), resolve("webgpu"), start="device-legalize", upto="device-legalize")


def _finite_guard():
    """main(x f32 [n]): the guard in front of ONNX's float-to-integer Cast as TVM's importer writes it (non-finite
    values to 0, through isfinite)."""
    n = tvm.tirx.Var("n", "int64")
    x = relax.Var("x", relax.TensorType([n], "float32"))
    op = relax.op
    bb = relax.BlockBuilder()
    with bb.function("main", [x], attrs={"num_input": 1}):
        with bb.dataflow():
            clean = bb.emit(op.where(op.logical_not(op.isfinite(x)), relax.const(0.0, "float32"), x))
            out = bb.emit_output(relax.Tuple([clean]))  # (the cast after it: of finite values only)
        bb.emit_func_output(out)
    return bb.get()


def test_isfinite_is_written_without_an_infinity_for_wgsl():
    """WGSL cannot write an infinite constant (TVM prints `inff`, which wgpu's shader compiler refuses: a sharded
    WebGPU rank's all-to-all casts its fp32 expert ids back to integers): isfinite becomes |x| <= FLT_MAX, with the
    same truth for ±inf, NaN, the largest finite values and ordinary ones."""
    before = _finite_guard()
    after = device_legalize(resolve("webgpu"))(before)
    assert "isfinite" in before.script() and "isfinite" not in after.script()
    big = np.finfo(np.float32).max
    x = np.array([np.inf, -np.inf, np.nan, big, -big, 3.7, -2.2, 0.0], np.float32)
    want, got = _run(before, [x])[0], _run(after, [x])[0]
    assert np.array_equal(got, want) and np.array_equal(got, np.where(np.isfinite(x), x, 0))
