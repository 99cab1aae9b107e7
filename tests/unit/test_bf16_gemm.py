"""The bf16 GEMM (targets/bf16_gemm.c) that `compile --matmul-precision bf16` links into a CPU library, against
numpy in float64 over the activations that ml_dtypes rounds to bf16 (round to nearest even: an independent
rounding), through the kernel the CPU schedule gives a packed dense matmul (targets/llvm.py): at every row count,
symbolic (the library's functions) or static (the decode library's step), it calls the C function, whose paths
are all covered: up to STREAM_ROWS rows the panel's pairs interleaved in registers as it streams, past them an
interleaved copy of each panel first, and on a CPU with AMX-BF16 from AMX_MIN_ROWS rows that copy multiplied by
AMX tiles (both with AMX and without it there)."""

from __future__ import annotations

import os
from unittest import mock

import ml_dtypes
import numpy as np
import pytest
from gemm_cases import operands, run_panels, within
from hardening import examples
from hypothesis import given, settings
from hypothesis import strategies as st

tvm = pytest.importorskip("tvm")

from k3compile.targets import resolve  # noqa: E402
from k3compile.targets.llvm import (  # noqa: E402
    BF16_GEMM,
    BF16_GEMM_ATTR,
    BF16_GEMM_FEATURE,
    HOST_GEMM,
    bf16_gemm_object,
    schedule_func,
)

from k3compile.interface import ExportError  # noqa: E402

pytestmark = pytest.mark.skipif(not resolve("llvm").has_feature(BF16_GEMM_FEATURE),
                                reason="this CPU has no AVX512_BF16: --matmul-precision bf16 is refused on it")


@pytest.fixture(scope="module")
def kernels(tmp_path_factory):
    """(k, rows) -> the packed dense matmul over K = k, N = 128 and `rows` rows (None: symbolic), scheduled with
    the bf16 GEMM and linked with the C object into a library written to disk and loaded, as compile builds one."""
    from k3compile.passes.pack_dense_weights import packed_matmul_te
    from tvm import te

    folder = tmp_path_factory.mktemp("bf16")
    made = {}

    def make(k: int, rows: int | None = None):
        if (k, rows) not in made:
            m = te.var("m", "int64") if rows is None else rows
            x = te.placeholder((m, k), "float32", name="x")
            wp = te.placeholder((2, k, 64), "uint16", name="wp")
            func = schedule_func(te.create_prim_func([x, wp, packed_matmul_te(x, wp, 64)]), bf16_gemm=True)
            assert func.attrs[BF16_GEMM_ATTR] and HOST_GEMM not in func.script()
            path = folder / f"k{k}_{rows}.so"
            tvm.compile(tvm.IRModule({"main": func}), target=resolve("llvm").tvm()).export_library(
                str(path), addons=[bf16_gemm_object(folder)])
            made[k, rows] = tvm.runtime.load_module(str(path))["main"]
        return made[k, rows]

    return make


def _bf16(x):
    return x.astype(ml_dtypes.bfloat16).astype(np.float32)


STREAM_ROWS = 128  # targets/bf16_gemm.c: up to this many rows the panels stream, past it they are copied first
AMX_MIN_ROWS = 64  # targets/bf16_gemm.c: from this many rows the copy path uses AMX where the CPU has it
AMX_BLOCK = 128  # targets/bf16_gemm.c: k pairs per AMX pass (K past 256 accumulates over passes)


def _amx(on: bool):
    """The kernel's AMX path allowed (where the CPU has AMX-BF16) or not (K3_BF16_GEMM_AMX=0, read at each call):
    on such a CPU both the AMX path and the AVX-512 copy path run; elsewhere both are the AVX-512 one."""
    return mock.patch.dict(os.environ, {"K3_BF16_GEMM_AMX": "1" if on else "0"})


@settings(max_examples=examples(24), deadline=None)
@given(rows=st.integers(1, 20) | st.integers(AMX_MIN_ROWS - 3, AMX_MIN_ROWS + 3)
       | st.integers(STREAM_ROWS - 6, STREAM_ROWS + 13), k=st.sampled_from([1, 31, 96, 2 * AMX_BLOCK + 45]),
       amx=st.booleans(), seed=st.integers(0, 2 ** 16))
def test_every_row_count_multiplies_bf16_activations(kernels, rows, k, amx, seed):
    """Every row (the streamed path, the interleaved copy's and AMX's where the CPU has it, the 6-row tiles' and
    32-row blocks' tails included), an odd K and one AMX accumulates over passes: within fp32's bound of the
    float64 product of the bf16-rounded activations, and (K > 1, random data) outside it for the fp32
    activations: the rounding happened."""
    x, panels, w64 = operands(np.random.default_rng(seed), rows, k)
    with _amx(amx):
        got = run_panels(kernels(k), x, panels)
    assert within(got, _bf16(x), w64).all()
    if k > 1:
        assert not within(got, x, w64).all()


@pytest.mark.parametrize("rows", [1, 8])
def test_static_rows_call_it_too(kernels, rows):
    """The decode library's functions have static rows (batch 1): they call the C function as well, so a row's
    logits never depend on the batch it decodes in."""
    x, panels, w64 = operands(np.random.default_rng(rows), rows, 96)
    got = run_panels(kernels(96, rows), x, panels)
    assert within(got, _bf16(x), w64).all() and not within(got, x, w64).all()


@pytest.mark.parametrize("rows,amx", [(4, True), (STREAM_ROWS + 2, True), (STREAM_ROWS + 2, False)])
def test_a_non_finite_activation_reaches_its_row_only(kernels, rows, amx):
    """A NaN or an infinity in one row's activations makes that row's outputs non-finite (bf16 keeps both), and
    leaves every other row as it was, on every path (with AMX: the NaN in a 32-row block, the inf in the tail)."""
    x, panels, w64 = operands(np.random.default_rng(2), rows, 96)
    x[1, 5], x[rows - 1, 0] = np.nan, np.inf
    with _amx(amx):
        got = run_panels(kernels(96), x, panels)
    assert np.isnan(got[1]).all() and not np.isfinite(got[rows - 1]).any()
    rest = np.ones(len(x), bool)
    rest[[1, rows - 1]] = False
    assert within(got[rest], _bf16(x[rest]), w64).all()


def test_the_c_source_compiles_and_exports_the_function(tmp_path):
    import subprocess

    obj = bf16_gemm_object(tmp_path)
    assert BF16_GEMM in subprocess.run(["nm", obj], capture_output=True, text=True, check=True).stdout


def test_a_gpu_target_and_an_unknown_precision_are_refused():
    with pytest.raises(ExportError, match="applies to the CPU"):
        resolve("opencl").with_matmul_precision("bf16")
    with pytest.raises(ExportError, match="unknown matmul precision"):
        resolve("llvm").with_matmul_precision("fp16")
    assert resolve("llvm").with_matmul_precision("fp32") == resolve("llvm")
