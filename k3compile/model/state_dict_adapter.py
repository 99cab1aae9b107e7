"""The HF checkpoint <-> native state-dict mapping of the family (docs/model.md, "Checkpoints").

Two layouts: Kimi-Linear (prefix `model.`, `lm_head.weight`, `A_log` [1, 1, H, 1]) and K3 (prefix
`language_model.model.`, `language_model.lm_head.weight`, `A_log` 1-D and zero-padded past H). Routed experts are
per-expert `block_sparse_moe.experts.E.{w1,w2,w3}.weight` (float) or `.weight_packed` + `.weight_scale` (MXFP4)
in a checkpoint and stacked `w13 [E, 2I, D]` / `w2 [E, D, I]` (or their packed buffers) in the model; transformers
writes the dense layer-0 MLP under `block_sparse_moe.`. Only names and layouts here: no file is opened.

A `Selection` picks what one rank of a mesh needs: a layer range [a, b) (a pipeline stage: the embedding only on
the first stage, the final norm and head only on the last) and/or an expert slice [a, b) of every MoE layer
(expert parallelism: the model holding the stacked slice routes with indices local to it).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from k3compile.config import K3Config
from k3compile.modes import ExpertFormat
from k3compile.quant.mx import dequantize_mxfp4, quantize_mxfp4

LAYOUTS = ("kimi_linear", "k3")
A_LOG_PAD = 128  # K3 stores A_log padded to a multiple of 128 entries (96 heads -> 128)

_EXPERT = re.compile(r"^(.*\.block_sparse_moe\.experts)\.(w13|w2)(?:_(packed|scale))?$")
_CKPT_EXPERT = re.compile(r"^(.*\.block_sparse_moe\.experts)\.(\d+)\.(w1|w2|w3)\.(weight|weight_packed|weight_scale)$")
_SUFFIX = {None: "weight", "packed": "weight_packed", "scale": "weight_scale"}  # stacked buffer part -> HF suffix
_PART = {v: k for k, v in _SUFFIX.items()}
_DENSE_ALIAS = re.compile(r"^(.*\.layers\.\d+)\.block_sparse_moe\.((?:gate|up|down)_proj\.weight)$")
_LAYER = re.compile(r"^(?:language_model\.)?model\.layers\.(\d+)\.")


def prefix(layout: str) -> str:
    return "language_model." if layout == "k3" else ""


@dataclass(frozen=True)
class Selection:
    """Which tensors one rank loads: layers [a, b) and/or routed experts [a, b) of every MoE layer (None: all)."""

    layers: tuple[int, int] | None = None
    experts: tuple[int, int] | None = None

    def check(self, cfg: K3Config) -> None:
        for what, rng, n in (("layers", self.layers, cfg.num_hidden_layers), ("experts", self.experts,
                                                                              cfg.num_experts)):
            if rng is not None and not (isinstance(rng, tuple) and len(rng) == 2 and 0 <= rng[0] < rng[1] <= n):
                raise ValueError(f"{what} {rng}: expected a range [a, b) with 0 <= a < b <= {n}")

    def keeps(self, name: str, cfg: K3Config) -> bool:
        """Whether a checkpoint tensor (HF name, either layout) belongs to this selection."""
        layer = _LAYER.match(name)
        if self.layers is not None:
            a, b = self.layers
            last = b == cfg.num_hidden_layers
            if layer:
                if not a <= int(layer.group(1)) < b:
                    return False
            elif ".embed_tokens." in name:
                if a != 0 and not (last and cfg.tie_word_embeddings):  # a tied head reads the embedding
                    return False
            elif not last:  # the final norm, the head, the output AttnRes: the last stage's
                return False
        if self.experts is not None:
            e = _CKPT_EXPERT.match(name)
            if e and not self.experts[0] <= int(e.group(2)) < self.experts[1]:
                return False
        return True


ALL = Selection()


# ---- model state <-> checkpoint tensors ---------------------------------------------------------------------------

def to_checkpoint(state: dict[str, torch.Tensor], cfg: K3Config, layout: str) -> dict[str, torch.Tensor]:
    """Model state dict -> checkpoint tensors under HF names (works on meta tensors: reshapes only)."""
    pre = prefix(layout)
    out: dict[str, torch.Tensor] = {}
    for key, t in state.items():
        if cfg.tie_word_embeddings and key == "lm_head.weight":
            continue
        m = _EXPERT.match(key)
        if m:
            base, which, part = m.groups()
            suffix = _SUFFIX[part]
            for e in range(t.shape[0]):
                if which == "w2":
                    out[f"{pre}{base}.{e}.w2.{suffix}"] = t[e]
                else:
                    w1, w3 = t[e].chunk(2, dim=0)
                    out[f"{pre}{base}.{e}.w1.{suffix}"] = w1
                    out[f"{pre}{base}.{e}.w3.{suffix}"] = w3
            continue
        if key.endswith(".A_log"):
            if layout == "k3":
                pad = -t.numel() % A_LOG_PAD
                t = torch.cat([t, t.new_zeros(pad)]) if pad else t
            else:
                t = t.view(1, 1, -1, 1)
        out[pre + key] = t
    return out


def from_checkpoint(tensors: dict[str, torch.Tensor], cfg: K3Config, layout: str) -> dict[str, torch.Tensor]:
    """Checkpoint tensors (names already checked) -> model state dict."""
    pre = prefix(layout)
    state: dict[str, torch.Tensor] = {}
    experts: dict[tuple[str, str, str], dict[int, torch.Tensor]] = {}
    for name, t in tensors.items():
        key = name[len(pre):]
        m = _CKPT_EXPERT.match(key)
        if m:
            base, e, w, suffix = m.groups()
            experts.setdefault((base, w, suffix), {})[int(e)] = t
            continue
        if key.endswith(".A_log"):
            t = t.reshape(-1)[: cfg.kda_num_heads]  # K3 pads past H: narrow, never reshape
        state[key] = t
    for (base, w, suffix), per in list(experts.items()):
        if w == "w3":
            continue
        stacked = torch.stack([per[e] for e in sorted(per)])  # an expert slice [a, b) stacks a..b-1
        if w == "w1":
            w3 = experts[(base, "w3", suffix)]
            stacked = torch.cat([stacked, torch.stack([w3[e] for e in sorted(w3)])], dim=1)
        part = _PART[suffix]
        state[f"{base}.{'w13' if w == 'w1' else 'w2'}{'' if part is None else '_' + part}"] = stacked
    if cfg.tie_word_embeddings and "model.embed_tokens.weight" in state:
        state["lm_head.weight"] = state["model.embed_tokens.weight"]
    return state


def detect_layout(names) -> str:
    return "k3" if any(n.startswith("language_model.") for n in names) else "kimi_linear"


def detect_expert_format(names) -> str | None:
    fmt = None
    for n in names:
        m = _CKPT_EXPERT.match(n)
        if m:
            fmt = ExpertFormat.MXFP4.value if m.group(4) != "weight" else ExpertFormat.FLOAT.value
            break
    return fmt


def dense_aliases(names, cfg: K3Config, layout: str) -> dict[str, str]:
    """transformers' `block_sparse_moe.{gate,up,down}_proj` names of a dense layer -> the published `mlp.` names."""
    pre = prefix(layout)
    alias = {}
    for k in names:
        m = _DENSE_ALIAS.match(k[len(pre):])
        if m and not cfg.is_moe(int(m.group(1).rsplit(".", 1)[1])):
            alias[f"{pre}{m.group(1)}.mlp.{m.group(2)}"] = k
    return alias


def expected(cfg: K3Config, layout: str, select: Selection = ALL) -> dict[str, tuple[int, ...]]:
    """Checkpoint name -> shape of every tensor a checkpoint of `cfg` holds (within `select`)."""
    from k3compile.model.k3 import K3ForCausalLM

    with torch.device("meta"):
        model = K3ForCausalLM(cfg)
    return {k: tuple(v.shape) for k, v in to_checkpoint(model.state_dict(), cfg, layout).items()
            if select.keeps(k, cfg)}


def convert_experts(state: dict[str, torch.Tensor], target: str, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Stacked routed experts float <-> MXFP4 (quantize with the OCP FLOOR rule, or dequantize)."""
    out = dict(state)
    for key in list(state):
        m = _EXPERT.match(key)
        if not m:
            continue
        base, which, part = m.groups()
        if target == ExpertFormat.MXFP4 and part is None:
            packed, scale = quantize_mxfp4(out.pop(key))
            out[f"{base}.{which}_packed"], out[f"{base}.{which}_scale"] = packed, scale
        elif target == ExpertFormat.FLOAT and part == "packed":
            out[f"{base}.{which}"] = dequantize_mxfp4(out.pop(key), out.pop(f"{base}.{which}_scale")).to(dtype)
    return out
