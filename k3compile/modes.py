"""The names of the model's execution forms, each family owned here once (docs/architecture.md, "Forms").

`Forms` is what a caller passes to `K3ForCausalLM.forward` to choose how the same weights are computed: the MLA
form and the activation quantization in front of the expert matmuls. The eager default picks the MLA form by shape;
an export fixes the absorbed form (one graph for every shape). The enums subclass `str`, so they compare equal to
their values and pass through torch custom ops and ONNX attributes as plain strings (`.value`).
A leaf: it imports nothing of k3compile.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum


class MLAForm(str, Enum):
    AUTO = "auto"  # absorbed for a single decoded token with a cache, naive otherwise
    NAIVE = "naive"  # expand the cache into per-head keys and values
    ABSORBED = "absorbed"  # attend in latent space (decode's form; the exported form for every shape)


class ActQuant(str, Enum):
    """MXFP8 fake quantization of the activations in front of the expert matmuls."""

    NONE = "none"
    E4M3 = "e4m3"
    E5M2 = "e5m2"


class ExpertFormat(str, Enum):
    FLOAT = "float"
    MXFP4 = "mxfp4"  # packed E2M1 nibbles + E8M0 scale bytes, 32-element blocks


class DenseFormat(str, Enum):
    """How a compiled artifact stores its dense matrices (docs/architecture.md, "Dense weights")."""

    FP32 = "fp32"
    BF16 = "bf16"  # the upper 16 bits of the fp32 value, widened in the matmul kernel by a 16-bit shift
    MXFP8 = "mxfp8"  # OCP E4M3 codes + E8M0 scales per 32 values along K, decoded in the matmul kernel


# auto: what the export holds (mxfp8 when it was exported so), else bf16 where that is lossless, else fp32
DENSE_CHOICES = ("auto", *(f.value for f in DenseFormat))
# What an export's dense matrices hold (export.json "dense_weights"): the source's values, or their MXFP8 values
# (quantized at export: k3compile/quant/dense.py), which eager applies too when it rebuilds the model.
DENSE_QUANT = ("source", DenseFormat.MXFP8.value)


class Activation(str, Enum):
    SILU = "silu"
    SITU = "situ"


# The CLI's spellings of --activations, and the activation quantization each means.
ACT_QUANT_FLAGS = {"none": ActQuant.NONE, "mxfp8": ActQuant.E4M3, "mxfp8-e5m2": ActQuant.E5M2}


@dataclass(frozen=True)
class Forms:
    mla: MLAForm = MLAForm.AUTO
    act_quant: ActQuant = ActQuant.NONE

    @classmethod
    def exported(cls, act_quant: ActQuant | str = ActQuant.NONE) -> Forms:
        """The forms an exported graph carries: absorbed MLA for every T (a Python branch on T would pin T under
        torch.export), and the chosen activation quantization."""
        return cls(MLAForm.ABSORBED, ActQuant(act_quant))


EAGER = Forms()
