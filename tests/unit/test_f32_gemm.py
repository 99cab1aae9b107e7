"""The fp32 GEMM (targets/bf16_gemm.c, `k3_f32_gemm`) that an exact CPU library written to disk links in where the
CPU has AVX-512: its packed dense matmuls over bf16 panels call it in place of TVM's loops (targets/llvm.py,
Target.with_f32_gemm). It must give the loops' own bits (the same k order, the same FMAs), so a build with it
decodes exactly as one without; checked here against the loops the schedule gives the same matmul, and against
numpy in float64 (ml_dtypes' bf16 weights: an independent widening), at symbolic rows (the library's functions,
below the host GEMM's rows) and static ones (the decode library's step)."""

from __future__ import annotations

import numpy as np
import pytest
from gemm_cases import operands, run_panels, within
from hardening import examples
from hypothesis import given, settings
from hypothesis import strategies as st

tvm = pytest.importorskip("tvm")

from k3compile.targets import resolve  # noqa: E402
from k3compile.targets.llvm import (  # noqa: E402
    F32_GEMM,
    F32_GEMM_ATTR,
    F32_GEMM_FEATURES,
    HOST_GEMM,
    bf16_gemm_object,
    schedule_func,
)

pytestmark = pytest.mark.skipif(not all(map(resolve("llvm").has_feature, F32_GEMM_FEATURES)),
                                reason="this CPU has no AVX-512: exact builds keep TVM's loops")


@pytest.fixture(scope="module")
def kernels(tmp_path_factory):
    """(k, rows, c) -> the packed dense matmul over K = k, N = 128 and `rows` rows (None: symbolic), scheduled with
    the fp32 GEMM (`c`) or with TVM's loops, written to disk (linked with the C object) and loaded."""
    from k3compile.passes.pack_dense_weights import packed_matmul_te
    from tvm import te

    folder = tmp_path_factory.mktemp("f32")
    made = {}

    def make(k: int, rows: int | None = None, c: bool = True):
        if (k, rows, c) not in made:
            m = te.var("m", "int64") if rows is None else rows
            x = te.placeholder((m, k), "float32", name="x")
            wp = te.placeholder((2, k, 64), "uint16", name="wp")
            func = schedule_func(te.create_prim_func([x, wp, packed_matmul_te(x, wp, 64)]), host_gemm=False,
                                 f32_gemm=c)
            assert (F32_GEMM in func.script()) == c and HOST_GEMM not in func.script()
            assert c == (func.attrs is not None and F32_GEMM_ATTR in func.attrs)
            path = folder / f"k{k}_{rows}_{c}.so"
            tvm.compile(tvm.IRModule({"main": func}), target=resolve("llvm").tvm()).export_library(
                str(path), addons=[bf16_gemm_object(folder)] if c else None)
            made[k, rows, c] = tvm.runtime.load_module(str(path))["main"]
        return made[k, rows, c]

    return make


ROWS = 6  # targets/bf16_gemm.c: rows per register tile (a pass over the panel)


@settings(max_examples=examples(24), deadline=None)
@given(rows=st.integers(1, 3 * ROWS + 2) | st.integers(125, 140), k=st.sampled_from([1, 3, 31, 96, 301]),
       seed=st.integers(0, 2 ** 16))
def test_it_gives_the_loops_bits_at_every_row_count(kernels, rows, k, seed):
    """Symbolic rows (the tiles' tails, several passes, a K that is not a multiple of the loops' split of 4): the
    C kernel's outputs equal the loops' bit for bit, and are within fp32's bound of the float64 product."""
    x, panels, w64 = operands(np.random.default_rng(seed), rows, k)
    got = run_panels(kernels(k), x, panels)
    assert np.array_equal(got.view(np.uint32), run_panels(kernels(k, c=False), x, panels).view(np.uint32))
    assert within(got, x, w64).all()


@pytest.mark.parametrize("rows", [1, 8])
def test_static_rows_call_it_too(kernels, rows):
    """The decode library's functions have static rows (batch 1): they call it as well, with the loops' bits."""
    x, panels, w64 = operands(np.random.default_rng(rows), rows, 96)
    got = run_panels(kernels(96, rows), x, panels)
    assert np.array_equal(got.view(np.uint32), run_panels(kernels(96, rows, c=False), x, panels).view(np.uint32))
    assert within(got, x, w64).all()


def test_a_non_finite_activation_reaches_its_row_only(kernels):
    """A NaN or an infinity in one row's activations makes that row's outputs non-finite and leaves the others as
    they were (in the first and the last 6-row pass)."""
    x, panels, w64 = operands(np.random.default_rng(2), 14, 96)
    x[1, 5], x[13, 0] = np.nan, np.inf
    got = run_panels(kernels(96), x, panels)
    assert np.isnan(got[1]).all() and not np.isfinite(got[13]).any()
    rest = np.ones(len(x), bool)
    rest[[1, 13]] = False
    assert within(got[rest], x[rest], w64).all()


def test_only_an_exact_cpu_build_uses_it():
    """Target.with_f32_gemm: the CPU target at fp32 takes it; a GPU target and a --matmul-precision bf16 one (whose
    matmuls call the bf16 GEMM) are left as they are."""
    cpu = resolve("llvm")
    assert cpu.with_f32_gemm() != cpu and cpu.with_f32_gemm().schedule_func.keywords == {"f32_gemm": True}
    assert resolve("opencl").with_f32_gemm() == resolve("opencl")
    if cpu.has_feature("avx512bf16"):
        bf16 = cpu.with_matmul_precision("bf16")
        assert bf16.with_f32_gemm() == bf16
