"""The kimi_linear model family's configuration: one frozen dataclass, HF config.json read/write (docs/model.md).

Kimi-Linear-48B and Kimi K3 share one config; every K3 novelty is a switch on top of Kimi-Linear
(docs/model.md, "The family"): the KDA gate lower bound, the full-rank KDA output gate, the MLA output gate, the
latent MoE (`routed_expert_hidden_size`) with its norm, SiTU, Block Attention Residuals and MXFP4 experts.

The dataclass is the one field table: each field's metadata names its HF key(s) (the first is written, the others
are read aliases; `linear_attn_config.x` is nested) and whether only K3-feature configs write it; the default is the
dataclass default, the JSON type comes from the annotation. Reader, writer and defaults cannot disagree.
Layer indices here are 0-INDEXED; the HF `linear_attn_config` lists are 1-indexed and are converted on read and
write. Presets and resolving a SOURCE to a config live in presets.py.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from k3compile.errors import UserError
from k3compile.modes import Activation, ExpertFormat


class ConfigError(UserError):
    """An invalid or unreadable model configuration; the message names the field."""


ACTIVATIONS = tuple(a.value for a in Activation)  # silu, situ (modes.py owns the names)
EXPERT_FORMATS = tuple(f.value for f in ExpertFormat)  # float, mxfp4
EXPERT_CHOICES = ("auto", *EXPERT_FORMATS)  # what a loader may be asked for: the stored format, or a conversion
MAX_SIZE = 2**31 - 1  # every width, count and id fits an int32 (tensor dims in ONNX and the kernels)
TOKEN_IDS = ("bos_token_id", "eos_token_id", "pad_token_id")


def hf(default: Any, *keys: str, k3: bool = False) -> Any:
    """A field of the table: its default, its HF keys (first written, all read), whether only K3 configs write it."""
    return field(default=default, metadata={"hf": keys, "k3": k3})


@dataclass(frozen=True)
class K3Config:
    # Trunk
    vocab_size: int = hf(None, "vocab_size")
    hidden_size: int = hf(None, "hidden_size")
    num_hidden_layers: int = hf(None, "num_hidden_layers")
    full_attn_layers: tuple[int, ...] = ()  # 0-indexed MLA layers; every other layer is KDA (read: _layer_lists)
    rms_norm_eps: float = hf(1e-5, "rms_norm_eps")
    tie_word_embeddings: bool = hf(False, "tie_word_embeddings")
    max_position_embeddings: int = hf(1048576, "max_position_embeddings", "model_max_length")
    bos_token_id: int | None = hf(None, "bos_token_id")
    eos_token_id: int | None = hf(None, "eos_token_id")
    pad_token_id: int | None = hf(None, "pad_token_id")
    # KDA
    kda_num_heads: int = hf(32, "linear_attn_config.num_heads", "linear_num_heads")
    kda_head_dim: int = hf(128, "linear_attn_config.head_dim", "linear_head_dim")
    conv_kernel_size: int = hf(4, "linear_attn_config.short_conv_kernel_size", "linear_conv_kernel_dim")
    # K3: -5.0 (sigmoid gate); None: Kimi-Linear softplus gate
    gate_lower_bound: float | None = hf(None, "linear_attn_config.gate_lower_bound")
    # K3: g_proj [H*V, D]; Kimi-Linear: g_b_proj(g_a_proj(x))
    use_full_rank_gate: bool = hf(False, "linear_attn_config.use_full_rank_gate")
    # MLA (NoPE)
    num_attention_heads: int = hf(32, "num_attention_heads")
    q_lora_rank: int | None = hf(None, "q_lora_rank")
    kv_lora_rank: int = hf(512, "kv_lora_rank")
    qk_nope_head_dim: int = hf(128, "qk_nope_head_dim")
    qk_rope_head_dim: int = hf(64, "qk_rope_head_dim")
    v_head_dim: int = hf(128, "v_head_dim")
    mla_use_output_gate: bool = hf(False, "mla_use_output_gate")
    # FFN / MoE
    hidden_act: str = hf(Activation.SILU.value, "hidden_act")
    activation_situ_beta: float = hf(4.0, "activation_situ_beta", k3=True)
    activation_situ_linear_beta: float = hf(25.0, "activation_situ_linear_beta", k3=True)
    intermediate_size: int = hf(9216, "intermediate_size")  # dense layers (< first_k_dense_replace)
    first_k_dense_replace: int = hf(1, "first_k_dense_replace")
    num_experts: int = hf(256, "num_experts", "num_local_experts", "n_routed_experts")
    num_experts_per_token: int = hf(8, "num_experts_per_token", "num_experts_per_tok")
    num_shared_experts: int = hf(1, "num_shared_experts", "n_shared_experts")
    moe_intermediate_size: int = hf(1024, "moe_intermediate_size")
    # K3 latent MoE width; None: experts at full width
    routed_expert_hidden_size: int | None = hf(None, "routed_expert_hidden_size", k3=True)
    latent_moe_use_norm: bool = hf(False, "latent_moe_use_norm", k3=True)
    moe_renormalize: bool = hf(True, "moe_renormalize", "norm_topk_prob")
    routed_scaling_factor: float = hf(2.446, "routed_scaling_factor")  # transformers' Kimi-Linear default; K3: 1.0
    num_expert_group: int = hf(1, "num_expert_group", "n_group")
    topk_group: int = hf(1, "topk_group")
    # "mxfp4": routed experts stored packed (weight_packed + E8M0 weight_scale); read from quantization_config
    expert_format: str = ExpertFormat.FLOAT.value
    # Block Attention Residuals
    attn_res_block_size: int | None = hf(None, "attn_res_block_size", k3=True)
    # Free-form provenance (kept out of equality so that presets compare by their numbers)
    name: str = field(default="custom", compare=False)

    def __post_init__(self) -> None:
        validate(self)

    # ---- derived --------------------------------------------------------------------------------------------
    def is_mla(self, layer: int) -> bool:
        return layer in self.full_attn_layers

    def is_moe(self, layer: int) -> bool:
        return self.num_experts > 0 and layer >= self.first_k_dense_replace

    @property
    def kda_layers(self) -> tuple[int, ...]:
        return tuple(i for i in range(self.num_hidden_layers) if i not in self.full_attn_layers)

    @property
    def latent_size(self) -> int:
        """Width the routed experts run at: the latent width in K3, the hidden width in Kimi-Linear."""
        return self.routed_expert_hidden_size or self.hidden_size

    @property
    def is_latent_moe(self) -> bool:
        return self.routed_expert_hidden_size is not None

    @property
    def is_k3(self) -> bool:
        """True when any K3-only feature is on (decides the nested kimi_k3 config.json layout)."""
        return (
            self.attn_res_block_size is not None
            or self.is_latent_moe
            or self.hidden_act == Activation.SITU
            or self.mla_use_output_gate
            or self.gate_lower_bound is not None
        )

    def replace(self, **changes: Any) -> "K3Config":
        return dataclasses.replace(self, **changes)

    # ---- HF config.json ---------------------------------------------------------------------------------------
    def to_hf_dict(self) -> dict[str, Any]:
        """The HF config: a top-level kimi_linear dict, nested as `text_config` of kimi_k3 for K3-feature configs."""
        text: dict[str, Any] = {"model_type": "kimi_linear", "architectures": ["KimiLinearForCausalLM"]}
        for f in table():
            if f.metadata["k3"] and not self.is_k3:
                continue
            _put(text, f.metadata["hf"][0], getattr(self, f.name))
        lac = text["linear_attn_config"]
        lac["full_attn_layers"] = [i + 1 for i in self.full_attn_layers]
        lac["kda_layers"] = [i + 1 for i in self.kda_layers]
        text.update(num_key_value_heads=self.num_attention_heads, mla_use_nope=True,
                    moe_router_activation_func="sigmoid", topk_method="noaux_tc")
        if self.expert_format == ExpertFormat.MXFP4:
            text["quantization_config"] = {
                "quant_method": "compressed-tensors",
                "format": "mxfp4-pack-quantized",
                "group_size": 32,
                "targets": ["block_sparse_moe.experts"],
            }
        if not self.is_k3:
            return text
        return {
            "model_type": "kimi_k3",
            "architectures": ["KimiK3ForConditionalGeneration"],
            "text_config": text,
        }

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any], name: str = "custom") -> "K3Config":
        return _from_hf_dict(d, name)

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_hf_dict(), indent=2, allow_nan=False) + "\n")


BOOL_FIELDS = tuple(f.name for f in dataclasses.fields(K3Config) if f.type == "bool")
FLOAT_FIELDS = tuple(f.name for f in dataclasses.fields(K3Config) if f.type == "float")


def table() -> list[dataclasses.Field]:
    """The fields with HF keys, in declaration order."""
    return [f for f in dataclasses.fields(K3Config) if "hf" in f.metadata]


def _put(d: dict[str, Any], path: str, value: Any) -> None:
    *outer, key = path.split(".")
    for k in outer:
        d = d.setdefault(k, {})
    d[key] = value


# ---- reading HF configs ------------------------------------------------------------------------------------------

def _lookup(d: dict[str, Any], keys: tuple[str, ...]) -> tuple[str, Any]:
    """The first of `keys` present (and not null) in d (a dotted key looks inside a nested object): (key, value)."""
    for k in keys:
        *outer, last = k.split(".")
        node: Any = d
        for o in outer:
            node = node.get(o) if isinstance(node, dict) else None
        if isinstance(node, dict) and node.get(last) is not None:
            return k, node[last]
    return keys[0], None


def _get(d: dict[str, Any], key: str, default: Any = None) -> Any:
    v = d.get(key)
    return default if v is None else v


def _num(d: dict[str, Any], key: str, default: Any, kind: type, optional: bool = False) -> Any:
    """A JSON number of the right kind: finite, integral for `kind=int`, within MAX_SIZE; null only if optional."""
    v = _get(d, key, default)
    if v is None and optional:
        return None
    what = ("an integer" if kind is int else "a number") + (" or null" if optional else "")
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise ConfigError(f"{key}: expected {what}, got {v!r}")
    if not math.isfinite(v):
        raise ConfigError(f"{key}: must be finite, got {v!r}")
    if kind is int and v != int(v):
        raise ConfigError(f"{key}: expected {what}, got {v!r}")
    if abs(v) > MAX_SIZE:
        raise ConfigError(f"{key}: {v!r} is too large (at most {MAX_SIZE})")
    return kind(v)


def _bool(d: dict[str, Any], key: str, default: bool) -> bool:
    """A JSON boolean: the string "false" or the number 0 is an error, not a truthy or falsy guess."""
    v = _get(d, key, default)
    if not isinstance(v, bool):
        raise ConfigError(f"{key}: expected true or false (a JSON boolean), got {v!r}")
    return v


def _token_id(d: dict[str, Any], key: str) -> int | None:
    """null, an integer, or a list of integers (HF allows several EOS ids; the first is used)."""
    v = d.get(key)
    if isinstance(v, list):
        if not all(isinstance(i, int) and not isinstance(i, bool) for i in v):
            raise ConfigError(f"{key}: expected an integer, a list of integers or null, got {v!r}")
        v = v[0] if v else None
    return _num({key: v}, key, None, int, optional=True)


def _object(d: dict[str, Any], key: str) -> dict[str, Any]:
    v = d.get(key)
    if v is None:
        return {}
    if not isinstance(v, dict):
        raise ConfigError(f"{key}: expected a JSON object, got {v!r}")
    return v


def _int_list(v: Any, key: str, what: str) -> list[int]:
    if not isinstance(v, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in v):
        raise ConfigError(f"{key}: expected a list of {what}, got {v!r}")
    return v


def _layer_lists(d: dict[str, Any], n_layers: int) -> tuple[int, ...]:
    lac = _object(d, "linear_attn_config")
    if "full_attn_layers" in lac:
        full = _int_list(lac["full_attn_layers"], "linear_attn_config.full_attn_layers", "1-indexed layer numbers")
        bad = [i for i in full if not 1 <= i <= n_layers]
        if bad:
            raise ConfigError(
                f"linear_attn_config.full_attn_layers: {bad} out of range 1..{n_layers} (the lists are 1-indexed)"
            )
        kda = lac.get("kda_layers")
        if kda is not None:
            kda = _int_list(kda, "linear_attn_config.kda_layers", "1-indexed layer numbers")
            if sorted(set(kda) | set(full)) != list(range(1, n_layers + 1)) or set(kda) & set(full):
                raise ConfigError(
                    "linear_attn_config.kda_layers: kda_layers and full_attn_layers must split layers 1.."
                    f"{n_layers} exactly once each"
                )
        return tuple(sorted(i - 1 for i in set(full)))
    types = d.get("layer_types")
    if types is not None:
        if not isinstance(types, list) or not all(isinstance(t, str) for t in types):
            raise ConfigError(f"layer_types: expected a list of strings, got {types!r}")
        if len(types) != n_layers:
            raise ConfigError(f"layer_types: {len(types)} entries for num_hidden_layers={n_layers}")
        return tuple(i for i, t in enumerate(types) if t == "full_attention")
    raise ConfigError("linear_attn_config.full_attn_layers: missing (which layers are MLA?)")


def _read_field(d: dict[str, Any], f: dataclasses.Field) -> Any:
    key, v = _lookup(d, f.metadata["hf"])
    key = key.split(".")[-1] if key.startswith("linear_attn_config.") else key
    kind = str(f.type)
    optional = "None" in kind
    if f.name in TOKEN_IDS:
        return _token_id({key: v}, key)
    if v is None:
        if f.default is None and not optional:
            raise ConfigError(f"{key}: expected an integer, got null" if key in d else f"{key}: missing")
        return f.default
    if kind == "bool":
        return _bool({key: v}, key, f.default)
    if kind.startswith("str"):
        if not isinstance(v, str):
            raise ConfigError(f"{key}: expected a string, got {v!r}")
        return v
    return _num({key: v}, key, None, int if kind.startswith("int") else float, optional)


def _from_hf_dict(d: dict[str, Any], name: str) -> K3Config:
    if not isinstance(d, dict):
        raise ConfigError("config.json: expected a JSON object")
    mt = d.get("model_type")
    quant = _object(d, "quantization_config")
    if mt == "kimi_k3":
        if not isinstance(d.get("text_config"), dict):
            raise ConfigError("text_config: a kimi_k3 config must nest its kimi_linear text config")
        quant = _object(d["text_config"], "quantization_config") or quant
        d = d["text_config"]
        mt = d.get("model_type", "kimi_linear")
    if mt not in ("kimi_linear", None):
        raise ConfigError(f"model_type: {mt!r} is not of the kimi_linear family (kimi_linear or kimi_k3)")
    _object(d, "linear_attn_config")  # an object or absent
    if _bool(d, "mla_use_nope", True) is False:
        raise ConfigError("mla_use_nope: false (rotary MLA) is not part of the K3 family; only NoPE MLA is supported")
    if d.get("moe_router_activation_func", "sigmoid") != "sigmoid":
        raise ConfigError(f"moe_router_activation_func: {d['moe_router_activation_func']!r}; only sigmoid is supported")
    if d.get("moe_layer_freq", 1) != 1:
        raise ConfigError("moe_layer_freq: only 1 (every layer after first_k_dense_replace is MoE) is supported")
    kw: dict[str, Any] = {f.name: _read_field(d, f) for f in table()}
    expert_format = ExpertFormat.FLOAT.value
    if quant:
        fmt = str(quant.get("format", "")) + str(quant.get("quant_method", ""))
        if "mxfp4" in fmt:  # compressed-tensors' "mxfp4-pack-quantized"
            expert_format = ExpertFormat.MXFP4.value
        else:
            raise ConfigError(f"quantization_config: unsupported format {fmt!r} (supported: mxfp4-pack-quantized)")
    kw.update(full_attn_layers=_layer_lists(d, kw["num_hidden_layers"]), expert_format=expert_format, name=name)
    try:
        return K3Config(**kw)
    except TypeError as e:  # a wrong JSON type reaching arithmetic in validate()
        raise ConfigError(f"config.json: {e}") from None


def validate(c: K3Config) -> None:
    """Raise ConfigError naming the first bad field."""

    def need(ok: bool, fld: str, msg: str) -> None:
        if not ok:
            raise ConfigError(f"{fld}: {msg}")

    def pos(fld: str, allow_zero: bool = False) -> None:
        v = getattr(c, fld)
        ok = isinstance(v, int) and not isinstance(v, bool) and (v >= 0 if allow_zero else v > 0)
        need(ok, fld, f"must be a {'non-negative' if allow_zero else 'positive'} integer, got {v!r}")

    for f in ("vocab_size", "hidden_size", "num_hidden_layers", "kda_num_heads", "kda_head_dim", "conv_kernel_size",
              "num_attention_heads", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
              "intermediate_size"):
        pos(f)
    for f in ("first_k_dense_replace", "num_experts", "num_shared_experts"):
        pos(f, allow_zero=True)
    for f in dataclasses.fields(c):
        v = getattr(c, f.name)
        if isinstance(v, int) and not isinstance(v, bool):
            need(v <= MAX_SIZE, f.name, f"{v} is too large (at most {MAX_SIZE})")
    for f in BOOL_FIELDS:
        need(isinstance(getattr(c, f), bool), f, f"must be true or false, got {getattr(c, f)!r}")
    for f in (*FLOAT_FIELDS, "gate_lower_bound"):
        v = getattr(c, f)
        need((v is None and f == "gate_lower_bound") or (isinstance(v, (int, float)) and not isinstance(v, bool)
             and math.isfinite(v)), f, f"must be a finite number, got {v!r}")
    # A 1-wide short conv keeps no decode state (a zero-width conv_state), and a zero qk_rope_head_dim a zero-width
    # k_rope cache: the graph interface needs both states non-empty (onnxruntime dies on the empty ones).
    need(c.conv_kernel_size >= 2, "conv_kernel_size",
         f"the short conv must be at least 2 wide, got {c.conv_kernel_size}")
    need(c.rms_norm_eps > 0, "rms_norm_eps", f"must be > 0, got {c.rms_norm_eps}")
    need(all(isinstance(i, int) and not isinstance(i, bool) and 0 <= i < c.num_hidden_layers
             for i in c.full_attn_layers), "full_attn_layers",
         f"indices must lie in 0..{c.num_hidden_layers - 1}")
    need(tuple(sorted(set(c.full_attn_layers))) == tuple(c.full_attn_layers), "full_attn_layers",
         "must be sorted and unique")
    need(c.hidden_act in ACTIVATIONS, "hidden_act", f"{c.hidden_act!r} is not one of {ACTIVATIONS}")
    need(c.expert_format in EXPERT_FORMATS, "expert_format", f"{c.expert_format!r} is not one of {EXPERT_FORMATS}")
    need(c.q_lora_rank is None or (isinstance(c.q_lora_rank, int) and c.q_lora_rank > 0), "q_lora_rank",
         f"must be null or a positive integer, got {c.q_lora_rank!r}")
    need(c.gate_lower_bound is None or c.gate_lower_bound < 0, "gate_lower_bound",
         f"must be null or negative, got {c.gate_lower_bound}")
    need(c.attn_res_block_size is None or (isinstance(c.attn_res_block_size, int) and c.attn_res_block_size > 0),
         "attn_res_block_size", f"must be null or a positive integer, got {c.attn_res_block_size!r}")
    for tid in ("bos_token_id", "eos_token_id", "pad_token_id"):
        v = getattr(c, tid)
        need(v is None or (isinstance(v, int) and not isinstance(v, bool) and 0 <= v < c.vocab_size), tid,
             f"{v} is outside the vocabulary 0..{c.vocab_size - 1}")
    if c.num_experts > 0:
        pos("num_experts_per_token")
        pos("moe_intermediate_size")
        need(c.num_experts_per_token <= c.num_experts, "num_experts_per_token",
             f"{c.num_experts_per_token} exceeds num_experts={c.num_experts}")
        need(c.num_expert_group > 0 and c.num_experts % c.num_expert_group == 0, "num_expert_group",
             f"{c.num_expert_group} does not divide num_experts={c.num_experts}")
        need(0 < c.topk_group <= c.num_expert_group, "topk_group",
             f"must lie in 1..num_expert_group, got {c.topk_group}")
        if c.routed_expert_hidden_size is not None:
            need(isinstance(c.routed_expert_hidden_size, int) and c.routed_expert_hidden_size > 0,
                 "routed_expert_hidden_size",
                 f"must be null or a positive integer, got {c.routed_expert_hidden_size!r}")
        if c.expert_format == ExpertFormat.MXFP4:
            need(c.latent_size % 32 == 0, "routed_expert_hidden_size" if c.is_latent_moe else "hidden_size",
                 f"MXFP4 experts need the expert input width ({c.latent_size}) to be a multiple of 32")
            need(c.moe_intermediate_size % 32 == 0, "moe_intermediate_size",
                 f"MXFP4 experts need a multiple of 32, got {c.moe_intermediate_size}")
    need(not c.latent_moe_use_norm or c.is_latent_moe, "latent_moe_use_norm",
         "needs routed_expert_hidden_size (the norm acts on the latent sum)")


def read_config(path: str | Path) -> K3Config:
    """A config.json file, or a folder holding one."""
    p = Path(path)
    if p.is_dir():
        p = p / "config.json"
    if not p.is_file():
        raise ConfigError(f"{p}: no such config file")
    try:
        d = json.loads(p.read_text(), parse_constant=_no_constant)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
        raise ConfigError(f"{p}: not readable JSON ({e})") from None
    return K3Config.from_hf_dict(d, name=str(path))


def _no_constant(name: str):
    """json's NaN / Infinity / -Infinity extensions are not JSON; a config holding one is rejected."""
    raise ConfigError(f"config.json: {name} is not a JSON number (numbers must be finite)")
