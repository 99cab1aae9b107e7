"""OCP Microscaling (MX v1.0) formats in torch: MXFP4 (E2M1) and MXFP8 (E4M3, E5M2).

Owns the FLOOR scale rule, round-to-nearest-even element rounding with saturation, E8M0 scale bytes and the
nibble packing of MXFP4 (element 2i in the low nibble). Everything here is bit-exact by construction: every
division is by a power of two, and rounding uses `torch.round` (round half to even).

Layout: a tensor [..., K] is quantized in blocks of 32 along its LAST dim. MXFP4 of a Linear weight [N, K]
gives `packed [N, K/2]` (uint8) and `scale [N, K/32]` (uint8 E8M0 bytes).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

BLOCK = 32
E8M0_NAN = 255


@dataclass(frozen=True)
class ElementFormat:
    """A small float element format: its mantissa bits, smallest normal exponent and largest normal value."""

    name: str
    mbits: int
    emin: int
    emax: int  # exponent of the largest normal value ("emax_elem" in the spec)
    max_normal: float


E2M1 = ElementFormat("e2m1", mbits=1, emin=0, emax=2, max_normal=6.0)
E4M3 = ElementFormat("e4m3", mbits=3, emin=-6, emax=8, max_normal=448.0)
E5M2 = ElementFormat("e5m2", mbits=2, emin=-14, emax=15, max_normal=57344.0)
FORMATS = {f.name: f for f in (E2M1, E4M3, E5M2)}

# E2M1 magnitudes by code 0..7; codes 8..15 are the negatives (8 is -0).
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


def element_format(name: str) -> ElementFormat:
    try:
        return FORMATS[name]
    except KeyError:
        raise ValueError(f"unknown MX element format {name!r}; expected one of {sorted(FORMATS)}") from None


def fp4_lut(device=None) -> torch.Tensor:
    """The 16 E2M1 code values as fp32 [16]."""
    pos = torch.tensor(FP4_VALUES, dtype=torch.float32, device=device)
    return torch.cat([pos, -pos])


def _blocks(x: torch.Tensor) -> torch.Tensor:
    k = x.shape[-1]
    if k % BLOCK:
        raise ValueError(f"MX quantization needs the last dim to be a multiple of {BLOCK}, got {k}")
    return x.reshape(*x.shape[:-1], k // BLOCK, BLOCK)


def scale_bytes_to_float(scale: torch.Tensor) -> torch.Tensor:
    """E8M0 bytes -> fp32 2^(b-127); byte 0 is the fp32 subnormal 2^-127, byte 255 is NaN."""
    b = scale.to(torch.int32)
    bits = torch.where(b == 0, torch.full_like(b, 0x00400000), b << 23)
    out = bits.view(torch.float32)
    return torch.where(b == E8M0_NAN, torch.full_like(out, float("nan")), out)


def floor_log2(x: torch.Tensor) -> torch.Tensor:
    """floor(log2(x)) for finite x > 0 (subnormals included), as int32. frexp: x = m * 2^e with m in [0.5, 1)."""
    _, e = torch.frexp(x)
    return e.to(torch.int32) - 1


def pow2(e: torch.Tensor) -> torch.Tensor:
    """Exact 2^e as fp32 for int32 e in the normal range [-126, 127], built from the exponent bits."""
    return ((e + 127) << 23).view(torch.float32)


def mx_scales(x: torch.Tensor, fmt: ElementFormat) -> torch.Tensor:
    """E8M0 scale bytes [..., K/32] for x [..., K] under the OCP FLOOR rule."""
    xb = _blocks(x.float())
    amax = xb.abs().amax(dim=-1)
    bad = ~torch.isfinite(xb).all(dim=-1)
    safe = torch.where(amax > 0, amax, torch.ones_like(amax))
    shared = (floor_log2(safe) - fmt.emax).clamp(-127, 127)
    byte = torch.where(amax > 0, shared + 127, torch.zeros_like(shared))
    byte = torch.where(bad, torch.full_like(byte, E8M0_NAN), byte)
    return byte.to(torch.uint8)


def round_to_format(v: torch.Tensor, fmt: ElementFormat) -> torch.Tensor:
    """Round fp32 v to the nearest value of fmt (ties to even), saturating at ±max_normal. Keeps the sign of zero."""
    mag = v.abs()
    e = floor_log2(torch.where(mag > 0, mag, torch.ones_like(mag))).clamp(min=fmt.emin)
    quantum = pow2(e - fmt.mbits)
    q = torch.round(mag / quantum) * quantum
    q = torch.clamp(q, max=fmt.max_normal)
    return torch.copysign(q, v)


def quantize_mx(x: torch.Tensor, fmt: ElementFormat | str) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., K] -> (element values as fp32 [..., K], scale bytes [..., K/32]). NaN blocks get byte 255."""
    fmt = element_format(fmt) if isinstance(fmt, str) else fmt
    x = x.float()
    scale = mx_scales(x, fmt)
    xs = scale_bytes_to_float(scale).unsqueeze(-1)
    xb = _blocks(x)
    elems = round_to_format(xb / xs, fmt)
    # A NaN block carries its NaN in the scale; its elements are don't-care zeros.
    elems = torch.where((scale == E8M0_NAN).unsqueeze(-1), torch.zeros_like(elems), elems)
    return elems.reshape(x.shape), scale


def dequantize_mx(elems: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Element values [..., K] (any float dtype) times their block scale -> fp32 [..., K]."""
    eb = _blocks(elems.float())
    return (eb * scale_bytes_to_float(scale).unsqueeze(-1)).reshape(elems.shape)


def fake_quant_mx(x: torch.Tensor, fmt: ElementFormat | str) -> torch.Tensor:
    """Quantize-dequantize (activation quantization in front of a matmul); returns x's dtype."""
    elems, scale = quantize_mx(x, fmt)
    return dequantize_mx(elems, scale).to(x.dtype)


def fp4_codes(values: torch.Tensor) -> torch.Tensor:
    """Exact E2M1 values (fp32) -> 4-bit codes (uint8 0..15); -0 maps to code 8."""
    mag = values.abs()
    idx = torch.bucketize(mag, fp4_lut(values.device)[:8])  # exact match -> its index
    return (idx.to(torch.uint8) | (torch.signbit(values).to(torch.uint8) << 3)).to(torch.uint8)


def pack_fp4(codes: torch.Tensor) -> torch.Tensor:
    """codes [..., K] (uint8 0..15) -> packed [..., K/2]: element 2i in the low nibble, 2i+1 in the high."""
    if codes.shape[-1] % 2:
        raise ValueError("packing needs an even last dim")
    c = codes.to(torch.uint8)
    return c[..., 0::2] | (c[..., 1::2] << 4)


def unpack_fp4(packed: torch.Tensor) -> torch.Tensor:
    """packed [..., K/2] uint8 -> codes [..., K] uint8."""
    lo = packed & 0x0F
    hi = packed >> 4
    return torch.stack([lo, hi], dim=-1).reshape(*packed.shape[:-1], packed.shape[-1] * 2)


def quantize_mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Weight [..., K] -> (packed uint8 [..., K/2], E8M0 scale bytes [..., K/32])."""
    elems, scale = quantize_mx(w, E2M1)
    return pack_fp4(fp4_codes(elems)), scale


def fp4_byte_lut(device=None) -> torch.Tensor:
    """[256, 2] fp32: a packed byte -> (value of its low nibble, value of its high nibble)."""
    lut = fp4_lut(device)
    return torch.stack([lut.repeat(16), lut.repeat_interleave(16)], dim=-1)


def dequantize_mxfp4(packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """(packed [..., K/2], scale [..., K/32]) -> fp32 [..., K]. One table lookup per byte (two elements)."""
    vals = torch.nn.functional.embedding(packed.long(), fp4_byte_lut(packed.device))
    return dequantize_mx(vals.reshape(*packed.shape[:-1], packed.shape[-1] * 2), scale)
