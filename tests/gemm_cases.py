"""Operands and checks shared by the C GEMMs' tests (tests/unit/test_bf16_gemm.py, test_f32_gemm.py): random fp32
activations, bf16 weights drawn by ml_dtypes (an independent rounding) laid out as the [N/64, K, 64] panels the
kernels read, and fp32's dot-product bound against float64."""

from __future__ import annotations

import ml_dtypes
import numpy as np


def operands(rng, rows: int, k: int):
    """(x fp32 [rows, k], the panels' bf16 bits [2, k, 64], the weights in float64 [k, 128])."""
    x = rng.standard_normal((rows, k)).astype(np.float32)
    w = rng.standard_normal((k, 128)).astype(ml_dtypes.bfloat16)
    panels = np.ascontiguousarray(w.view(np.uint16).reshape(k, 2, 64).transpose(1, 0, 2))
    return x, panels, w.astype(np.float64)


def run_panels(kernel, x, panels):
    """`kernel` (a compiled packed matmul of N = 128) on x and the panels: y as numpy."""
    import tvm

    y = tvm.runtime.empty((x.shape[0], 128), "float32")
    kernel(tvm.runtime.tensor(x), tvm.runtime.tensor(panels), y)
    return y.numpy()


def within(got, x, w64) -> np.ndarray:
    """Whether each output is within the fp32 dot-product bound of x @ w in float64 (any summation order):
    |error| <= K * 2^-23 * sum_k |x_k w_kn|."""
    x64 = x.astype(np.float64)
    return np.abs(got - x64 @ w64) <= x.shape[1] * 2.0 ** -23 * (np.abs(x64) @ np.abs(w64))
