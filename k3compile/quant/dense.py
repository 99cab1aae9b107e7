"""Dense weights quantized to MXFP8 at export (docs/architecture.md, "Dense weights").

`export --dense-weights mxfp8` replaces every dense matrix of the model (each `nn.Linear` whose input width is a
multiple of the MX block) by its MXFP8 values: OCP E4M3 elements with one E8M0 scale per 32 consecutive inputs
(`quant/mx.py`, bit-exact), so the exported graph, the parity check and the eager model `verify` rebuilds
(pipeline.eager_of) all hold the same numbers, and the compiler stores them exactly as one code byte per value
plus one scale byte per 32 (passes/pack_dense_weights.py). The router (a bare parameter, not an `nn.Linear`),
the embedding, the norms, the convolution and the routed experts (MXFP4 already) are left as they are.
"""

from __future__ import annotations

import copy

import numpy as np
import torch

from k3compile.modes import DENSE_QUANT
from k3compile.quant.mx import BLOCK, E4M3, dequantize_mx, fake_quant_mx, quantize_mx

# The largest scale byte the CPU kernel decodes: it applies a block's scale as the fp32 2^(scale - 71)
# (passes/pack_dense_weights.py: mxfp8_factor), a normal number while scale <= 198 (a block whose largest
# magnitude is below 2^80). A matrix past it is stored another way (compile.py: dense_values).
MXFP8_SCALE_MAX = 198


def dense_matrices(model: torch.nn.Module) -> list[tuple[str, torch.nn.Linear]]:
    """(name, module) of every `nn.Linear` whose weight MXFP8 can block (input width a multiple of 32)."""
    return [(n, m) for n, m in model.named_modules()
            if isinstance(m, torch.nn.Linear) and m.in_features % BLOCK == 0]


def with_dense_weights(model: torch.nn.Module, fmt: str = "source") -> torch.nn.Module:
    """`model` itself for "source"; for "mxfp8" a copy whose dense matrices hold their MXFP8 (E4M3) values, blocks
    of 32 along the input dim (the matmul's reduction). The model passed in is never changed."""
    if fmt not in DENSE_QUANT:
        raise ValueError(f"dense weights: {fmt!r} is not one of {', '.join(DENSE_QUANT)}")
    if fmt == "source":
        return model
    out = copy.deepcopy(model)
    with torch.no_grad():
        for _, lin in dense_matrices(out):
            lin.weight.copy_(fake_quant_mx(lin.weight.float(), E4M3).to(lin.weight.dtype))
    return out


def holds_mxfp8(value: np.ndarray, axis: int) -> bool:
    """A 2-D fp32 matrix holds MXFP8 values with its blocks along `axis` (so storing it as codes and scales is
    exact) and no scale past MXFP8_SCALE_MAX."""
    if value.ndim != 2 or value.dtype != np.float32 or value.shape[axis] % BLOCK:
        return False
    t = torch.from_numpy(np.ascontiguousarray(np.moveaxis(value, axis, -1)))
    elems, scales = quantize_mx(t, E4M3)  # a block with a NaN or an infinity gets scale byte 255: refused below
    return int(scales.max()) <= MXFP8_SCALE_MAX and torch.equal(dequantize_mx(elems, scales), t)

