"""The decode state as the model sees it: one (first, second) tensor pair per layer, passed in and returned
functionally (export-friendly). interface.py owns the layout; this module names it for the model code.

KDA layer:  (conv_state [B, 3·H·K, W-1]  pre-conv q|k|v projections of the last W-1 tokens,
             recurrent_state [B, H, K, V] fp32)
MLA layer:  (latent [B, P, kv_lora_rank]  normalized c,  k_rope [B, P, qk_rope_head_dim])
The attention mask spans past + new tokens, [B, P + T]; padding is on the left.
"""

from __future__ import annotations

from k3compile.interface import KDA_STATE_NAMES, MLA_STATE_NAMES, Past, init_past, past_length, state_names

__all__ = ["KDA_STATE_NAMES", "MLA_STATE_NAMES", "Past", "init_past", "past_length", "state_names"]
