"""The step protocol every backend implements (eager, onnxruntime, onnx.reference; compiled targets next)."""

from __future__ import annotations

from typing import Protocol

from torch import Tensor

from k3compile.config import K3Config
from k3compile.interface import Past


class Backend(Protocol):
    name: str
    config: K3Config

    def init_past(self, batch: int) -> Past:
        """The empty decode state for `batch` sequences (interface.init_past's layout)."""

    def step(self, input_ids: Tensor, attention_mask: Tensor, past: Past) -> tuple[Tensor, Past]:
        """input_ids [B, T], attention_mask [B, P+T], past -> (logits [B, T, V], present); present feeds back."""
