"""Parity of an exported folder against the eager model: the same inputs through both, every output compared.

Prefill on a left-padded batch (P = 0), then decode steps, each side fed its own previous `present`.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch

from k3compile.config import K3Config, load_config
from k3compile.export import ACTIVATIONS, DEFAULT_TOL, ExportError, GraphInterface, export_mode
from k3compile.generate import left_pad
from k3compile.model.k3 import K3ForCausalLM

__all__ = ["DEFAULT_TOL", "check_source", "compare", "worst"]


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


def check_model(model: K3ForCausalLM, exported: K3Config) -> None:
    diff = _config_diff(model.config, exported, skip=("name",))
    if diff:
        raise ExportError(f"the rebuilt model is not the one that was exported ({diff})")


def _rows(phase: str, names: list[str], eager: list[torch.Tensor], other: list[torch.Tensor]) -> list[dict]:
    rows = []
    for name, a, b in zip(names, eager, other):
        if a.shape != b.shape:
            raise ExportError(f"{phase}: {name} has shape {list(b.shape)}, eager {list(a.shape)}")
        diff = (a.float() - b.float()).abs()
        scale = (a.float().abs().max().item() if a.numel() else 0.0) or 1.0
        max_abs = diff.max().item() if diff.numel() else 0.0
        rows.append({"phase": phase, "output": name, "max_abs": max_abs, "max_rel": max_abs / scale})
    return rows


@torch.no_grad()
def compare(model: K3ForCausalLM, folder: str | Path, activations: str = "none", reference: bool = False,
            decode_steps: int = 2, prompts: list[list[int]] | None = None, threads: int | None = None) -> list[dict]:
    from k3compile.onnx_backend import OnnxBackend

    cfg = model.config
    backend = OnnxBackend(folder, reference=reference, threads=threads)
    gi = GraphInterface.of(cfg)
    prompts = prompts or [[(7 * i + 3) % cfg.vocab_size for i in range(5)], [11 % cfg.vocab_size, 5, 9]]
    ids, mask = left_pad(prompts, cfg.pad_token_id or 0)
    rows: list[dict] = []
    with export_mode(model, ACTIVATIONS[activations]):
        past_e, past_o = model.init_past(len(prompts)), backend.init_past(len(prompts))
        for step in range(decode_steps + 1):
            le, past_e = model(ids, mask, past_e)
            lo, past_o = backend.step(ids, mask, past_o)
            flat_e = [le] + [t for s in past_e for t in s]
            flat_o = [lo] + [t for s in past_o for t in s]
            rows += _rows("prefill" if step == 0 else f"decode {step}", gi.outputs, flat_e, flat_o)
            ids = le[:, -1].argmax(-1, keepdim=True)  # both sides continue with eager's greedy token
            mask = torch.cat([mask, torch.ones_like(ids)], dim=1)
    return rows


def worst(rows: list[dict]) -> dict:
    return max(rows, key=lambda r: r["max_abs"])
