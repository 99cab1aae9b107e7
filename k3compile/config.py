"""The kimi_linear model family's configuration: one frozen dataclass, named presets, HF config.json read/write.

Kimi-Linear-48B and Kimi K3 share one config; every K3 novelty is a switch on top of Kimi-Linear
(MODEL.md §1): the KDA gate lower bound, the full-rank KDA output gate, the MLA output gate, the latent MoE
(`routed_expert_hidden_size`) with its norm, SiTU, Block Attention Residuals and MXFP4 experts.

Layer indices in this dataclass are 0-INDEXED; the HF `linear_attn_config` lists are 1-indexed and are converted
on read and write.
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
BOOL_FIELDS = ("tie_word_embeddings", "use_full_rank_gate", "mla_use_output_gate", "latent_moe_use_norm",
               "moe_renormalize")
FLOAT_FIELDS = ("rms_norm_eps", "activation_situ_beta", "activation_situ_linear_beta", "routed_scaling_factor")


@dataclass(frozen=True)
class K3Config:
    # Trunk
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    full_attn_layers: tuple[int, ...]  # 0-indexed MLA layers; every other layer is KDA
    rms_norm_eps: float = 1e-5
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 1048576
    bos_token_id: int | None = None
    eos_token_id: int | None = None
    pad_token_id: int | None = None
    # KDA
    kda_num_heads: int = 32
    kda_head_dim: int = 128
    conv_kernel_size: int = 4
    gate_lower_bound: float | None = None  # K3: -5.0 (sigmoid gate); None: Kimi-Linear softplus gate
    use_full_rank_gate: bool = False  # K3: g_proj [H*V, D]; Kimi-Linear: g_b_proj(g_a_proj(x))
    # MLA (NoPE)
    num_attention_heads: int = 32
    q_lora_rank: int | None = None
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128
    mla_use_output_gate: bool = False
    # FFN / MoE
    hidden_act: str = "silu"
    activation_situ_beta: float = 4.0
    activation_situ_linear_beta: float = 25.0
    intermediate_size: int = 9216  # dense layers (< first_k_dense_replace)
    first_k_dense_replace: int = 1
    num_experts: int = 256
    num_experts_per_token: int = 8
    num_shared_experts: int = 1
    moe_intermediate_size: int = 1024
    routed_expert_hidden_size: int | None = None  # K3 latent MoE width; None: experts at full width
    latent_moe_use_norm: bool = False
    moe_renormalize: bool = True
    routed_scaling_factor: float = 1.0
    num_expert_group: int = 1
    topk_group: int = 1
    expert_format: str = "float"  # "mxfp4": routed experts stored packed (weight_packed + E8M0 weight_scale)
    # Block Attention Residuals
    attn_res_block_size: int | None = None
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
            or self.hidden_act == "situ"
            or self.mla_use_output_gate
            or self.gate_lower_bound is not None
        )

    def replace(self, **changes: Any) -> "K3Config":
        return dataclasses.replace(self, **changes)

    # ---- HF config.json ---------------------------------------------------------------------------------------
    def to_hf_dict(self) -> dict[str, Any]:
        """The HF config: a top-level kimi_linear dict, nested as `text_config` of kimi_k3 for K3-feature configs."""
        text: dict[str, Any] = {
            "model_type": "kimi_linear",
            "architectures": ["KimiLinearForCausalLM"],
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "num_hidden_layers": self.num_hidden_layers,
            "rms_norm_eps": self.rms_norm_eps,
            "tie_word_embeddings": self.tie_word_embeddings,
            "max_position_embeddings": self.max_position_embeddings,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": self.eos_token_id,
            "pad_token_id": self.pad_token_id,
            "linear_attn_config": {
                "full_attn_layers": [i + 1 for i in self.full_attn_layers],
                "kda_layers": [i + 1 for i in self.kda_layers],
                "num_heads": self.kda_num_heads,
                "head_dim": self.kda_head_dim,
                "short_conv_kernel_size": self.conv_kernel_size,
                "gate_lower_bound": self.gate_lower_bound,
                "use_full_rank_gate": self.use_full_rank_gate,
            },
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_attention_heads,
            "q_lora_rank": self.q_lora_rank,
            "kv_lora_rank": self.kv_lora_rank,
            "qk_nope_head_dim": self.qk_nope_head_dim,
            "qk_rope_head_dim": self.qk_rope_head_dim,
            "v_head_dim": self.v_head_dim,
            "mla_use_nope": True,
            "mla_use_output_gate": self.mla_use_output_gate,
            "hidden_act": self.hidden_act,
            "intermediate_size": self.intermediate_size,
            "first_k_dense_replace": self.first_k_dense_replace,
            "num_experts": self.num_experts,
            "num_experts_per_token": self.num_experts_per_token,
            "num_shared_experts": self.num_shared_experts,
            "moe_intermediate_size": self.moe_intermediate_size,
            "moe_renormalize": self.moe_renormalize,
            "moe_router_activation_func": "sigmoid",
            "topk_method": "noaux_tc",
            "routed_scaling_factor": self.routed_scaling_factor,
            "num_expert_group": self.num_expert_group,
            "topk_group": self.topk_group,
        }
        if self.is_k3:
            text.update(
                activation_situ_beta=self.activation_situ_beta,
                activation_situ_linear_beta=self.activation_situ_linear_beta,
                routed_expert_hidden_size=self.routed_expert_hidden_size,
                latent_moe_use_norm=self.latent_moe_use_norm,
                attn_res_block_size=self.attn_res_block_size,
            )
        if self.expert_format == "mxfp4":
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
        Path(path).write_text(json.dumps(self.to_hf_dict(), indent=2) + "\n")


# ---- reading HF configs ------------------------------------------------------------------------------------------

_ALIASES = {
    "num_experts": ("num_experts", "num_local_experts", "n_routed_experts"),
    "num_experts_per_token": ("num_experts_per_token", "num_experts_per_tok"),
    "num_shared_experts": ("num_shared_experts", "n_shared_experts"),
    "moe_renormalize": ("moe_renormalize", "norm_topk_prob"),
    "num_expert_group": ("num_expert_group", "n_group"),
    "max_position_embeddings": ("max_position_embeddings", "model_max_length"),
}


def _get(d: dict[str, Any], key: str, default: Any = None) -> Any:
    for k in _ALIASES.get(key, (key,)):
        if k in d and d[k] is not None:
            return d[k]
    return default


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
    for req in ("vocab_size", "hidden_size", "num_hidden_layers"):
        if req not in d:
            raise ConfigError(f"{req}: missing")
        _num(d, req, None, int)
    n_layers = d["num_hidden_layers"]
    lac = _object(d, "linear_attn_config")
    if _bool(d, "mla_use_nope", True) is False:
        raise ConfigError("mla_use_nope: false (rotary MLA) is not part of the K3 family; only NoPE MLA is supported")
    if d.get("moe_router_activation_func", "sigmoid") != "sigmoid":
        raise ConfigError(f"moe_router_activation_func: {d['moe_router_activation_func']!r}; only sigmoid is supported")
    if d.get("moe_layer_freq", 1) != 1:
        raise ConfigError("moe_layer_freq: only 1 (every layer after first_k_dense_replace is MoE) is supported")
    hidden_act = d.get("hidden_act", "silu")
    if not isinstance(hidden_act, str):
        raise ConfigError(f"hidden_act: expected a string, got {hidden_act!r}")
    expert_format = "float"
    if quant:
        fmt = str(quant.get("format", "")) + str(quant.get("quant_method", ""))
        if "mxfp4" in fmt:
            expert_format = "mxfp4"
        else:
            raise ConfigError(f"quantization_config: unsupported format {fmt!r} (supported: mxfp4-pack-quantized)")
    kw: dict[str, Any] = dict(
        vocab_size=d["vocab_size"],
        hidden_size=d["hidden_size"],
        num_hidden_layers=n_layers,
        full_attn_layers=_layer_lists(d, n_layers),
        rms_norm_eps=_num(d, "rms_norm_eps", 1e-5, float),
        tie_word_embeddings=_bool(d, "tie_word_embeddings", False),
        max_position_embeddings=_num(d, "max_position_embeddings", 1048576, int),
        bos_token_id=_token_id(d, "bos_token_id"),
        eos_token_id=_token_id(d, "eos_token_id"),
        pad_token_id=_token_id(d, "pad_token_id"),
        kda_num_heads=_num(lac, "num_heads", d.get("linear_num_heads", 32), int),
        kda_head_dim=_num(lac, "head_dim", d.get("linear_head_dim", 128), int),
        conv_kernel_size=_num(lac, "short_conv_kernel_size", d.get("linear_conv_kernel_dim", 4), int),
        gate_lower_bound=_num(lac, "gate_lower_bound", None, float, optional=True),
        use_full_rank_gate=_bool(lac, "use_full_rank_gate", False),
        num_attention_heads=_num(d, "num_attention_heads", 32, int),
        q_lora_rank=_num(d, "q_lora_rank", None, int, optional=True),
        kv_lora_rank=_num(d, "kv_lora_rank", 512, int),
        qk_nope_head_dim=_num(d, "qk_nope_head_dim", 128, int),
        qk_rope_head_dim=_num(d, "qk_rope_head_dim", 64, int),
        v_head_dim=_num(d, "v_head_dim", 128, int),
        mla_use_output_gate=_bool(d, "mla_use_output_gate", False),
        hidden_act=hidden_act,
        activation_situ_beta=_num(d, "activation_situ_beta", 4.0, float),
        activation_situ_linear_beta=_num(d, "activation_situ_linear_beta", 25.0, float),
        intermediate_size=_num(d, "intermediate_size", 9216, int),
        first_k_dense_replace=_num(d, "first_k_dense_replace", 1, int),
        num_experts=_num(d, "num_experts", 0, int),
        num_experts_per_token=_num(d, "num_experts_per_token", 0, int),
        num_shared_experts=_num(d, "num_shared_experts", 0, int),
        moe_intermediate_size=_num(d, "moe_intermediate_size", 1024, int),
        routed_expert_hidden_size=_num(d, "routed_expert_hidden_size", None, int, optional=True),
        latent_moe_use_norm=_bool(d, "latent_moe_use_norm", False),
        moe_renormalize=_bool(d, "moe_renormalize", True),
        routed_scaling_factor=_num(d, "routed_scaling_factor", 1.0, float),
        num_expert_group=_num(d, "num_expert_group", 1, int),
        topk_group=_num(d, "topk_group", 1, int),
        expert_format=expert_format,
        attn_res_block_size=_num(d, "attn_res_block_size", None, int, optional=True),
        name=name,
    )
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
        if c.expert_format == "mxfp4":
            need(c.latent_size % 32 == 0, "routed_expert_hidden_size" if c.is_latent_moe else "hidden_size",
                 f"MXFP4 experts need the expert input width ({c.latent_size}) to be a multiple of 32")
            need(c.moe_intermediate_size % 32 == 0, "moe_intermediate_size",
                 f"MXFP4 experts need a multiple of 32, got {c.moe_intermediate_size}")
    need(not c.latent_moe_use_norm or c.is_latent_moe, "latent_moe_use_norm",
         "needs routed_expert_hidden_size (the norm acts on the latent sum)")


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
        max_position_embeddings=4096, bos_token_id=1, eos_token_id=2, pad_token_id=0,
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
    if p.is_dir():
        p = p / "config.json"
    if not p.is_file():
        if isinstance(source, str) and "/" not in source and not source.endswith(".json"):
            raise ConfigError(f"unknown preset {source!r}; known presets: {', '.join(PRESETS)} (or give a folder)")
        raise ConfigError(f"{p}: no such config file")
    try:
        d = json.loads(p.read_text(), parse_constant=_no_constant)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
        raise ConfigError(f"{p}: not readable JSON ({e})") from None
    return K3Config.from_hf_dict(d, name=str(source))


def _no_constant(name: str):
    """json's NaN / Infinity / -Infinity extensions are not JSON; a config holding one is rejected."""
    raise ConfigError(f"config.json: {name} is not a JSON number (numbers must be finite)")
