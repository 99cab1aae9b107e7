"""The k3 custom ops (torch.library namespace `k3`): where K3 departs from what ONNX and TVM already know.

Each op is one module owning its levels: the eager torch reference(s), the fake (shape) implementation that
lets `torch.export` trace the model with the op as one node, its ONNX schema, standard-op function body and the
translation torch.onnx uses. Importing a module registers its torch op.
"""

from k3compile.ops import kda_recurrence, latent_moe_dispatch, mxfp4_matmul  # noqa: F401  (registers the ops)
