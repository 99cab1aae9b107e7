"""MX formats against an independent reference built on ml_dtypes casts (docs/mx.md), plus the accuracy bounds."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
import torch

from k3compile.quant.mx import (
    dequantize_mx,
    dequantize_mxfp4,
    fp4_codes,
    pack_fp4,
    quantize_mx,
    quantize_mxfp4,
    unpack_fp4,
)

EMAX = {"e2m1": 2, "e4m3": 8, "e5m2": 15}
MAXN = {"e2m1": 6.0, "e4m3": 448.0, "e5m2": 57344.0}
NP_DTYPE = {"e2m1": ml_dtypes.float4_e2m1fn, "e4m3": ml_dtypes.float8_e4m3fn, "e5m2": ml_dtypes.float8_e5m2}


def reference(x: np.ndarray, fmt: str):
    """OCP FLOOR rule in numpy: exponent from np.frexp, element rounding by ml_dtypes (RNE), clipped first
    (ml_dtypes' e4m3 does not saturate). Returns (scale bytes, element values as fp32, dequantized fp32)."""
    xb = x.astype(np.float32).reshape(*x.shape[:-1], -1, 32)
    amax = np.abs(xb).max(-1)
    finite = np.isfinite(xb).all(-1)
    _, e = np.frexp(np.where(amax > 0, amax, 1.0).astype(np.float32))
    shared = np.clip(e.astype(np.int64) - 1 - EMAX[fmt], -127, 127)
    byte = np.where(amax > 0, shared + 127, 0)
    byte = np.where(finite, byte, 255).astype(np.uint8)
    with np.errstate(over="ignore", invalid="ignore"):  # byte 255 (NaN blocks) overflows; masked below
        scale = np.where(byte == 0, np.float32(2.0**-127), np.ldexp(np.float32(1.0), byte.astype(np.int64) - 127))
        scale = scale.astype(np.float32)
        v = np.clip(xb / scale[..., None], -MAXN[fmt], MAXN[fmt])
        elems = v.astype(NP_DTYPE[fmt]).astype(np.float32)
        elems = np.where(finite[..., None], elems, 0.0).astype(np.float32)
        deq = np.where(finite[..., None], elems * scale[..., None], np.nan)
    return byte, elems.reshape(x.shape), deq.reshape(x.shape).astype(np.float32)


def special_blocks() -> np.ndarray:
    rng = np.random.default_rng(0)
    rows = [
        rng.standard_normal(32),
        np.zeros(32),  # all-zero block -> byte 0
        np.full(32, 1e30),  # huge
        rng.standard_normal(32) * 1e-39,  # fp32 subnormals
        np.concatenate([[np.nan], rng.standard_normal(31)]),  # NaN block -> byte 255
        np.concatenate([[np.inf], rng.standard_normal(31)]),  # Inf block -> byte 255
        # ties: amax 6 -> scale 1 for fp4, halfway values between codes must round to even
        np.array([6.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.25, -0.75, -1.25, -1.75, -2.5, -3.5, -5.0, 0.0]
                 + [-0.0] * 16),
        # saturating block: amax just under the next power of two (rounds above max normal)
        np.array([7.9] + [7.5] * 31),
        np.array([480.0, 464.0, 500.0] + [1.0] * 29) * 1.0,  # e4m3 range edge
        -np.abs(rng.standard_normal(32)) * 1e-3,  # negatives rounding to -0
    ]
    return np.stack(rows).astype(np.float32)


@pytest.mark.parametrize("fmt", ["e2m1", "e4m3", "e5m2"])
def test_quantize_bit_exact_against_ml_dtypes_reference(fmt):
    rng = np.random.default_rng(1)
    wide = rng.standard_normal(64 * 32) * 10.0 ** rng.integers(-6, 6, 64 * 32)  # 12 decades of magnitude
    x = np.concatenate([special_blocks().reshape(-1), wide])
    x = x.astype(np.float32).reshape(-1, 64)
    byte, elems, deq = reference(x, fmt)
    got_e, got_s = quantize_mx(torch.from_numpy(x), fmt)
    np.testing.assert_array_equal(got_s.numpy(), byte)
    # compare bit patterns, so that -0 vs +0 counts
    np.testing.assert_array_equal(got_e.numpy().view(np.uint32), elems.view(np.uint32))
    got_d = dequantize_mx(got_e, got_s).numpy()
    np.testing.assert_array_equal(np.isnan(got_d), np.isnan(deq))
    ok = ~np.isnan(deq)
    np.testing.assert_array_equal(got_d[ok].view(np.uint32), deq[ok].view(np.uint32))


def test_special_cases_by_hand():
    e, s = quantize_mx(torch.tensor(special_blocks()[:2].reshape(-1)), "e2m1")
    assert s[1].item() == 0  # zero block
    e, s = quantize_mx(torch.tensor(special_blocks()[4]), "e2m1")
    assert s.item() == 255 and torch.isnan(dequantize_mx(e, s)).all()
    # ties to even: 0.25 -> 0, 0.75 -> 1, 1.25 -> 1, 1.75 -> 2, 2.5 -> 2, 3.5 -> 4, 5 -> 4
    e, s = quantize_mx(torch.tensor(special_blocks()[6]), "e2m1")
    assert s.item() == 127
    assert e[:8].tolist() == [6.0, 0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0]
    # saturation: 7.9 -> scale 2^0 (floor(log2 7.9) - 2 = 0), 7.9 / 1 rounds to 8 -> saturates to 6
    e, s = quantize_mx(torch.tensor(special_blocks()[7]), "e2m1")
    assert s.item() == 127 and e[0].item() == 6.0


def test_fp4_codes_and_nibble_order():
    vals = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])
    codes = fp4_codes(vals)
    assert codes.tolist() == list(range(16))
    # cross-check against ml_dtypes' own fp4 bit patterns
    ref = vals.numpy().astype(ml_dtypes.float4_e2m1fn).view(np.uint8) & 0x0F
    assert codes.numpy().tolist() == ref.tolist()
    packed = pack_fp4(torch.tensor([[1, 2, 3, 15]], dtype=torch.uint8))
    assert packed.tolist() == [[0x21, 0xF3]]  # element 2i in the low nibble
    assert unpack_fp4(packed).tolist() == [[1, 2, 3, 15]]


def test_mxfp4_pack_roundtrip_matches_reference():
    x = torch.randn(8, 128)
    packed, scale = quantize_mxfp4(x)
    assert packed.dtype == torch.uint8 and packed.shape == (8, 64) and scale.shape == (8, 4)
    byte, _, deq = reference(x.numpy(), "e2m1")
    np.testing.assert_array_equal(scale.numpy(), byte)
    np.testing.assert_array_equal(dequantize_mxfp4(packed, scale).numpy(), deq)


def test_accuracy_bounds_prove_quantization_happened():
    # docs/mx.md: Gaussian MXFP4 weights 0.114 relative Frobenius error, MXFP8-E4M3 0.029.
    x = torch.randn(256, 1024, generator=torch.Generator().manual_seed(3))
    d4 = dequantize_mxfp4(*quantize_mxfp4(x))
    rel4 = ((d4 - x).norm() / x.norm()).item()
    assert 0.08 <= rel4 <= 0.16
    d8 = dequantize_mx(*quantize_mx(x, "e4m3"))
    assert ((d8 - x).norm() / x.norm()).item() < 0.05
    # per-element FLOOR bounds: 0.25 amax (fp4), 0.125 amax (fp8)
    amax = x.view(256, 32, 32).abs().amax(-1, keepdim=True)
    assert ((d4 - x).view(256, 32, 32).abs() <= 0.25 * amax).all()
    assert ((d8 - x).view(256, 32, 32).abs() <= 0.125 * amax).all()


@pytest.mark.parametrize("act", ["none", "e4m3", "e5m2"])
def test_mxfp4_matmul_op_against_reference(act):
    """k3::mxfp4_matmul against numpy on the ml_dtypes reference's operands (docs/mx.md: rtol 1e-5, atol 1e-5·max|Y|,
    accumulation order only)."""
    gen = torch.Generator().manual_seed(7)
    x, w = torch.randn(5, 96, generator=gen), torch.randn(24, 96, generator=gen)
    packed, scale = quantize_mxfp4(w)
    _, _, w_ref = reference(w.numpy(), "e2m1")
    x_ref = x.numpy() if act == "none" else reference(x.numpy(), act)[2]
    want = x_ref.astype(np.float64) @ w_ref.astype(np.float64).T
    got = torch.ops.k3.mxfp4_matmul(x, packed, scale, act).numpy()
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
