"""Malformed configs: each is one `Error:` line naming the field, never a traceback or a silently wrong model."""

from __future__ import annotations

import copy
import json

import pytest
from hardening import examples, ok_or_one_line_error, one_line_error, run
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from k3compile.config import ConfigError, K3Config
from k3compile.presets import load_config, preset

TINY = preset("k3-tiny").to_hf_dict()


def write(tmp_path, doc, raw: str | None = None):
    p = tmp_path / "config.json"
    p.write_text(raw if raw is not None else json.dumps(doc))
    return p


def tiny_with(**text_changes):
    d = copy.deepcopy(TINY)
    d["text_config"].update(text_changes)
    return d


@pytest.mark.parametrize("field", ["tie_word_embeddings", "mla_use_output_gate", "latent_moe_use_norm",
                                   "moe_renormalize", "mla_use_nope"])
@pytest.mark.parametrize("value", ["false", "true", 0, 1, "no"])
def test_booleans_must_be_json_booleans(tmp_path, field, value):
    with pytest.raises(ConfigError, match=f"{field}: expected true or false"):
        load_config(write(tmp_path, tiny_with(**{field: value})))


def test_a_json_false_is_false(tmp_path):
    # the reader keeps a real JSON boolean (the bug was "false" -> True; this pins the valid case)
    cfg = load_config(write(tmp_path, tiny_with(tie_word_embeddings=True)))
    assert cfg.tie_word_embeddings is True
    assert load_config(write(tmp_path, tiny_with(tie_word_embeddings=False))).tie_word_embeddings is False


@pytest.mark.parametrize("changes,msg", [
    ({"eos_token_id": "2"}, "eos_token_id: expected an integer"),
    ({"bos_token_id": {"id": 1}}, "bos_token_id: expected an integer"),
    ({"pad_token_id": ["0"]}, "pad_token_id: expected an integer"),
    ({"eos_token_id": True}, "eos_token_id: expected an integer"),
    ({"quantization_config": "mxfp4"}, "quantization_config: expected a JSON object"),
    ({"linear_attn_config": "[4]"}, "linear_attn_config: expected a JSON object"),
    ({"hidden_act": 3}, "hidden_act: expected a string"),
    ({"q_lora_rank": "32"}, "q_lora_rank: expected an integer or null"),
    ({"attn_res_block_size": 2.5}, "attn_res_block_size: expected an integer or null"),
    ({"vocab_size": 256.5}, "vocab_size: expected an integer"),
    ({"vocab_size": 2**40}, "vocab_size: 1099511627776 is too large"),
    ({"hidden_size": None}, "hidden_size: expected an integer, got null"),
    ({"qk_rope_head_dim": 0}, "qk_rope_head_dim: must be a positive integer"),
    ({"routed_scaling_factor": "1.0"}, "routed_scaling_factor: expected a number"),
    ({"layer_types": "full_attention"}, None),  # ignored: linear_attn_config decides (and is present)
])
def test_wrongly_typed_fields(tmp_path, changes, msg):
    if msg is None:
        load_config(write(tmp_path, tiny_with(**changes)))
        return
    with pytest.raises(ConfigError, match=msg.replace("(", r"\(")):
        load_config(write(tmp_path, tiny_with(**changes)))


def test_layer_lists_must_be_lists_of_integers(tmp_path):
    d = tiny_with()
    d["text_config"]["linear_attn_config"]["full_attn_layers"] = "4,6,7"
    with pytest.raises(ConfigError, match="full_attn_layers: expected a list"):
        load_config(write(tmp_path, d))
    d["text_config"]["linear_attn_config"]["full_attn_layers"] = [4, True, 7]
    with pytest.raises(ConfigError, match="full_attn_layers: expected a list"):
        load_config(write(tmp_path, d))
    d = tiny_with()
    d["text_config"]["linear_attn_config"]["kda_layers"] = "1,2"
    with pytest.raises(ConfigError, match="kda_layers: expected a list"):
        load_config(write(tmp_path, d))
    d["text_config"]["linear_attn_config"]["short_conv_kernel_size"] = 1
    d["text_config"]["linear_attn_config"].pop("kda_layers")
    with pytest.raises(ConfigError, match="conv_kernel_size: the short conv must be at least 2 wide"):
        load_config(write(tmp_path, d))


@pytest.mark.parametrize("constant", ["NaN", "Infinity", "-Infinity"])
def test_non_finite_numbers_are_rejected(tmp_path, constant):
    raw = json.dumps(tiny_with(routed_scaling_factor=1.5)).replace("1.5", constant)
    with pytest.raises(ConfigError, match=f"{constant} is not a JSON number"):
        load_config(write(tmp_path, None, raw))
    r = run("generate", write(tmp_path, None, raw))
    one_line_error(r, "is not a JSON number")


def test_non_finite_numbers_in_a_built_config():
    with pytest.raises(ConfigError, match="rms_norm_eps"):
        preset("k3-tiny").replace(rms_norm_eps=float("nan"))
    with pytest.raises(ConfigError, match="activation_situ_beta: must be a finite number"):
        preset("k3-tiny").replace(activation_situ_beta=float("inf"))
    with pytest.raises(ConfigError, match="tie_word_embeddings: must be true or false"):
        preset("k3-tiny").replace(tie_word_embeddings="false")


def test_generate_refuses_a_model_that_does_not_fit(tmp_path):
    # The k3 preset is 2.8T parameters: one line, before any allocation, instead of an out-of-memory kill.
    one_line_error(run("generate", "k3", "--max-new-tokens", "1"), "GiB available here")


# ---- property: any mutation of a valid config is either a working model or one error line -----------------------

JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers(-3, 70) | st.sampled_from([0, 1, 2, 2**31, 2**63, 10**30])
    | st.floats(allow_nan=False, allow_infinity=False, width=32) | st.text(max_size=4),
    lambda children: st.lists(children, max_size=3) | st.dictionaries(st.text(max_size=3), children, max_size=2),
    max_leaves=4,
)
TEXT_KEYS = sorted(TINY["text_config"])
LAC_KEYS = sorted(TINY["text_config"]["linear_attn_config"])


@st.composite
def mutated_configs(draw):
    d = copy.deepcopy(TINY)
    for _ in range(draw(st.integers(1, 3))):
        where = draw(st.sampled_from(["text", "lac", "top", "drop"]))
        text = d.get("text_config")
        if where == "top":
            d[draw(st.sampled_from(["model_type", "text_config", "quantization_config"]))] = draw(JSON_VALUES)
        elif not isinstance(text, dict):  # an earlier "top" mutation replaced it: nothing inside to mutate
            continue
        elif where == "text":
            text[draw(st.sampled_from(TEXT_KEYS))] = draw(JSON_VALUES)
        elif where == "lac" and isinstance(text.get("linear_attn_config"), dict):
            text["linear_attn_config"][draw(st.sampled_from(LAC_KEYS))] = draw(JSON_VALUES)
        elif where == "drop":
            text.pop(draw(st.sampled_from(TEXT_KEYS)), None)
    return d


@settings(max_examples=examples(60), deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(doc=mutated_configs())
def test_any_config_runs_or_is_one_error_line(tmp_path, doc):
    p = write(tmp_path, doc)
    r = run("generate", p, "--max-new-tokens", "2", "--prompt-ids", "1,2", "--json", "--quiet")
    if ok_or_one_line_error(r):
        tokens = json.loads(r.output)["tokens"]
        cfg = load_config(p)
        assert len(tokens) == 1 and all(0 <= t < cfg.vocab_size for t in tokens[0])
    else:
        assert isinstance(r.exception, SystemExit)


@settings(max_examples=examples(40), deadline=None)
@given(raw=st.binary(max_size=64) | st.text(max_size=64).map(str.encode))
def test_garbage_config_bytes(tmp_path_factory, raw):
    p = tmp_path_factory.mktemp("cfg") / "config.json"
    p.write_bytes(raw)
    try:
        load_config(p)
    except ConfigError:
        pass


def test_config_fields_round_trip_every_preset():
    # the stricter reader still reads what the writer writes
    for name in ("k3", "kimi-linear-48b", "k3-tiny", "k3-small"):
        cfg = preset(name)
        assert K3Config.from_hf_dict(cfg.to_hf_dict()) == cfg
