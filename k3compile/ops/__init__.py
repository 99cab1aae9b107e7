"""The k3 custom ops (torch.library namespace `k3`): where K3 departs from what ONNX and TVM already know.

Each op is one module owning its levels: the eager torch reference(s), the fake (shape) implementation that
lets `torch.export` trace the model with the op as one node, and (with the exporter) its ONNX schema and body.
"""

from k3compile.ops.kda_recurrence import kda_chunked, kda_recurrence, kda_recurrent
from k3compile.ops.latent_moe_dispatch import latent_moe_dispatch, latent_moe_dispatch_eager
from k3compile.ops.mxfp4_matmul import ACT_QUANT, mxfp4_matmul, mxfp4_matmul_eager

__all__ = [
    "ACT_QUANT",
    "kda_chunked",
    "kda_recurrence",
    "kda_recurrent",
    "latent_moe_dispatch",
    "latent_moe_dispatch_eager",
    "mxfp4_matmul",
    "mxfp4_matmul_eager",
]
