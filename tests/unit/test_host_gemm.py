"""The host GEMM (k3compile/host_gemm.py) against numpy in float64 over bf16 values that ml_dtypes widens, and the
CPU schedule's branch to it (targets/llvm.py): a packed dense matmul over symbolic rows calls it from
HOST_GEMM_ROWS rows on and runs its own loops below (the bf16 panels widened once per chunk for a block of rows); a
static one never calls it."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
from hardening import examples
from hypothesis import given, settings
from hypothesis import strategies as st

tvm = pytest.importorskip("tvm")

from k3compile.targets.llvm import HOST_GEMM, HOST_GEMM_ROWS, schedule_func  # noqa: E402

from k3compile import host_gemm  # noqa: E402


def _panels(w: np.ndarray, panel: int) -> np.ndarray:
    """[K, N] -> [N/P, K, P], the layout passes/pack_dense_weights.py stores."""
    k, n = w.shape
    return np.ascontiguousarray(w.reshape(k, n // panel, panel).transpose(1, 0, 2))


def _operands(rng, lead, k, n, panel, stored):
    """(x, the stored panels, the weights in float64): bf16 values, as a preset's dense matrices hold."""
    x = rng.standard_normal((*lead, k)).astype(np.float32)
    w = rng.standard_normal((k, n)).astype(ml_dtypes.bfloat16)
    bits = w.view(np.uint16) if stored == "uint16" else w.astype(np.float32)
    return x, _panels(bits, panel), w.astype(np.float64)


def _check(got, x, w64):
    """Within the fp32 dot-product bound: |error| <= K * 2^-23 * sum_k |x_k w_kn| (any summation order)."""
    x64 = x.reshape(-1, x.shape[-1]).astype(np.float64)
    want = x64 @ w64
    bound = x.shape[-1] * 2.0 ** -23 * (np.abs(x64) @ np.abs(w64))
    assert np.all(np.abs(got.reshape(want.shape) - want) <= bound)


@settings(max_examples=examples(40), deadline=None)
@given(lead=st.sampled_from([(1,), (7,), (2, 5), (3, 1, 4)]), k=st.sampled_from([8, 32, 96]),
       groups=st.integers(1, 5), panel=st.sampled_from([16, 64]), stored=st.sampled_from(["uint16", "float32"]),
       threads=st.integers(1, 3), chunk=st.sampled_from([1, 1 << 12, 8 << 20]), seed=st.integers(0, 2 ** 16))
def test_host_gemm_equals_the_float64_product(lead, k, groups, panel, stored, threads, chunk, seed):
    """Any row shape, panel count and width, both stored dtypes, 1-3 threads (capped at the cores) and chunks from
    one panel to all of them."""
    x, wp, w64 = _operands(np.random.default_rng(seed), lead, k, groups * panel, panel, stored)
    y = tvm.runtime.empty((*lead, groups * panel), "float32")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TVM_NUM_THREADS", str(threads))
        mp.setattr(host_gemm, "CHUNK_BYTES", chunk)
        host_gemm.host_gemm(tvm.runtime.tensor(x), tvm.runtime.tensor(wp), y)
    _check(y.numpy(), x, w64)


@pytest.fixture
def counted(monkeypatch):
    """The host GEMM registered, and the rows and K of each call it serves (counted inside the module: a kernel keeps
    the function it first found, so the registration itself is never swapped)."""
    calls = []
    columns = host_gemm._columns

    def counting(a, w, out, g0, g1):
        if g0 == 0:  # one record per call: the first thread's share
            calls.append(a.shape)
        columns(a, w, out, g0, g1)

    host_gemm.register()
    monkeypatch.setattr(host_gemm, "_columns", counting)
    return calls


def _matmul(rows, k, n, stored, host=True):
    """The packed dense matmul as phase 2 emits it, over `rows` (an int, or None: symbolic), scheduled for the CPU
    (`host`: with the host GEMM's branch where it applies) and built."""
    from k3compile.passes.pack_dense_weights import packed_matmul_te
    from tvm import te

    m = te.var("m", "int64") if rows is None else rows
    x = te.placeholder((m, k), "float32", name="x")
    wp = te.placeholder((n // 64, k, 64), stored, name="wp")
    y = packed_matmul_te(x, wp, 64)
    func = schedule_func(te.create_prim_func([x, wp, y]), host_gemm=host)
    return func, tvm.compile(tvm.IRModule({"main": func}), target="llvm")["main"]


@pytest.mark.parametrize("stored", ["uint16", "float32"])
def test_the_kernel_calls_the_host_gemm_from_host_gemm_rows_on(counted, stored):
    k, n = 96, 128
    func, kernel = _matmul(None, k, n, stored)
    assert func.attrs["k3.host_gemm"]
    rng = np.random.default_rng(0)
    for rows in (1, HOST_GEMM_ROWS - 1, HOST_GEMM_ROWS, HOST_GEMM_ROWS + 13):
        x, wp, w64 = _operands(rng, (rows,), k, n, 64, stored)
        y = tvm.runtime.empty((rows, n), "float32")
        kernel(tvm.runtime.tensor(x), tvm.runtime.tensor(wp), y)
        _check(y.numpy(), x, w64)
    assert counted == [(HOST_GEMM_ROWS, k), (HOST_GEMM_ROWS + 13, k)]


def test_without_the_host_gemm_every_row_count_runs_the_kernels_loops(counted):
    """schedule_func(host_gemm=False) (`compile --no-host-gemm`): over symbolic rows no branch to the host GEMM, at
    any row count, and the products those loops give."""
    k, n = 96, 128
    func, kernel = _matmul(None, k, n, "uint16", host=False)
    assert "k3.host_gemm" not in (func.attrs or {}) and HOST_GEMM not in func.script()
    rng = np.random.default_rng(2)
    for rows in (1, 5, HOST_GEMM_ROWS, HOST_GEMM_ROWS + 13):
        x, wp, w64 = _operands(rng, (rows,), k, n, 64, "uint16")
        y = tvm.runtime.empty((rows, n), "float32")
        kernel(tvm.runtime.tensor(x), tvm.runtime.tensor(wp), y)
        _check(y.numpy(), x, w64)
    assert counted == []


def test_a_static_matmul_never_calls_the_host_gemm(counted):
    """A decode library's step has static rows: its kernel is its own loops, whatever the count."""
    func, kernel = _matmul(HOST_GEMM_ROWS, 32, 64, "uint16")
    assert "k3.host_gemm" not in (func.attrs or {})
    x, wp, w64 = _operands(np.random.default_rng(1), (HOST_GEMM_ROWS,), 32, 64, 64, "uint16")
    y = tvm.runtime.empty((HOST_GEMM_ROWS, 64), "float32")
    kernel(tvm.runtime.tensor(x), tvm.runtime.tensor(wp), y)
    _check(y.numpy(), x, w64)
    assert counted == []


@pytest.mark.parametrize("k", [96, 30])
def test_rows_below_the_host_gemm_share_each_widened_chunk_and_get_one_rows_bits(k):
    """Over symbolic rows the bf16 panels are widened a chunk at a time inside the parallel loop (targets/llvm.py:
    `_schedule_widened`) when K is a multiple of WIDEN_K, and inline otherwise; a static row widens inline. Each row
    of any row count (the row block's tails included) is the bits the one-row kernel gives that row alone, and
    within the fp32 bound of the float64 product."""
    from k3compile.targets.llvm import WIDEN_K, WIDENED

    n = 128
    func, kernel = _matmul(None, k, n, "uint16")
    one_func, one = _matmul(1, k, n, "uint16")
    text = func.script()
    if k % WIDEN_K == 0:
        assert text.index("T.parallel") < text.index(f'T.sblock("{WIDENED}")')
    else:
        assert WIDENED not in text
    assert WIDENED not in one_func.script()
    rng = np.random.default_rng(k)
    for rows in (1, 2, 3, 4, 5, 7, 8, 13, HOST_GEMM_ROWS - 1):
        x, wp, w64 = _operands(rng, (rows,), k, n, 64, "uint16")
        y = tvm.runtime.empty((rows, n), "float32")
        kernel(tvm.runtime.tensor(x), tvm.runtime.tensor(wp), y)
        alone = np.empty((rows, n), np.float32)
        for r in range(rows):
            out = tvm.runtime.empty((1, n), "float32")
            one(tvm.runtime.tensor(x[r:r + 1]), tvm.runtime.tensor(wp), out)
            alone[r] = out.numpy()[0]
        assert np.array_equal(y.numpy(), alone), rows
        _check(y.numpy(), x, w64)
