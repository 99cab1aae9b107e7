"""CPU (`llvm`) schedules for the standard ops once legalized and fused (docs/toolchain.md, "CPU schedules").

TVM 0.27 has no CPU schedule for a matmul and leaves every legalized op a serial loop nest (dlight's CPU rules cover
inner-reduction GEMVs only, 13x slower than torch here). `schedule_func` gives each fused PrimFunc a schedule from
three rules, tried in order per block; a rule that does not apply leaves the block as it was, so a schedule is
never wrong, at worst slower:

1. inline: every intermediate spatial block (elementwise chains, reshapes, broadcasts) is computed inside its
   consumer, so a fused chain is one loop nest and no intermediate buffer is written;
2. matmul: a reduction `C[..., j] += A[..., k] * B[..., k, j]` whose output dim j is static and whose weight is
   read with j innermost (the [K, N] layout the exporter writes, or the [N/64, K, 64] panels of
   passes/pack_dense_weights.py) is tiled: j split into 64-column strips of 16-lane vectors, k split by 4, the
   rows (batch x tokens, symbolic) in blocks of 8, each row's strip accumulated in registers over all of k (the
   order measured fastest for one token), strips x row blocks run in parallel; a packed matmul over bf16 panels
   for more than one row widens each chunk of WIDEN_K values of k once into an L1 buffer that ROW_BLOCK rows use in
   turn instead (`_schedule_widened`); over a symbolic length (attention's
   p · V) each row's output stays in L1 while k runs instead, rows in parallel, the output dim vectorized;
3. loops: any other block gets its spatial loops fused into one (run in parallel when the work is large) and its
   innermost loop, when static and a multiple of 4, vectorized; a symbolic innermost loop under static ones stays
   a serial loop of its own; a reduction keeps its reduction loops serial inside, its initialization split out.

A packed matmul over bf16 panels in a library written to disk then calls a C kernel of targets/bf16_gemm.c in place
of its loops, at every row count: the fp32 GEMM in an exact build on AVX-512 (the loops' bits, faster: streamed
with prefetch, 6-row register tiles), the bf16 GEMM under --matmul-precision bf16. Elsewhere (other CPUs, fp32
panels, an in-process build) prefill rows from HOST_GEMM_ROWS on call the host GEMM.
"""

from __future__ import annotations

import math

VECTOR = 16  # fp32 lanes: a 64-byte strip, two AVX2 / one AVX-512 register
PANEL = 64  # columns per dense-weight panel (passes/pack_dense_weights.py): four vectors, one strip
MX_PARTIAL = "k3_mx_partial"  # passes/pack_dense_weights.py: MX_PARTIAL (a target imports no pass)
WIDENED = "k3_widened"  # passes/pack_dense_weights.py: WIDENED, the bf16 panels widened to fp32
WIDEN_K = 4  # k per widened chunk: 4 x 64 fp32, 1 KiB (from the workspace pool; 2, on the stack, measured slower)
ROW_BLOCK = 4  # rows a widened chunk serves in turn (measured: docs/toolchain.md, "CPU schedules")
TASK_ROWS = 4  # rows of one parallel task of the matmul rule: at 8 a batch-8 step's small matmuls (the router,
# [8, 1024] x [1024, 32]) were one task, on one core (docs/toolchain.md, "CPU schedules")
SCRATCH = "global"  # a schedule's scratch buffers: under 1 KiB a stack slot, kept in registers (docs/toolchain.md,
# "Scratch buffers"; "local" on a CPU is a workspace-pool allocation each time, behind a pointer that may alias)
PARALLEL_MIN = 4096  # static elements below which a loop nest stays serial (the thread pool's wake-up costs more)
TRANSPOSE_TILE = 16  # a transpose's tile side: 16 fp32 = one cache line of each of 16 rows
WINDOW_TILE = 4  # the tile side along a symbolic axis: KDA's conv window at decode (W - 1 + 1 = 4 columns)
HOST_GEMM = "k3compile.host_gemm"  # k3compile/host_gemm.py registers it (a target imports no runtime module)
HOST_GEMM_ATTR = "k3.host_gemm"  # marks a PrimFunc that calls it (compile.py counts them for the manifest)
HOST_GEMM_ROWS = 512  # rows from which a packed dense matmul calls the host GEMM (measured: docs/toolchain.md)
BF16_GEMM = "k3_bf16_gemm"  # targets/bf16_gemm.c: what every row calls instead under --matmul-precision bf16
BF16_GEMM_ATTR = "k3.bf16_gemm"  # marks a PrimFunc that calls it (compile.py links the C object in when one does)
BF16_GEMM_SOURCE = "bf16_gemm.c"  # beside this module
BF16_GEMM_FEATURE = "avx512bf16"  # the LLVM CPU feature it needs (vcvtneps2bf16, vdpbf16ps)
BF16_GEMM_FLAGS = ("-O3", "-fPIC", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512bf16")
F32_GEMM = "k3_f32_gemm"  # targets/bf16_gemm.c: what an exact build's matmuls over bf16 panels call (every row)
F32_GEMM_ATTR = "k3.f32_gemm"  # marks a PrimFunc that calls it (compile.py links the C object in when one does)
F32_GEMM_FEATURES = ("avx512f", "avx512bw")  # the LLVM CPU features it needs (the object is built for AVX-512)


def _static(extent) -> int | None:
    import tvm

    return int(extent) if isinstance(extent, tvm.tirx.IntImm) else None


def _iter_kinds(sch, block) -> list[int]:
    return [int(iv.iter_type) for iv in sch.get(block).iter_vars]


def _is_reduction(sch, block) -> bool:
    import tvm

    return any(k == tvm.tirx.IterVar.CommReduce for k in _iter_kinds(sch, block))


def _inline_intermediates(sch, root) -> None:
    """compute_inline every spatial block that feeds another block (repeated until nothing changes), but the widened
    panels, which the matmul rule places."""
    changed = True
    while changed:
        changed = False
        for block in sch.get_child_blocks(root):
            if _is_reduction(sch, block) or not sch.get_consumers(block) or sch.get(block).name_hint == WIDENED:
                continue
            try:
                sch.compute_inline(block)
                changed = True
            except Exception:  # noqa: BLE001 - TVM raises ScheduleError subclasses; this block stays as it is
                continue


def _matmul_layout(sch, block):
    """(spatial loops, k loop, N, K) when `block` is `C[..., j] += A[..., k] * B[..., k, j]` with j and k its two
    innermost iterators, N and K static, and some operand read with j as its last index; else None."""
    import tvm

    stmt = sch.get(block)
    kinds = _iter_kinds(sch, block)
    loops = sch.get_loops(block)
    if len(loops) != len(kinds) or len(kinds) < 2 or kinds[-1] != tvm.tirx.IterVar.CommReduce:
        return None
    if any(k == tvm.tirx.IterVar.CommReduce for k in kinds[:-1]):
        return None
    j_var, k_var = stmt.iter_vars[-2].var, stmt.iter_vars[-1].var
    n, kk = _static(sch.get(loops[-2]).extent), _static(sch.get(loops[-1]).extent)
    if n is None:
        return None
    if len(stmt.writes) != 1 or not stmt.writes[0].region or not stmt.writes[0].region[-1].min.same_as(j_var):
        return None
    last = [r.region[-1].min for r in stmt.reads if len(r.region)]
    packed = stmt.name_hint == "k3_packed_matmul" and n % PANEL == 0
    if not packed and (not any(x.same_as(j_var) for x in last) or not any(x.same_as(k_var) for x in last)):
        return None
    return loops[:-1], loops[-1], n, kk


def _schedule_rows(sch, block, layout) -> None:
    """A matmul over a symbolic length (attention's p · V): each row's output, a few hundred bytes, stays in L1
    while k runs; rows in parallel, the output dim vectorized."""
    spatial, k, n, _ = layout
    vec = next((v for v in (VECTOR, 8, 4) if n % v == 0), None)
    if vec is None or len(spatial) < 2:
        raise ValueError("no vector width or no rows")
    jo, jv = sch.split(spatial[-1], [None, vec])
    rows = spatial[:-1]
    m = sch.fuse(*rows) if len(rows) > 1 else rows[0]
    sch.reorder(m, k, jo, jv)
    sch.parallel(m)
    sch.vectorize(jv)
    init = sch.decompose_reduction(block, k)
    sch.vectorize(sch.get_loops(init)[-1])


def _schedule_matmul(sch, block, layout) -> None:
    spatial, k, n, kk = layout
    if kk is None:
        return _schedule_rows(sch, block, layout)
    vec = next((v for v in (VECTOR, 8, 4) if n % v == 0), None)
    if vec is None:
        raise ValueError("output dim not a multiple of 4")
    lanes = n // vec
    strip = next(t for t in (PANEL // VECTOR, 2, 1) if lanes % t == 0)
    jo, ji, jv = sch.split(spatial[-1], [None, strip, vec])
    ko, ki = sch.split(k, [None, 4]) if kk % 4 == 0 else (k, None)
    rows = spatial[:-1]
    if rows:
        m = sch.fuse(*rows) if len(rows) > 1 else rows[0]
        mo, mi = sch.split(m, [None, TASK_ROWS])
        sch.reorder(mo, jo, mi, ko, *([ki] if ki is not None else []), ji, jv)
        par, at = sch.fuse(mo, jo), mi
    else:
        sch.reorder(jo, ko, *([ki] if ki is not None else []), ji, jv)
        par = at = jo
    cw = sch.cache_write(block, 0, SCRATCH)
    sch.reverse_compute_at(cw, at)
    if ki is not None:
        sch.unroll(ki)
    sch.unroll(ji)
    sch.vectorize(jv)
    sch.vectorize(sch.get_loops(cw)[-1])
    sch.parallel(par)
    init = sch.decompose_reduction(block, ko)
    sch.vectorize(sch.get_loops(init)[-1])


def _widened_rows(sch, block, layout) -> bool:
    """Whether the matmul `block`, reading the widened panels, has rows to share each widened chunk: some row dim
    symbolic or more than one row, K a multiple of WIDEN_K."""
    spatial, _, _, kk = layout
    extents = [_static(sch.get(lp).extent) for lp in spatial[:-1]]
    rows = 1
    for e in extents:
        rows *= e or 2
    return rows > 1 and kk is not None and kk % WIDEN_K == 0


def _schedule_widened(sch, block, layout, widened) -> None:
    """The packed matmul over bf16 panels for several rows: per 64-column strip and WIDEN_K values of k, the panel's
    chunk is widened once into a 1 KiB buffer (L1), and each of ROW_BLOCK rows in turn adds its products to its
    output strip; the k order of every output's sum is the one-row schedule's (the same bits). The widening (a
    load, an extension and a shift per vector) is paid once for the rows instead of once per row."""
    spatial, k, _, _ = layout
    jo, ji, jv = sch.split(spatial[-1], [None, PANEL // VECTOR, VECTOR])
    kc, ki = sch.split(k, [None, WIDEN_K])
    rows = spatial[:-1]
    m = sch.fuse(*rows) if len(rows) > 1 else rows[0]
    mo, mi = sch.split(m, [None, ROW_BLOCK])
    sch.reorder(mo, jo, kc, mi, ki, ji, jv)
    sch.parallel(sch.fuse(mo, jo))
    sch.unroll(ki)
    sch.unroll(ji)
    sch.vectorize(jv)
    init = sch.decompose_reduction(block, kc)
    sch.vectorize(sch.get_loops(init)[-1])
    sch.compute_at(widened, kc)
    _, v = sch.split(sch.fuse(*sch.get_loops(widened)[-2:]), [None, VECTOR])
    sch.vectorize(v)


def _schedule_mx_partial(sch, block, partial) -> None:
    """The packed MXFP8 matmul's first stage (passes/pack_dense_weights.py: packed_mx_matmul_te) computed inside
    the matmul's loop over the scale blocks: for the row and the 64-column strip at hand, the 32 values of the
    block accumulated into a 64-float scratch buffer (SCRATCH: 4 vector registers), which the matmul then
    scales once."""
    blocks = [lp for lp in sch.get_loops(block) if sch.get(lp).loop_var.name.startswith("kb")]
    sch.compute_at(partial, blocks[-1])  # the innermost loop over the scale blocks
    sch.set_scope(partial, 0, SCRATCH)
    j, kr = sch.get_loops(partial)[-2:]
    jo, jv = sch.split(j, [None, VECTOR])
    ko, ki = sch.split(kr, [None, 4])
    sch.reorder(ko, ki, jo, jv)
    sch.unroll(ki)
    sch.unroll(jo)
    sch.vectorize(jv)
    init = sch.decompose_reduction(partial, ko)
    sch.vectorize(sch.get_loops(init)[-1])


def _schedule_loops(sch, block) -> None:
    import tvm

    kinds = _iter_kinds(sch, block)
    loops = sch.get_loops(block)
    if len(loops) != len(kinds) or not loops:
        return
    spatial = [lp for lp, k in zip(loops, kinds) if k == tvm.tirx.IterVar.DataPar]
    if len(spatial) != len(loops) and loops[:len(spatial)] != spatial:
        return  # a reduction loop among the spatial ones: leave it
    reduction = len(spatial) != len(loops)
    extents = [_static(sch.get(lp).extent) for lp in spatial]
    work = 1
    for e in extents:
        work *= e or 1
    for lp in loops[len(spatial):]:
        work *= _static(sch.get(lp).extent) or 1
    inner = None
    if not reduction and spatial and extents[-1] is not None and extents[-1] % 4 == 0:
        vec = next(v for v in (VECTOR, 8, 4) if extents[-1] % v == 0)
        outer, inner = sch.split(spatial[-1], [None, vec])
        spatial = [*spatial[:-1], outer]
    symbolic = any(e is None for e in extents)
    kept = 0
    if (inner is None and not reduction and len(spatial) > 1 and extents[-1] is not None and extents[-1] <= 8
            and symbolic):
        # a short static innermost loop that is not vectorized (KDA's conv state: its W - 1 = 3 columns) stays a
        # serial loop of its own, unrolled: fused in, each element would pay two index divisions
        sch.unroll(spatial[-1])
        spatial, kept = spatial[:-1], 1
    elif inner is None and extents[-1] is None and any(e is not None for e in extents[:-1]):
        # a symbolic innermost loop (a conv's time axis, a cache's length) stays a serial loop of its own when a
        # static outer one gives the parallel loop its work: fused in, every element would pay an index division
        # by a runtime extent (docs/toolchain.md, "CPU schedules")
        spatial, kept = spatial[:-1], 1
    if spatial:  # one loop over the spatial iterations: LLVM takes seconds over a nest of symbolic loops
        outer = sch.fuse(*spatial) if len(spatial) > 1 else spatial[0]
        outer_symbolic = any(e is None for e in extents[:len(extents) - kept])
        if work >= PARALLEL_MIN or symbolic and work >= 256 or kept and outer_symbolic:
            # kept and outer_symbolic: rows of runtime count (batch, tokens) over a runtime length each, MLA's mask
            # over [B, H, T, S] in a prefill: no bound on the work, one wake-up of the pool against T · S elements
            sch.parallel(outer)
    if inner is not None:
        sch.vectorize(inner)
    if reduction:
        sch.decompose_reduction(block, sch.get_loops(block)[(1 if spatial else 0) + kept])


def _sum_over_last(sch, block) -> bool:
    """Whether `block` reduces over one loop, its innermost, of a static extent of whole vectors (at least two): a
    norm's sum of squares over a row, a mean."""
    import tvm

    kinds = _iter_kinds(sch, block)
    loops = sch.get_loops(block)
    if len(loops) != len(kinds) or len(loops) < 2 or kinds[-1] != tvm.tirx.IterVar.CommReduce:
        return False
    if any(k != tvm.tirx.IterVar.DataPar for k in kinds[:-1]):
        return False
    extent = _static(sch.get(loops[-1]).extent)
    return extent is not None and extent % VECTOR == 0 and extent >= 2 * VECTOR


def _schedule_vector_sum(sch, block) -> None:
    """A row's reduction in VECTOR lanes: lane l sums elements l, l + VECTOR, l + 2 VECTOR, ... in order (one
    vector add an element group, in registers), then the lanes are summed in order. The loops rule summed the row
    one element after the other, each add waiting for the one before (docs/toolchain.md, "CPU schedules": the
    norms of a k3-small batch-8 decode step). The order is fixed by the schedule alone, so a row's sum does not
    depend on the batch it runs in."""
    loops = sch.get_loops(block)
    _, lanes = sch.split(loops[-1], [None, VECTOR])
    partial = sch.rfactor(lanes, len(loops) - 1)  # [rows..., VECTOR] partial sums; `block` then sums the lanes
    spatial = sch.get_loops(block)[:-1]
    extents = [_static(sch.get(lp).extent) for lp in spatial]
    sch.compute_at(partial, spatial[-1])
    sch.set_scope(partial, 0, SCRATCH)
    lane, group = sch.get_loops(partial)[-2:]
    sch.reorder(group, lane)
    sch.vectorize(lane)
    outer = sch.fuse(*spatial) if len(spatial) > 1 else spatial[0]
    if None in extents or math.prod(extents) * VECTOR >= PARALLEL_MIN:  # rows of runtime count, or enough work
        sch.parallel(outer)
    init = sch.decompose_reduction(partial, group)
    sch.vectorize(sch.get_loops(init)[-1])


def _transpose_axis(sch, block) -> int | None:
    """m when `block` (spatial, one loop per iterator) writes along its innermost iterator but reads some operand
    along iterator m instead (a transpose: KDA's convolution input to time-innermost and back); else None."""
    import tvm

    from_vars = tvm.tirx.analysis.undefined_vars
    stmt = sch.get(block)
    ivs = [iv.var for iv in stmt.iter_vars]
    if len(sch.get_loops(block)) != len(ivs) or len(ivs) < 2 or _is_reduction(sch, block) or len(stmt.writes) != 1:
        return None
    last = from_vars(stmt.writes[0].region[-1].min, []) if stmt.writes[0].region else []
    if len(last) != 1 or not last[0].same_as(ivs[-1]):
        return None
    for read in stmt.reads:
        used = from_vars(read.region[-1].min, []) if read.region else []
        if len(used) == 1:
            m = next((i for i, v in enumerate(ivs[:-1]) if v.same_as(used[0])), None)
            if m is not None:
                return m
    return None


def _tile(sch, loop) -> int:
    """A transpose tile's side along `loop`: TRANSPOSE_TILE when its extent is static, else WINDOW_TILE (a symbolic
    axis is the time axis of KDA's conv window: 4 columns at decode, where a side of 16 ran 3 in 4 (the window) or
    15 in 16 (the products) of its iterations masked; docs/toolchain.md, "CPU schedules")."""
    return TRANSPOSE_TILE if _static(sch.get(loop).extent) is not None else WINDOW_TILE


def _schedule_transpose(sch, block, m: int) -> None:
    """Tiles over iterator m and the innermost one (sides: `_tile`), so that the lines a tile reads and the lines it
    writes are all used while in L1 (loops: one element at a time along the write, the reads a page apart: 1-2
    GB/s); the tiles' outer loops fused and run in parallel, the innermost vectorized when static."""
    loops = sch.get_loops(block)
    n = len(loops) - 1
    inner_static = _static(sch.get(loops[n]).extent)
    mo, mi = sch.split(loops[m], [None, _tile(sch, loops[m])])
    no, ni = sch.split(loops[n], [None, _tile(sch, loops[n])])
    between = list(loops[m + 1:n])
    sch.reorder(mo, *between, no, mi, ni)
    outer = [*loops[:m], mo, *between]
    sch.parallel(sch.fuse(*outer) if len(outer) > 1 else outer[0])
    if inner_static is not None and inner_static % TRANSPOSE_TILE == 0:
        sch.vectorize(ni)


def _static_rows(y) -> bool:
    """Whether every row dimension of the matmul output buffer `y` (all but its last) is a constant: a decode
    library's step, not the prefill library's symbolic rows."""
    import tvm

    return all(isinstance(d, tvm.tirx.IntImm) for d in y.shape[:-1])


def _host_gemm_operands(sch, block, static_rows: bool = False):
    """(x, wp, y) when `block` is the plain packed dense matmul y[r..., j] = sum_k x[r..., k] * wp[j // P, k, j % P]
    over rows of which some are symbolic, or any rows with `static_rows` (the host GEMM and the bf16 GEMM read the
    buffers as they are); else None."""
    import tvm

    stmt = sch.get(block)
    if stmt.name_hint != "k3_packed_matmul" or len(stmt.reads) != 2 or len(stmt.writes) != 1:
        return None
    ivs = [iv.var for iv in stmt.iter_vars]
    rows, j, k = ivs[:-2], ivs[-2], ivs[-1]
    (x, wp), y = stmt.reads, stmt.writes[0]
    panels = wp.source
    for producer in sch.get_producers(block):
        if sch.get(producer).name_hint == WIDENED and sch.get(producer).writes[0].source.same_as(panels):
            panels = sch.get(producer).reads[0].source  # the stored bf16 bits, which the host GEMM widens itself
    if x.source.dtype != "float32" or panels.dtype not in ("float32", "uint16") or len(panels.shape) != 3:
        return None
    if not static_rows and _static_rows(y.source):
        return None  # static rows: a decode library's step, which the kernel serves
    analyzer = tvm.sym.Analyzer()

    def at(region, index) -> bool:
        return len(region.region) == len(index) and all(
            analyzer.can_prove_equal(r.min, i) and analyzer.can_prove_equal(r.extent, 1)
            for r, i in zip(region.region, index))

    panel = wp.source.shape[2]
    if not (at(x, [*rows, k]) and at(y, [*rows, j]) and at(wp, [j // panel, k, j % panel])):
        return None
    return x.source, panels, y.source


def _c_kernel(name: str, x, wp, y, rows):
    """A call of `name` (targets/bf16_gemm.c's signature: x, panels, y, rows, K, panel count) whose nonzero status
    raises the error it set, as a packed call's would be."""
    import tvm

    status = tvm.tirx.call_extern("int32", name, x.data, wp.data, y.data, tvm.tirx.Cast("int64", rows),
                                  tvm.tirx.Cast("int64", wp.shape[1]), tvm.tirx.Cast("int64", wp.shape[0]))
    return tvm.tirx.IfThenElse(status != 0, tvm.tirx.Evaluate(tvm.tirx.call_intrin("int32",
                                                                                 "tirx.tvm_throw_last_error")), None)


def _bf16_panels(wp) -> bool:
    """Whether `wp` (the panels `_host_gemm_operands` found) holds bf16 bits in panels of PANEL columns: the operand
    the C GEMMs take."""
    return wp.dtype == "uint16" and _static(wp.shape[2]) == PANEL


def _call_host_gemm(func, operands, outer, host_gemm: bool = True, bf16_gemm: bool = False, f32_gemm: bool = False):
    """`func` whose top-level loop nest `outer` (the scheduled matmul) is replaced, for every row count, by a call of
    a C kernel linked into the library when its panels are bf16 ones of PANEL columns: the bf16 GEMM (`bf16_gemm`)
    or the fp32 GEMM (`f32_gemm`, the loops' own bits); or else (`host_gemm`, symbolic rows) run only below
    HOST_GEMM_ROWS rows, the host GEMM called from there on; `func` unchanged when none applies."""
    import functools

    import tvm

    x, wp, y = operands
    root = func.body
    block = root.block
    seq = list(block.body.seq) if isinstance(block.body, tvm.tirx.SeqStmt) else [block.body]
    at = [i for i, s in enumerate(seq) if s.same_as(outer)]
    if len(at) != 1:
        return func
    rows = functools.reduce(lambda a, b: a * b, y.shape[:-1])
    bf16_panels = _bf16_panels(wp)
    if bf16_gemm and bf16_panels:  # every row: a step's bits never depend on its batch
        seq[at[0]], mark = _c_kernel(BF16_GEMM, x, wp, y, rows), BF16_GEMM_ATTR
    elif f32_gemm and bf16_panels:  # k in the loops' order, by FMA as theirs (the same bits), faster
        seq[at[0]], mark = _c_kernel(F32_GEMM, x, wp, y, rows), F32_GEMM_ATTR
    elif host_gemm and not _static_rows(y):
        call, mark = tvm.tirx.Evaluate(tvm.tirx.call_packed(HOST_GEMM, x, wp, y)), HOST_GEMM_ATTR
        seq[at[0]] = tvm.tirx.IfThenElse(rows >= HOST_GEMM_ROWS, call, seq[at[0]])
    else:
        return func
    body = tvm.tirx.SeqStmt(seq) if len(seq) > 1 else seq[0]
    block = tvm.s_tir.SBlock(block.iter_vars, block.reads, block.writes, block.name_hint, body, block.init,
                             block.alloc_buffers, block.match_buffers, block.annotations)
    return func.with_body(tvm.s_tir.SBlockRealize(root.iter_values, root.predicate, block)).with_attr(mark, True)


def bf16_gemm_object(folder) -> str:
    """targets/bf16_gemm.c compiled into an object in `folder` (for export_library's addons) with the C compiler TVM
    links with; ExportError (one line) when there is none or it fails."""
    import subprocess
    from pathlib import Path

    from tvm.support.cc import get_cc

    from k3compile.interface import ExportError

    cc = get_cc()
    if cc is None:
        raise ExportError(f"a CPU library links the C kernels of {BF16_GEMM_SOURCE} and found no C compiler (set CC, "
                          "or install gcc)")
    out = Path(folder) / "k3_bf16_gemm.o"
    cmd = [cc, "-x", "c", *BF16_GEMM_FLAGS, "-c", str(Path(__file__).with_name(BF16_GEMM_SOURCE)), "-o", str(out)]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise ExportError(f"{BF16_GEMM_SOURCE}: {cc} did not run ({e})") from None
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["no message"])[-1]
        raise ExportError(f"{cc} could not compile {BF16_GEMM_SOURCE} ({last})")
    return str(out)


def schedule_func(func, host_gemm: bool = True, bf16_gemm: bool = False, f32_gemm: bool = False):
    """`func` (a legalized, fused PrimFunc) with the CPU schedule; unchanged when it is already scheduled. Without
    `host_gemm` (`compile --no-host-gemm`) a packed matmul over symbolic rows runs its own loops for every row count,
    so the library needs no function of k3compile's runtime (a plain TVM runtime runs all of it). With `bf16_gemm`
    (`compile --matmul-precision bf16`) every packed matmul over bf16 panels, of symbolic or static rows, calls the
    bf16 GEMM instead of its loops (its activations rounded to bf16), which the library itself carries; with
    `f32_gemm` (Target.with_f32_gemm: an exact build written to disk, on AVX-512) such a matmul calls the fp32 GEMM
    the library carries, the loops' own bits, and never the host GEMM."""
    import tvm

    if func.attrs is not None and "tirx.is_scheduled" in func.attrs:
        return func
    sch = tvm.s_tir.Schedule(func)
    try:
        root = sch.get_sblock("root")
    except Exception:  # noqa: BLE001 - a hand-written kernel without a root block: not ours to schedule
        return func
    _inline_intermediates(sch, root)
    names = [sch.get(b).name_hint for b in sch.get_child_blocks(root)]
    host = _host_gemm_operands(sch, sch.get_sblock("k3_packed_matmul"), static_rows=bf16_gemm or f32_gemm) \
        if (host_gemm or bf16_gemm or f32_gemm) and "k3_packed_matmul" in names else None
    # a C kernel takes the whole matmul at every row count (_call_host_gemm): its loops are not scheduled, and its
    # widened panels are inlined so that no loop writes them (the kernel reads the stored bf16 bits)
    kernel = host is not None and (bf16_gemm or f32_gemm) and _bf16_panels(host[1])
    for name in names:
        if name in (MX_PARTIAL, WIDENED):
            continue  # scheduled inside the matmul it feeds (below)
        if kernel and name == "k3_packed_matmul":
            if WIDENED in names:
                sch.compute_inline(sch.get_sblock(WIDENED))
            continue
        block = sch.get_sblock(name)
        layout = _matmul_layout(sch, block) if _is_reduction(sch, block) else None
        state = sch.mod
        try:
            if name == "k3_packed_matmul" and WIDENED in names:
                if layout is not None and _widened_rows(sch, block, layout):
                    _schedule_widened(sch, block, layout, sch.get_sblock(WIDENED))
                    continue
                sch.compute_inline(sch.get_sblock(WIDENED))  # one row: widened as it is read (the rules below)
            if layout is not None:
                _schedule_matmul(sch, block, layout)
                if MX_PARTIAL in names and name == "k3_packed_matmul":
                    _schedule_mx_partial(sch, sch.get_sblock(f"{name}_update"), sch.get_sblock(MX_PARTIAL))
            elif _sum_over_last(sch, block):
                try:
                    _schedule_vector_sum(sch, block)
                except Exception:  # noqa: BLE001 - not a reducer rfactor takes: the loops rule
                    sch = tvm.s_tir.Schedule(state)
                    _schedule_loops(sch, sch.get_sblock(name))
            elif (m := _transpose_axis(sch, block)) is not None:
                try:
                    _schedule_transpose(sch, block, m)
                except Exception:  # noqa: BLE001 - not tileable: the loops rule, as for any other block
                    sch = tvm.s_tir.Schedule(state)
                    _schedule_loops(sch, sch.get_sblock(name))
            else:
                _schedule_loops(sch, block)
        except Exception:  # noqa: BLE001 - a rule that does not apply: this block keeps the schedule it had
            sch = tvm.s_tir.Schedule(state)
            if name == "k3_packed_matmul" and WIDENED in names:
                sch.compute_inline(sch.get_sblock(WIDENED))  # never a whole widened copy of the weight
    func = sch.mod["main"]
    if host is not None:
        try:
            matmul = sch.get_sblock("k3_packed_matmul_update")  # the reduction once decomposed
        except Exception:  # noqa: BLE001 - the matmul rule did not apply: the block is as legalized
            matmul = sch.get_sblock("k3_packed_matmul")
        func = _call_host_gemm(func, host, sch.get(sch.get_loops(matmul)[0]), host_gemm, bf16_gemm, f32_gemm)
    return func.with_attr("tirx.is_scheduled", True)

