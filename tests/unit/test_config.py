"""Config: presets equal the published numbers, HF config.json read/write, field-naming errors (tier 1)."""

from __future__ import annotations

import json

import pytest

from k3compile.config import ConfigError, K3Config
from k3compile.presets import PRESETS, load_config, preset


def test_k3_preset_is_the_published_config():
    c = preset("k3")
    assert (c.hidden_size, c.num_hidden_layers, c.vocab_size, c.rms_norm_eps) == (7168, 93, 163840, 1e-5)
    assert (c.bos_token_id, c.eos_token_id, c.pad_token_id, c.tie_word_embeddings) == (163584, 163586, 163839, False)
    one_indexed = [i + 1 for i in c.full_attn_layers]
    assert one_indexed == list(range(4, 93, 4)) + [93] and len(one_indexed) == 24 and len(c.kda_layers) == 69
    assert (c.kda_num_heads, c.kda_head_dim, c.conv_kernel_size, c.gate_lower_bound, c.use_full_rank_gate) == (
        96, 128, 4, -5.0, True)
    assert (c.num_attention_heads, c.q_lora_rank, c.kv_lora_rank, c.qk_nope_head_dim, c.qk_rope_head_dim,
            c.v_head_dim, c.mla_use_output_gate) == (96, 1536, 512, 128, 64, 128, True)
    assert c.kv_lora_rank + c.qk_rope_head_dim == 576  # cached values per token per MLA layer
    assert (c.first_k_dense_replace, c.intermediate_size, c.num_experts, c.num_experts_per_token,
            c.num_shared_experts, c.moe_intermediate_size, c.routed_expert_hidden_size) == (
        1, 33792, 896, 16, 2, 3072, 3584)
    assert c.latent_moe_use_norm and c.moe_renormalize and c.routed_scaling_factor == 1.0
    assert (c.num_expert_group, c.topk_group) == (1, 1)
    assert (c.hidden_act, c.activation_situ_beta, c.activation_situ_linear_beta) == ("situ", 4.0, 25.0)
    assert c.attn_res_block_size == 12 and c.expert_format == "mxfp4"
    assert c.max_position_embeddings == 1048576


def test_kimi_linear_48b_preset():
    c = preset("kimi-linear-48b")
    assert [i + 1 for i in c.full_attn_layers] == [4, 8, 12, 16, 20, 24, 27]
    assert (c.hidden_size, c.num_hidden_layers, c.kda_num_heads, c.q_lora_rank, c.num_experts,
            c.num_experts_per_token, c.num_shared_experts, c.moe_intermediate_size) == (
        2304, 27, 32, None, 256, 8, 1, 1024)
    assert c.routed_scaling_factor == 2.446 and c.hidden_act == "silu" and c.gate_lower_bound is None
    assert not c.use_full_rank_gate and c.attn_res_block_size is None and not c.is_latent_moe and not c.is_k3


@pytest.mark.parametrize("name", list(PRESETS))
def test_hf_round_trip(tmp_path, name):
    c = preset(name)
    c.save(tmp_path / "config.json")
    d = json.loads((tmp_path / "config.json").read_text())
    assert d["model_type"] == ("kimi_k3" if c.is_k3 else "kimi_linear")
    assert load_config(tmp_path) == c


def test_reads_transformers_style_aliases():
    d = {
        "model_type": "kimi_linear", "vocab_size": 100, "hidden_size": 32, "num_hidden_layers": 3,
        "num_local_experts": 4, "num_experts_per_tok": 2, "n_shared_experts": 1, "norm_topk_prob": False,
        "n_group": 2, "topk_group": 1, "moe_intermediate_size": 16, "kv_lora_rank": 8, "qk_nope_head_dim": 8,
        "v_head_dim": 8, "num_attention_heads": 2, "linear_attn_config": {"full_attn_layers": [3], "kda_layers": [1, 2],
                                                                         "num_heads": 2, "head_dim": 8},
        "eos_token_id": [2, 3],
    }
    c = K3Config.from_hf_dict(d)
    assert (c.num_experts, c.num_experts_per_token, c.num_shared_experts, c.moe_renormalize) == (4, 2, 1, False)
    assert c.num_expert_group == 2 and c.full_attn_layers == (2,) and c.eos_token_id == 2


@pytest.mark.parametrize("edit,field", [
    (lambda d: d["text_config"].__setitem__("hidden_size", "big"), "hidden_size"),
    (lambda d: d["text_config"]["linear_attn_config"].__setitem__("full_attn_layers", [0, 4]), "full_attn_layers"),
    (lambda d: d["text_config"]["linear_attn_config"].__setitem__("kda_layers", [1, 2]), "kda_layers"),
    (lambda d: d["text_config"].__setitem__("num_experts_per_token", 99), "num_experts_per_token"),
    (lambda d: d["text_config"].__setitem__("hidden_act", "gelu"), "hidden_act"),
    (lambda d: d["text_config"].__setitem__("routed_expert_hidden_size", 48), "routed_expert_hidden_size"),
    (lambda d: d["text_config"].__setitem__("num_expert_group", 3), "num_expert_group"),
    (lambda d: d.__setitem__("model_type", "llama"), "model_type"),
    (lambda d: d["text_config"].__setitem__("quantization_config", {"format": "fp8"}), "quantization_config"),
    (lambda d: d["text_config"].__setitem__("pad_token_id", 10**6), "pad_token_id"),
])
def test_invalid_configs_name_the_field(tmp_path, edit, field):
    d = preset("k3-tiny").to_hf_dict()
    edit(d)
    (tmp_path / "config.json").write_text(json.dumps(d))
    with pytest.raises(ConfigError, match=rf"^(linear_attn_config\.)?{field}"):
        load_config(tmp_path / "config.json")


def test_unreadable_and_unknown():
    with pytest.raises(ConfigError, match="unknown preset 'k4'"):
        load_config("k4")
    with pytest.raises(ConfigError, match="no such config file"):
        load_config("/nonexistent/config.json")


def test_malformed_json(tmp_path):
    (tmp_path / "config.json").write_text("{nope")
    with pytest.raises(ConfigError, match="not readable JSON"):
        load_config(tmp_path)


def test_reader_defaults_are_the_dataclass_defaults():
    """One field table: a config.json naming only the required fields reads as the dataclass defaults (the reader
    once defaulted num_experts, num_experts_per_token and num_shared_experts to 0 against 256 / 8 / 1)."""
    from k3compile.config import table

    minimal = {"model_type": "kimi_linear", "vocab_size": 64, "hidden_size": 32, "num_hidden_layers": 2,
               "linear_attn_config": {"full_attn_layers": [2]}}
    c = K3Config.from_hf_dict(minimal)
    for f in table():
        if f.name not in ("vocab_size", "hidden_size", "num_hidden_layers"):
            assert getattr(c, f.name) == f.default, f.name
    assert (c.num_experts, c.num_experts_per_token, c.num_shared_experts) == (256, 8, 1)  # transformers' defaults


def test_every_table_field_is_written():
    from k3compile.config import table

    text = preset("k3-tiny").to_hf_dict()["text_config"]
    for f in table():
        *outer, key = f.metadata["hf"][0].split(".")
        node = text
        for o in outer:
            node = node[o]
        assert key in node, f.name
