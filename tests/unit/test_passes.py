"""Each compile phase on its own (passes/, targets/llvm.py): what it rewrites, and that the rewritten program still
computes the same numbers (compiled for this CPU, against numpy in float64; fp32 sums in other orders, so 1e-4
relative to the magnitudes here, observed ~1e-6)."""

from __future__ import annotations

import numpy as np
import pytest
import tvm
from k3compile.passes import PHASE_NAMES, run_phases
from k3compile.targets import resolve
from tvm import relax

TARGET = resolve()


def _matmul_module(k: int, n: int, weight_is_param: bool = True):
    """main(x [b, s, K], w [K, N]) = x @ w (+ 1, an epilogue to fuse); w a weight (after num_input) or an input."""
    b, s = tvm.tirx.Var("b", "int64"), tvm.tirx.Var("s", "int64")
    x = relax.Var("x", relax.TensorType([b, s, k], "float32"))
    w = relax.Var("w", relax.TensorType([k, n], "float32"))
    bb = relax.BlockBuilder()
    with bb.function("main", [x, w], attrs={"num_input": 1 if weight_is_param else 2}):
        with bb.dataflow():
            y = bb.emit(relax.op.matmul(x, w))
            z = bb.emit_output(relax.op.add(y, relax.const(1.0, "float32")))
        bb.emit_func_output(z)
    return bb.get()


def _run(mod, x, w):
    ex = tvm.compile(mod, target=TARGET.tvm(), relax_pipeline=tvm.transform.Sequential(TARGET.finish_passes()))
    vm = relax.VirtualMachine(ex, tvm.cpu())
    weights = [w]
    if "main_transform_params" in [gv.name_hint for gv in mod.get_global_vars()]:
        weights = list(vm["main_transform_params"]([tvm.runtime.tensor(w)]))
    else:
        weights = [tvm.runtime.tensor(w)]
    return vm["main"](tvm.runtime.tensor(x), *weights).numpy()


def test_phases_are_numbered_in_order():
    assert PHASE_NAMES == ("lower-k3-calls", "pack-dense-weights", "lift-weight-transforms", "device-legalize",
                           "legalize-fuse", "schedule")
    with pytest.raises(ValueError, match="unknown phase"):
        run_phases(_matmul_module(64, 64), TARGET, upto="nope")


def test_pack_dense_weights_rewrites_only_matmuls_by_a_weight():
    packed = str(run_phases(_matmul_module(32, 128), TARGET, upto="pack-dense-weights")["main"])
    assert "k3_packed_matmul" in packed and "R.matmul" not in packed
    assert "R.permute_dims" in packed  # [K, N] -> [N/64, K, 64], an expression of the weight only
    by_input = str(run_phases(_matmul_module(32, 128, weight_is_param=False), TARGET,
                              upto="pack-dense-weights")["main"])
    assert "R.matmul" in by_input and "k3_packed_matmul" not in by_input  # an activation: left as it is
    odd = str(run_phases(_matmul_module(32, 100), TARGET, upto="pack-dense-weights")["main"])
    assert "R.matmul" in odd  # N not a multiple of the panel: left as it is


def test_lift_moves_the_relayout_to_the_transform_function():
    mod = run_phases(_matmul_module(32, 128), TARGET, upto="lift-weight-transforms")
    assert "R.permute_dims" not in str(mod["main"]) and "R.permute_dims" in str(mod["main_transform_params"])


@pytest.mark.parametrize("k,n,rows", [(32, 128, 1), (64, 192, 3), (48, 128, 17), (40, 100, 5), (36, 20, 9)])
def test_every_phase_keeps_the_numbers(k, n, rows):
    """Panels (N % 64 == 0) and not; K not a multiple of 4 or of the split; rows not a multiple of the row block."""
    rng = np.random.default_rng(k + n + rows)
    x = rng.standard_normal((1, rows, k), dtype=np.float32)
    w = rng.standard_normal((k, n), dtype=np.float32)
    mod = run_phases(_matmul_module(k, n), TARGET)
    want = x.astype(np.float64) @ w.astype(np.float64) + 1
    np.testing.assert_allclose(_run(mod, x, w), want, rtol=1e-4, atol=1e-4)


def test_schedule_marks_every_primfunc_scheduled_and_parallelizes_the_matmul():
    mod = run_phases(_matmul_module(64, 128), TARGET)
    prims = [f for _, f in mod.functions_items() if isinstance(f, tvm.tirx.PrimFunc)]
    assert prims and all("tirx.is_scheduled" in f.attrs for f in prims)
    text = "\n".join(str(f) for f in prims)
    assert "T.parallel" in text and "T.vectorized" in text


def test_dump_ir_writes_every_phase(tmp_path):
    run_phases(_matmul_module(32, 64), TARGET, dump_dir=tmp_path)
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == ["00-imported.py"] + [f"{i:02d}-{n}.py" for i, n in enumerate(PHASE_NAMES, start=1)]
    assert "k3_packed_matmul" in (tmp_path / "02-pack-dense-weights.py").read_text()


def test_targets_unknown_and_unbuildable_are_named():
    from k3compile.interface import ExportError

    with pytest.raises(ExportError, match="unknown target 'foo'"):
        resolve("foo")
    with pytest.raises(ExportError, match="target 'vulkan': this TVM build has no SPIR-V code generator"):
        resolve("vulkan")
    with pytest.raises(ExportError, match="target 'rocm' needs a ROCm install"):
        resolve("rocm")


def test_llvm_target_never_promises_vector_features_this_cpu_lacks():
    """A library built for the CPU model's features where the VM masks some dies with SIGILL."""
    from tvm.target import codegen

    flags = next(line.split(":", 1)[1].split() for line in open("/proc/cpuinfo") if line.startswith("flags"))
    promised = set(str(f) for f in codegen.llvm_get_cpu_features(TARGET.tvm()))
    if "avx512f" not in flags:
        assert "avx512f" not in promised
    assert ("avx2" in promised) == ("avx2" in flags)


def _attention_funcs():
    """TE versions of the MLA attention contractions: scores (b, h, t, s) = q (b, t, h, c) · kv (b, s, c), a dot
    along contiguous rows; out (b, t, h, c) = p (b, h, t, s) · kv (b, s, c), a matmul over a symbolic length."""
    from tvm import te

    b, t, s = (tvm.tirx.Var(n, "int64") for n in ("b", "t", "s"))
    h, c = 2, 32
    q = te.placeholder((b, t, h, c), name="q")
    kv = te.placeholder((b, s, c), name="kv")
    p = te.placeholder((b, h, t, s), name="p")
    rc = te.reduce_axis((0, c), "rc")
    scores = te.compute((b, h, t, s), lambda i, j, k, m: te.sum(q[i, k, j, rc] * kv[i, m, rc], axis=rc), name="sc")
    rs = te.reduce_axis((0, s), "rs")
    out = te.compute((b, t, h, c), lambda i, k, j, n: te.sum(p[i, j, k, rs] * kv[i, rs, n], axis=rs), name="pv")
    return te.create_prim_func([q, kv, scores]), te.create_prim_func([p, kv, out])


@pytest.mark.parametrize("t,s", [(1, 1), (3, 5), (17, 40)])
def test_attention_schedules_keep_the_numbers(t, s):
    from k3compile.targets.llvm import schedule_func

    f_scores, f_pv = (schedule_func(f) for f in _attention_funcs())
    rng = np.random.default_rng(t * 100 + s)
    q = rng.standard_normal((1, t, 2, 32), dtype=np.float32)
    kv = rng.standard_normal((1, s, 32), dtype=np.float32)
    p = rng.standard_normal((1, 2, t, s), dtype=np.float32)
    lib_s = tvm.compile(f_scores.with_attr("global_symbol", "main"), target=TARGET.tvm())
    lib_p = tvm.compile(f_pv.with_attr("global_symbol", "main"), target=TARGET.tvm())
    got_s, got_p = tvm.runtime.empty((1, 2, t, s), "float32"), tvm.runtime.empty((1, t, 2, 32), "float32")
    lib_s["main"](tvm.runtime.tensor(q), tvm.runtime.tensor(kv), got_s)
    lib_p["main"](tvm.runtime.tensor(p), tvm.runtime.tensor(kv), got_p)
    np.testing.assert_allclose(got_s.numpy(), np.einsum("bthc,bsc->bhts", q.astype(np.float64), kv), rtol=1e-4,
                               atol=1e-4)
    np.testing.assert_allclose(got_p.numpy(), np.einsum("bhts,bsc->bthc", p.astype(np.float64), kv), rtol=1e-4,
                               atol=1e-4)


def _conv_funcs():
    """TE versions of the KDA short convolution's two CPU loop nests, time (symbolic) innermost: the state joined
    with the new inputs, cat (b, c, t + 3), and the depthwise conv over it, y (b, c, t) (a reduction)."""
    from tvm import te

    b, t = (tvm.tirx.Var(n, "int64") for n in ("b", "t"))
    c = 256  # enough static work for the parallel loop (targets/llvm.py: 256 elements in a symbolic nest)
    x = te.placeholder((b, t, c), name="x")
    state = te.placeholder((b, c, 3), name="state")
    cat = te.compute((b, c, t + 3), lambda i, j, k: tvm.tirx.if_then_else(
        k >= 3, x[i, tvm.tirx.max(k - 3, 0), j], state[i, j, tvm.tirx.min(k, 2)]), name="cat")
    xs = te.placeholder((b, c, t + 3), name="xs")
    w = te.placeholder((c, 4), name="w")
    r = te.reduce_axis((0, 4), "r")
    conv = te.compute((b, c, t), lambda i, j, k: te.sum(xs[i, j, k + r] * w[j, r], axis=r), name="conv")
    return te.create_prim_func([x, state, cat]), te.create_prim_func([xs, w, conv])


@pytest.mark.parametrize("b,t", [(1, 1), (8, 1), (2, 37)])
def test_loops_over_a_symbolic_time_axis_keep_the_numbers(b, t):
    """The loop rule keeps a symbolic innermost loop out of the fused parallel one (no index division by a runtime
    extent per element), and the transpose rule tiles the join (it reads x along c, writes along t): the loop nests
    say so, and the numbers are numpy's."""
    from k3compile.targets.llvm import TRANSPOSE_TILE, WINDOW_TILE, schedule_func

    f_cat, f_conv = (schedule_func(f) for f in _conv_funcs())
    for f, name, outer_extent in ((f_cat, "cat", 256 // TRANSPOSE_TILE), (f_conv, "conv_update", 256)):
        sch = tvm.s_tir.Schedule(f)
        loops = [sch.get(lp) for lp in sch.get_loops(sch.get_sblock(name))]
        outer, inner = loops[:2]
        assert outer.kind == tvm.tirx.ForKind.PARALLEL and isinstance(outer.extent, tvm.tirx.Mul)  # b * ...
        assert int(outer.extent.b) == outer_extent
        assert inner.kind == tvm.tirx.ForKind.SERIAL and not isinstance(inner.extent, tvm.tirx.IntImm)  # t (+ 3)
        if name == "cat":  # a tile of 16 channels x 4 steps inside (the time axis is symbolic: a decode's window)
            assert [int(lp.extent) for lp in loops[2:]] == [TRANSPOSE_TILE, WINDOW_TILE]
    rng = np.random.default_rng(b * 100 + t)
    x = rng.standard_normal((b, t, 256), dtype=np.float32)
    state = rng.standard_normal((b, 256, 3), dtype=np.float32)
    w = rng.standard_normal((256, 4), dtype=np.float32)
    lib_c = tvm.compile(f_cat.with_attr("global_symbol", "main"), target=TARGET.tvm())
    lib_v = tvm.compile(f_conv.with_attr("global_symbol", "main"), target=TARGET.tvm())
    cat, y = tvm.runtime.empty((b, 256, t + 3), "float32"), tvm.runtime.empty((b, 256, t), "float32")
    lib_c["main"](tvm.runtime.tensor(x), tvm.runtime.tensor(state), cat)
    want_cat = np.concatenate([state, x.transpose(0, 2, 1)], axis=2)
    np.testing.assert_array_equal(cat.numpy(), want_cat)  # a copy: exact
    lib_v["main"](cat, tvm.runtime.tensor(w), y)
    want = sum(want_cat[:, :, r:r + t].astype(np.float64) * w[None, :, r, None] for r in range(4))
    np.testing.assert_allclose(y.numpy(), want, rtol=1e-5, atol=1e-5)  # four fp32 products summed


def test_a_runtime_count_of_rows_over_a_runtime_length_runs_in_parallel():
    """MLA's mask, where(not allowed [B, 1, T, S], fill, (s1 + s2) · scale) over [B, H, T, S] with only H static: the
    rows (B · H · T, a runtime count) go to the pool however few heads there are (it ran on one core: 158 -> 77 ms
    of a k3-small prefill at T = 2048), S stays a serial loop; the same block with its rows static (decode.so's
    shapes, B = T = 1) stays serial. The numbers are numpy's."""
    from k3compile.targets.llvm import schedule_func
    from tvm import te

    def mask_func(b, t):
        s = tvm.tirx.Var("s", "int64")
        s1, s2 = (te.placeholder((b, 2, t, s), name=n) for n in ("s1", "s2"))
        masked = te.placeholder((b, 1, t, s), dtype="bool", name="masked")
        out = te.compute((b, 2, t, s), lambda i, h, j, k: tvm.tirx.Select(
            masked[i, 0, j, k], tvm.tirx.const(-3e38, "float32"), (s1[i, h, j, k] + s2[i, h, j, k]) * 0.5),
            name="where")
        return schedule_func(te.create_prim_func([s1, s2, masked, out]))

    b, t = (tvm.tirx.Var(n, "int64") for n in ("b", "t"))
    for f, kind in ((mask_func(b, t), tvm.tirx.ForKind.PARALLEL), (mask_func(1, 1), tvm.tirx.ForKind.SERIAL)):
        sch = tvm.s_tir.Schedule(f)
        outer, inner = (sch.get(lp) for lp in sch.get_loops(sch.get_sblock("where")))
        assert outer.kind == kind and inner.kind == tvm.tirx.ForKind.SERIAL
    f = mask_func(b, t)
    rng = np.random.default_rng(5)
    s1, s2 = (rng.standard_normal((2, 2, 7, 13), dtype=np.float32) for _ in range(2))
    masked = rng.random((2, 1, 7, 13)) < 0.3
    lib = tvm.compile(f.with_attr("global_symbol", "main"), target=TARGET.tvm())
    got = tvm.runtime.empty((2, 2, 7, 13), "float32")
    lib["main"](tvm.runtime.tensor(s1), tvm.runtime.tensor(s2), tvm.runtime.tensor(masked), got)
    np.testing.assert_array_equal(got.numpy(), np.where(masked, np.float32(-3e38), (s1 + s2) * np.float32(0.5)))


@pytest.mark.parametrize("b,t", [(1, 1), (2, 37), (1, 64)])
def test_the_transpose_rule_tiles_and_keeps_the_numbers(b, t):
    """y[b, t, c] = x[b, c, t] (KDA's convolution output back to channels-last): tiles of 4 steps (the symbolic
    axis: a decode step's one token wastes 3 of 4, not 15 of 16) x 16 channels, the parallel loop over batch x time
    tiles, the channels (static) vectorized; a copy, so exact."""
    from k3compile.targets.llvm import TRANSPOSE_TILE, WINDOW_TILE, schedule_func
    from tvm import te

    bv, tv = (tvm.tirx.Var(n, "int64") for n in ("b", "t"))
    x = te.placeholder((bv, 96, tv), name="x")
    y = te.compute((bv, tv, 96), lambda i, j, k: x[i, k, j], name="y")
    f = schedule_func(te.create_prim_func([x, y]))
    sch = tvm.s_tir.Schedule(f)
    loops = [sch.get(lp) for lp in sch.get_loops(sch.get_sblock("y"))]
    assert loops[0].kind == tvm.tirx.ForKind.PARALLEL and loops[-1].kind == tvm.tirx.ForKind.VECTORIZED
    assert [int(lp.extent) for lp in loops[2:]] == [WINDOW_TILE, TRANSPOSE_TILE]
    xs = np.random.default_rng(t).standard_normal((b, 96, t), dtype=np.float32)
    out = tvm.runtime.empty((b, t, 96), "float32")
    tvm.compile(f.with_attr("global_symbol", "main"), target=TARGET.tvm())["main"](tvm.runtime.tensor(xs), out)
    np.testing.assert_array_equal(out.numpy(), xs.transpose(0, 2, 1))


def _norm_func(b, t, width=1024):
    """A norm over rows as the model's RMSNorm legalizes: the sum of each row's squares (a reduction over the
    row's static width, innermost), then every element divided by the root of its mean."""
    from tvm import te

    x = te.placeholder((b, t, 4, width), name="x")
    r = te.reduce_axis((0, width), "r")
    red = te.compute((b, t, 4, 1), lambda i, j, h, o: te.sum(x[i, j, h, r] * x[i, j, h, r], axis=r), name="red")
    y = te.compute((b, t, 4, width), lambda i, j, h, c: x[i, j, h, c] / tvm.tirx.sqrt(
        red[i, j, h, 0] / float(width) + 1e-5), name="y")
    return te.create_prim_func([x, y])


def test_a_narrow_matmul_over_8_rows_takes_both_cores():
    """The matmul rule's tasks take TASK_ROWS rows (targets/llvm.py): the router of a batch-8 decode step, [8, 1024]
    x [1024, 32], one 32-column strip, is 2 tasks (one task, on one core, at 8 rows a task); a row's numbers are
    the bits it gets alone, within fp32's bound of float64 numpy."""
    from k3compile.targets.llvm import schedule_func
    from tvm import te

    m = tvm.tirx.Var("m", "int64")
    x, w = te.placeholder((m, 1024), name="x"), te.placeholder((1024, 32), name="w")
    r = te.reduce_axis((0, 1024), "r")
    y = te.compute((m, 32), lambda i, j: te.sum(x[i, r] * w[r, j], axis=r), name="matmul")
    f = schedule_func(te.create_prim_func([x, w, y]))
    sch = tvm.s_tir.Schedule(f)
    outer = sch.get(sch.get_loops(sch.get_sblock("matmul_update"))[0])
    assert outer.kind == tvm.tirx.ForKind.PARALLEL
    at_8 = tvm.sym.Analyzer()
    at_8.bind(m, tvm.tirx.const(8, "int64"))
    assert int(at_8.simplify(outer.extent)) >= 2
    lib = tvm.compile(f.with_attr("global_symbol", "main"), target=TARGET.tvm())
    rng = np.random.default_rng(9)
    xs, ws = rng.standard_normal((8, 1024), dtype=np.float32), rng.standard_normal((1024, 32), dtype=np.float32)
    got = tvm.runtime.empty((8, 32), "float32")
    lib["main"](tvm.runtime.tensor(xs), tvm.runtime.tensor(ws), got)
    # fp32 sums of 1024 products of unit normals (results of size ~30): rounding errors ~1e-5, far below 2e-3
    np.testing.assert_allclose(got.numpy(), xs.astype(np.float64) @ ws.astype(np.float64), rtol=1e-4, atol=2e-3)
    one = tvm.runtime.empty((1, 32), "float32")
    lib["main"](tvm.runtime.tensor(np.ascontiguousarray(xs[5:6])), tvm.runtime.tensor(ws), one)
    np.testing.assert_array_equal(one.numpy()[0], got.numpy()[5])


def test_a_sum_over_a_row_runs_in_vector_lanes():
    """The vector-sum rule (targets/llvm.py, `_schedule_vector_sum`): each row's reduction over its static width in
    16 lanes, the lanes in registers (a stack buffer: docs/toolchain.md, "Scratch buffers"), the rows in parallel; a
    row's result does not depend on the rows beside it (the same bits alone and in a batch) and matches float64
    numpy."""
    from cpu_code import workspace_allocations
    from k3compile.targets.llvm import VECTOR, schedule_func

    b, t = (tvm.tirx.Var(n, "int64") for n in ("b", "t"))
    f = schedule_func(_norm_func(b, t))
    sch = tvm.s_tir.Schedule(f)
    lanes = [sch.get(lp) for lp in sch.get_loops(sch.get_sblock("red_rf_update"))]
    assert lanes[0].kind == tvm.tirx.ForKind.PARALLEL
    assert lanes[-1].kind == tvm.tirx.ForKind.VECTORIZED and int(lanes[-1].extent) == VECTOR
    assert int(lanes[-2].extent) == 1024 // VECTOR  # the element groups, in order
    lib = tvm.compile(f.with_attr("global_symbol", "main"), target=TARGET.tvm())
    # one: the row sums between the two stages (rows of runtime count); the 16 partial sums are a stack slot, which
    # LLVM keeps in a register (in TVM's "local" scope they were a workspace allocation per row task)
    assert workspace_allocations(lib) == 1
    xs = np.random.default_rng(3).standard_normal((3, 5, 4, 1024), dtype=np.float32)
    out = tvm.runtime.empty(xs.shape, "float32")
    lib["main"](tvm.runtime.tensor(xs), out)
    x64 = xs.astype(np.float64)
    want = x64 / np.sqrt((x64 * x64).sum(-1, keepdims=True) / 1024 + 1e-5)
    # fp32 sums of 1024 squares in 16 lanes of 64 terms: ~1e-6 relative at most; one rounding of the quotient
    np.testing.assert_allclose(out.numpy(), want, rtol=2e-6, atol=1e-7)
    one = tvm.runtime.empty((1, 1, 4, 1024), "float32")
    lib["main"](tvm.runtime.tensor(np.ascontiguousarray(xs[2:3, 4:5])), one)
    np.testing.assert_array_equal(one.numpy()[0, 0], out.numpy()[2, 4])


def test_a_short_static_innermost_loop_stays_out_of_the_parallel_loop():
    """KDA's new conv state, window[:, :, w - 3 :] over [B, C, w]: the 3 columns (static, too few to
    vectorize) stay an unrolled loop of their own under the parallel loop over rows x channels, so an element pays
    no index division by 3; a copy, so exact."""
    from k3compile.targets.llvm import schedule_func
    from tvm import te

    b, w = (tvm.tirx.Var(n, "int64") for n in ("b", "w"))  # w: the window's t + 3 columns
    window = te.placeholder((b, 64, w), name="window")
    state = te.compute((b, 64, 3), lambda i, c, k: window[i, c, k + w - 3], name="state")
    f = schedule_func(te.create_prim_func([window, state]))
    sch = tvm.s_tir.Schedule(f)
    outer, inner = (sch.get(lp) for lp in sch.get_loops(sch.get_sblock("state")))
    assert outer.kind == tvm.tirx.ForKind.PARALLEL and inner.kind == tvm.tirx.ForKind.UNROLLED
    assert int(inner.extent) == 3
    lib = tvm.compile(f.with_attr("global_symbol", "main"), target=TARGET.tvm())
    xs = np.random.default_rng(4).standard_normal((2, 64, 9), dtype=np.float32)
    got = tvm.runtime.empty((2, 64, 3), "float32")
    lib["main"](tvm.runtime.tensor(xs), got)
    np.testing.assert_array_equal(got.numpy(), xs[:, :, 6:])


def _einsum_module(subscripts: str, x_shape, w_shape):
    """main(x, w) = einsum(x, w[:, 1:]) (a slice of the weight, as MLA's value half of kv_b is) + 1."""
    b, s = tvm.tirx.Var("b", "int64"), tvm.tirx.Var("s", "int64")
    x = relax.Var("x", relax.TensorType([b, s, *x_shape], "float32"))
    w = relax.Var("w", relax.TensorType(list(w_shape), "float32"))
    bb = relax.BlockBuilder()
    with bb.function("main", [x, w], attrs={"num_input": 1}):
        with bb.dataflow():
            half = bb.emit(relax.op.split(w, [1], axis=1))
            y = bb.emit(relax.op.einsum((x, bb.emit(relax.TupleGetItem(half, 1))), subscripts))
            z = bb.emit_output(relax.op.add(y, relax.const(1.0, "float32")))
        bb.emit_func_output(z)
    return bb.get()


@pytest.mark.parametrize("subscripts,x_shape,w_shape,moved", [
    ("bthc,hvc->bthv", (4, 32), (4, 17, 32), "hcv"),  # MLA's value projection: v moved last
    ("bthn,hnc->bthc", (4, 16), (4, 17, 48), None),   # the query absorption: c already last
])
def test_an_einsum_by_a_weight_holds_the_output_index_last_and_keeps_the_numbers(subscripts, x_shape, w_shape,
                                                                                   moved):
    mod = _einsum_module(subscripts, x_shape, w_shape)
    packed = str(run_phases(mod, TARGET, upto="pack-dense-weights")["main"])
    lhs = subscripts.split("->")[0].split(",")
    assert f'subscripts="{lhs[0]},{moved or lhs[1]}->' in packed
    assert ("R.permute_dims" in packed) == bool(moved)
    rng = np.random.default_rng(len(x_shape))
    x = rng.standard_normal((2, 3, *x_shape), dtype=np.float32)
    w = rng.standard_normal(w_shape, dtype=np.float32)
    want = np.einsum(subscripts, x.astype(np.float64), w[:, 1:].astype(np.float64)) + 1
    np.testing.assert_allclose(_run(run_phases(mod, TARGET), x, w), want, rtol=1e-4, atol=1e-4)
