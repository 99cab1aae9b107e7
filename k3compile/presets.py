"""The built-in presets and the resolution of a SOURCE to its config (docs/model.md, "Presets").

`k3` is exactly the published text config; `kimi-linear-48b` the Kimi-Linear release; `k3-tiny` runs in
milliseconds yet has every K3 feature (the test preset); `k3-small` is the benchmark size.
"""

from __future__ import annotations

from pathlib import Path

from k3compile.config import ConfigError, K3Config, read_config

# ---- presets -------------------------------------------------------------------------------------------------------

def _k3() -> K3Config:
    full = tuple(i - 1 for i in [*range(4, 93, 4), 93])  # 1-indexed [4, 8, ..., 92, 93]: 24 MLA layers
    return K3Config(
        name="k3", vocab_size=163840, hidden_size=7168, num_hidden_layers=93, full_attn_layers=full,
        rms_norm_eps=1e-5, tie_word_embeddings=False, max_position_embeddings=1048576,
        bos_token_id=163584, eos_token_id=163586, pad_token_id=163839,
        kda_num_heads=96, kda_head_dim=128, conv_kernel_size=4, gate_lower_bound=-5.0, use_full_rank_gate=True,
        num_attention_heads=96, q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
        v_head_dim=128, mla_use_output_gate=True,
        hidden_act="situ", activation_situ_beta=4.0, activation_situ_linear_beta=25.0,
        intermediate_size=33792, first_k_dense_replace=1, num_experts=896, num_experts_per_token=16,
        num_shared_experts=2, moe_intermediate_size=3072, routed_expert_hidden_size=3584, latent_moe_use_norm=True,
        moe_renormalize=True, routed_scaling_factor=1.0, num_expert_group=1, topk_group=1,
        expert_format="mxfp4", attn_res_block_size=12,
    )


def _kimi_linear_48b() -> K3Config:
    full = tuple(i - 1 for i in (4, 8, 12, 16, 20, 24, 27))
    return K3Config(
        name="kimi-linear-48b", vocab_size=163840, hidden_size=2304, num_hidden_layers=27, full_attn_layers=full,
        bos_token_id=163584, eos_token_id=163586, pad_token_id=163839,
        kda_num_heads=32, kda_head_dim=128, num_attention_heads=32, q_lora_rank=None, kv_lora_rank=512,
        qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
        hidden_act="silu", intermediate_size=9216, first_k_dense_replace=1, num_experts=256, num_experts_per_token=8,
        num_shared_experts=1, moe_intermediate_size=1024, routed_scaling_factor=2.446,
    )


def _k3_tiny() -> K3Config:
    # 7 layers: dense layer 0; MLA at 3, 5, 6 (the last two MLA, like K3); AttnRes blocks of 2 -> 4 banked
    # summaries; latent MoE (32 of 64) with 2 shared experts and MXFP4 routed experts.
    return _k3().replace(
        name="k3-tiny", vocab_size=256, hidden_size=64, num_hidden_layers=7, full_attn_layers=(3, 5, 6),
        max_position_embeddings=65536, bos_token_id=1, eos_token_id=2, pad_token_id=0,
        kda_num_heads=2, kda_head_dim=16, num_attention_heads=2, q_lora_rank=32, kv_lora_rank=32,
        qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
        intermediate_size=128, num_experts=8, num_experts_per_token=2, num_shared_experts=2,
        moe_intermediate_size=32, routed_expert_hidden_size=32, attn_res_block_size=2,
    )


def _k3_small() -> K3Config:
    # A benchmark size (~0.4 B parameters): every K3 feature at widths where kernels matter.
    return _k3().replace(
        name="k3-small", vocab_size=32768, hidden_size=1024, num_hidden_layers=12,
        full_attn_layers=(3, 7, 10, 11), max_position_embeddings=65536, bos_token_id=1, eos_token_id=2,
        pad_token_id=0, kda_num_heads=8, kda_head_dim=128, num_attention_heads=8, q_lora_rank=256,
        kv_lora_rank=128, qk_nope_head_dim=64, qk_rope_head_dim=32, v_head_dim=64,
        intermediate_size=2816, num_experts=32, num_experts_per_token=4, num_shared_experts=2,
        moe_intermediate_size=512, routed_expert_hidden_size=512, attn_res_block_size=4,
    )


PRESETS = {"k3": _k3, "kimi-linear-48b": _kimi_linear_48b, "k3-tiny": _k3_tiny, "k3-small": _k3_small}
DEFAULT_PRESET = "k3-tiny"


def preset(name: str) -> K3Config:
    try:
        return PRESETS[name]()
    except KeyError:
        raise ConfigError(f"unknown preset {name!r}; known presets: {', '.join(PRESETS)}") from None


def load_config(source: str | Path) -> K3Config:
    """A preset name, a config.json path, or a folder holding config.json."""
    if isinstance(source, str) and source in PRESETS:
        return preset(source)
    p = Path(source)
    target = p / "config.json" if p.is_dir() else p
    if not target.is_file() and isinstance(source, str) and "/" not in source and not source.endswith(".json"):
        raise ConfigError(f"unknown preset {source!r}; known presets: {', '.join(PRESETS)} (or give a folder)")
    return read_config(p)
