"""Parity of two step backends: the same inputs through both, every output compared (docs/architecture.md).

`compare(reference, candidate)` runs prefill on a left-padded batch (P = 0), then decode steps, each side fed its
own previous `present` and both continuing with the reference's greedy token; it works on any two backends (eager,
onnxruntime, onnx.reference, compiled targets). `check_source` / `check_model` guard `k3compile verify` against
rebuilding a model other than the exported one.
"""

from __future__ import annotations

import dataclasses
import math

import torch

from k3compile.config import K3Config
from k3compile.generate import left_pad
from k3compile.interface import ExportError, GraphInterface, flatten
from k3compile.presets import load_config

__all__ = ["check_model", "check_source", "compare", "default_prompts", "per_layer", "worst"]


def _config_diff(a: K3Config, b: K3Config, skip: tuple[str, ...]) -> str | None:
    for f in dataclasses.fields(K3Config):
        if f.name not in skip and getattr(a, f.name) != getattr(b, f.name):
            return f"{f.name}: {getattr(a, f.name)!r} here, {getattr(b, f.name)!r} in the export"
    return None


def check_source(source: str, exported: K3Config) -> None:
    """Before any weight is built: the source's config (a preset's numbers, a checkpoint's config.json) must be the
    exported one, so that a wrong --source or an edited record fails at once instead of building another model
    (with the `k3` preset, 2.8T parameters). The expert format is checked on the built model (check_model)."""
    diff = _config_diff(load_config(source), exported, skip=("name", "expert_format"))
    if diff:
        raise ExportError(f"the source {source} is not the model that was exported ({diff})")


def check_model(config: K3Config, exported: K3Config) -> None:
    diff = _config_diff(config, exported, skip=("name",))
    if diff:
        raise ExportError(f"the rebuilt model is not the one that was exported ({diff})")


def _rows(phase: str, names: list[str], ref: list[torch.Tensor], other: list[torch.Tensor]) -> list[dict]:
    rows = []
    for name, a, b in zip(names, ref, other):
        if a.shape != b.shape:
            raise ExportError(f"{phase}: {name} has shape {list(b.shape)}, the reference {list(a.shape)}")
        diff = (a.float() - b.float()).abs()
        scale = (a.float().abs().max().item() if a.numel() else 0.0) or 1.0
        max_abs = diff.max().item() if diff.numel() else 0.0
        rows.append({"phase": phase, "output": name, "max_abs": max_abs, "max_rel": max_abs / scale})
    return rows


def default_prompts(cfg: K3Config) -> list[list[int]]:
    """A left-padded batch of two prompts of different lengths, in range for any vocabulary."""
    return [[(7 * i + 3) % cfg.vocab_size for i in range(5)], [11 % cfg.vocab_size, 5 % cfg.vocab_size,
                                                               9 % cfg.vocab_size]]


def _host(backend, past):
    """`past` in this process's memory: a sharded OUT's ranks hold theirs (backends/sharded.py, host_past)."""
    host = getattr(backend, "host_past", None)
    return host(past) if host is not None else past


@torch.no_grad()
def compare(reference, candidate, decode_steps: int = 2, prompts: list[list[int]] | None = None) -> list[dict]:
    """Rows (phase, output, max_abs, max_rel) of `candidate` against `reference`, two step backends of one config."""
    cfg = reference.config
    gi = GraphInterface.of(cfg)
    prompts = prompts or default_prompts(cfg)
    ids, mask = left_pad(prompts, cfg.pad_token_id or 0)
    rows: list[dict] = []
    past_r, past_c = reference.init_past(len(prompts)), candidate.init_past(len(prompts))
    for step in range(decode_steps + 1):
        lr, past_r = reference.step(ids, mask, past_r)
        lc, past_c = candidate.step(ids, mask, past_c)
        rows += _rows("prefill" if step == 0 else f"decode {step}", gi.outputs,
                      [lr, *flatten(_host(reference, past_r))], [lc, *flatten(_host(candidate, past_c))])
        ids = lr[:, -1].argmax(-1, keepdim=True)  # both sides continue with the reference's greedy token
        mask = torch.cat([mask, torch.ones_like(ids)], dim=1)
    return rows


def worst(rows: list[dict]) -> dict:
    """The row with the largest max_abs, a NaN row before any (max() alone never picks a NaN after a number)."""
    return max(rows, key=lambda r: (math.isnan(r["max_abs"]), r["max_abs"]))


def per_layer(rows: list[dict]) -> list[dict]:
    """The worst row of each (backend, layer) over every phase: a layer's outputs are its `present.{i}.*` states, so
    the first layer whose row grows is where a difference starts; logits come last as layer "logits"."""
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        parts = r["output"].split(".")
        layer = parts[1] if parts[0] == "present" and len(parts) > 2 else r["output"]
        groups.setdefault((r.get("backend", ""), layer), []).append(r)
    out = []
    for (backend, layer), rs in groups.items():
        w = worst(rs)
        out.append({"backend": backend, "layer": layer, "phase": w["phase"], "output": w["output"],
                    "max_abs": w["max_abs"], "max_rel": w["max_rel"]})
    return sorted(out, key=lambda r: (r["backend"], r["layer"] == "logits",
                                      int(r["layer"]) if r["layer"].isdigit() else 0))
