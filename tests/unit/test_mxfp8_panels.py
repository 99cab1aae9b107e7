"""MXFP8 dense matrices in the CPU build (passes/pack_dense_weights.py; issue #19 item 1): the compile-time encoder
gives the OCP rule's scales (k3compile/quant/mx.py) and codes that an independent E4M3 decoder (ml_dtypes) reads
as the quantized values, and the kernel's in-register decode is exact: a matmul by one-hot rows returns the matrix
bit for bit (subnormal codes, zero blocks, -0 and the largest scale the kernel takes included)."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
import torch
import tvm
from k3compile.passes import run_phases
from k3compile.passes.pack_dense_weights import PACKED
from k3compile.targets import resolve
from tvm import relax

from k3compile.compile import dense_values
from k3compile.quant.dense import MXFP8_SCALE_MAX, holds_mxfp8
from k3compile.quant.mx import E4M3, fake_quant_mx, mx_scales, quantize_mx

TARGET = resolve().with_dense("mxfp8")


def _module(k: int, n: int, transposed: bool):
    """main(x [b, s, K], w) = x @ W, W the weight w ([K, N]) or its transpose (w [N, K], a Linear's layout)."""
    b, s = tvm.tirx.Var("b", "int64"), tvm.tirx.Var("s", "int64")
    x = relax.Var("x", relax.TensorType([b, s, k], "float32"))
    w = relax.Var("w", relax.TensorType([n, k] if transposed else [k, n], "float32"))
    bb = relax.BlockBuilder()
    with bb.function("main", [x, w], attrs={"num_input": 1}):
        with bb.dataflow():
            rhs = bb.emit(relax.op.permute_dims(w, [1, 0])) if transposed else w
            y = bb.emit_output(relax.op.matmul(x, rhs))
        bb.emit_func_output(y)
    return bb.get()


def _mx_matrix(n: int, k: int, seed: int = 0) -> np.ndarray:
    """[N, K] MXFP8 values (blocks along K) with the corners: a zero block, subnormal codes, -0, scale 0 (a block
    below 2^-118) and the largest scale the kernel decodes."""
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((n, k)).astype(np.float32) * np.exp2(rng.integers(-12, 6, (n, 1))).astype(np.float32)
    w[3, :32] = 0.0
    w[5, 32:64] *= 1e-3
    w[5, 40] = 7.0  # the block's scale set by 7: the others fall to E4M3's subnormals
    w[7, 0] = -0.0
    w[9, :32] = rng.standard_normal(32).astype(np.float32) * 2.0 ** -122  # scale byte 0
    w[11, 32:64] = rng.standard_normal(32).astype(np.float32) * 2.0 ** 78
    w[11, 32] = 448.0 * 2.0 ** 71  # scale byte 198 = MXFP8_SCALE_MAX
    q = fake_quant_mx(torch.from_numpy(w), E4M3)
    assert int(mx_scales(q, E4M3).max()) == MXFP8_SCALE_MAX and int(mx_scales(q, E4M3).min()) == 0
    return q.numpy()


def _build(mod, weight: np.ndarray):
    mod = dense_values(["w"], [tvm.runtime.tensor(weight)], mod)
    built = run_phases(mod, TARGET)
    ex = tvm.compile(built, target=TARGET.tvm(), relax_pipeline=tvm.transform.Sequential(TARGET.finish_passes()))
    vm = relax.VirtualMachine(ex, tvm.cpu())
    stored = list(vm["main_transform_params"]([tvm.runtime.tensor(weight)]))
    return built, vm, stored


@pytest.mark.parametrize("transposed", [True, False])
def test_encoder_and_kernel_are_exact(transposed):
    n, k = 128, 96
    wq = _mx_matrix(n, k)  # [N, K]
    weight = wq if transposed else np.ascontiguousarray(wq.T)
    built, vm, stored = _build(_module(k, n, transposed), weight)
    assert dict(built.attrs[PACKED]) == {"w": "mxfp8"}
    codes = next(s.numpy() for s in stored if tuple(s.shape) == (n // 64, k, 64))
    scales = next(s.numpy() for s in stored if tuple(s.shape) == (n // 64, k // 32, 64))
    assert codes.dtype == scales.dtype == np.uint8
    elems, ref_scales = quantize_mx(torch.from_numpy(wq), E4M3)
    assert np.array_equal(scales, ref_scales.numpy().reshape(n // 64, 64, k // 32).transpose(0, 2, 1))
    decoded = codes.view(ml_dtypes.float8_e4m3fn).astype(np.float32)
    want = elems.numpy().reshape(n // 64, 64, k).transpose(0, 2, 1)
    assert np.array_equal(decoded, want) and np.array_equal(np.signbit(decoded), np.signbit(want))
    # one-hot rows: each output row is one row of W = wq.T, one product and exact zeros: bit for bit
    eye = np.eye(k, dtype=np.float32)[None]
    y = vm["main"](tvm.runtime.tensor(eye), *stored).numpy()[0]
    assert np.array_equal(y, wq.T)


@pytest.mark.parametrize("magnitude", [1e-9, 1.0, 1e6])
def test_the_kernel_keeps_fp32_precision_for_tiny_and_large_activations(magnitude):
    """The partial sums hold x * value scaled by powers of two (exact); they stay normal fp32 numbers for
    activations from 1e-9 to 1e6 against weights from 2^-12 to 2^80, so the result is fp32-accurate: within 1e-5
    of float64 relative to the output's scale (summation order only; 24-bit sums of 96 terms: ~1e-6)."""
    n, k = 128, 96
    wq = _mx_matrix(n, k)
    wq[9, :32] = 0.0  # the scale-0 block's values (~2^-130) times 1e-9 underflow in any fp32 product: kept out
    _, vm, stored = _build(_module(k, n, True), wq)
    rng = np.random.default_rng(2)
    x = (rng.standard_normal((1, 5, k)) * magnitude).astype(np.float32)
    y = vm["main"](tvm.runtime.tensor(x), *stored).numpy()
    want = x.astype(np.float64) @ wq.T.astype(np.float64)
    scale = np.abs(x.astype(np.float64)) @ np.abs(wq.T.astype(np.float64))  # the sum of |terms| per output
    assert np.all(np.abs(y - want) <= 1e-5 * scale + 1e-45)


def test_a_matrix_that_does_not_hold_mxfp8_values_is_stored_another_way():
    """In an mxfp8 build a matrix off the MXFP8 grid stays exact: bf16 bits where it holds bf16, else fp32."""
    n, k = 64, 64
    rng = np.random.default_rng(1)
    bf16 = torch.from_numpy(rng.standard_normal((n, k)).astype(np.float32)).bfloat16().float().numpy()
    assert not holds_mxfp8(bf16, 1)
    built, _, stored = _build(_module(k, n, True), bf16)
    assert dict(built.attrs[PACKED]) == {"w": "bf16"} and stored[0].numpy().dtype == np.uint16
    wide = rng.standard_normal((n, k)).astype(np.float32)
    built, _, stored = _build(_module(k, n, True), wide)
    assert dict(built.attrs[PACKED]) == {"w": "fp32"} and stored[0].numpy().dtype == np.float32


def test_holds_mxfp8():
    wq = _mx_matrix(64, 64)
    assert holds_mxfp8(wq, 1) and not holds_mxfp8(wq, 0)  # its blocks run along K (axis 1), not down N
    assert holds_mxfp8(np.ascontiguousarray(wq.T), 0)
    assert not holds_mxfp8(wq * np.float32(4.0), 1)  # still MXFP8 values, but a scale past what the kernel decodes
    assert not holds_mxfp8(wq[:, :48], 1)  # K not a multiple of 32
    bad = wq.copy()
    bad[0, 0] = np.nan
    assert not holds_mxfp8(bad, 1)
    assert not holds_mxfp8(wq.astype(np.float64), 1)
