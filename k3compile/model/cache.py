"""Decode state: one tuple of tensors per layer, passed in and returned functionally (export-friendly).

KDA layer:  (conv_state [B, 3·H·K, W-1]  pre-conv q|k|v projections of the last W-1 tokens,
             recurrent_state [B, H, K, V] fp32)
MLA layer:  (latent [B, P, kv_lora_rank]  normalized c,  k_rope [B, P, qk_rope_head_dim])
The attention mask spans past + new tokens, [B, P + T]; padding is on the left.
"""

from __future__ import annotations

import torch
from torch import Tensor

from k3compile.config import K3Config

Past = list[tuple[Tensor, Tensor]]

KDA_STATE_NAMES = ("conv_state", "recurrent_state")
MLA_STATE_NAMES = ("latent", "k_rope")


def state_names(cfg: K3Config, layer: int) -> tuple[str, str]:
    return MLA_STATE_NAMES if cfg.is_mla(layer) else KDA_STATE_NAMES


def init_past(cfg: K3Config, batch: int, dtype: torch.dtype = torch.float32, device=None) -> Past:
    """Empty decode state: zero KDA states and zero-length MLA caches."""
    past: Past = []
    hk = cfg.kda_num_heads * cfg.kda_head_dim
    for i in range(cfg.num_hidden_layers):
        if cfg.is_mla(i):
            past.append((
                torch.zeros(batch, 0, cfg.kv_lora_rank, dtype=dtype, device=device),
                torch.zeros(batch, 0, cfg.qk_rope_head_dim, dtype=dtype, device=device),
            ))
        else:
            past.append((
                torch.zeros(batch, 3 * hk, cfg.conv_kernel_size - 1, dtype=dtype, device=device),
                torch.zeros(batch, cfg.kda_num_heads, cfg.kda_head_dim, cfg.kda_head_dim, dtype=torch.float32,
                            device=device),
            ))
    return past


def past_length(cfg: K3Config, past: Past) -> int:
    """Tokens already seen (the MLA cache length); 0 for a model with no MLA layer and no tracking."""
    for i, (a, _) in enumerate(past):
        if cfg.is_mla(i):
            return a.shape[1]
    return 0
