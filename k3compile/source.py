"""Where a model comes from (docs/architecture.md, "Sources"): a preset name, an HF config.json (or a folder with
only a config.json), a checkpoint folder (config.json + safetensors), or an export folder (which runs through a
backend, not as an eager model). One function resolves which, and one builds the eager model.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch

from k3compile.checkpoint import CheckpointError, assemble, load_checkpoint
from k3compile.compile import MANIFEST
from k3compile.config import EXPERT_CHOICES
from k3compile.interface import EXPORT_JSON, MODEL_FILE
from k3compile.model.k3 import K3ForCausalLM, init_weights
from k3compile.model.state_dict_adapter import convert_experts
from k3compile.presets import PRESETS, load_config
from k3compile.sizing import check_fits

PRESET, CONFIG, CHECKPOINT, EXPORT, ARTIFACT = "preset", "config", "checkpoint", "export", "artifact"


def kind_of(source: str | Path) -> str:
    """preset, config, checkpoint, export or artifact (an unknown name is left to load_config to report). A folder
    is always a checkpoint, an export or a compiled artifact (it has manifest.json): a folder holding a config.json
    but no weights is a checkpoint missing its weights (an error), never a request for random weights."""
    if isinstance(source, str) and source in PRESETS:
        return PRESET
    p = Path(source)
    if p.is_dir() and (p / MANIFEST).is_file() and (p / MODEL_FILE).is_file():
        return ARTIFACT
    if p.is_dir():
        if not any(p.glob("*.safetensors")) and ((p / MODEL_FILE).is_file() or (p / EXPORT_JSON).is_file()):
            return EXPORT
        return CHECKPOINT
    return CONFIG


def record(source: str, seed: int, experts: str) -> dict:
    """Where the weights came from, as an export records it, so that `verify` can rebuild the eager model."""
    path = source if kind_of(source) == PRESET else str(Path(source).resolve())
    return {"source": path, "seed": seed, "experts": experts}


def load_model(
    source: str | Path, seed: int = 0, experts: str = "auto", progress: Callable[[int, int], None] | None = None
) -> K3ForCausalLM:
    """A preset name or config.json (seeded random weights) or a checkpoint folder (its weights).

    `experts` means the same for both: "auto" keeps the stored format, "float" dequantizes MXFP4 experts and
    "mxfp4" quantizes float ones; for a preset, the stored weights are the seeded draw in the preset's own format,
    so `--experts float` gives the same model as `--experts auto`, dequantized."""
    if experts not in EXPERT_CHOICES:
        raise CheckpointError(f"experts: {experts!r} is not one of {', '.join(EXPERT_CHOICES)}")
    kind = kind_of(source)
    if kind == EXPORT:
        raise CheckpointError(f"{source} is an export folder, not a checkpoint (run it with --backend onnx)")
    if kind == ARTIFACT:
        raise CheckpointError(f"{source} is a compiled artifact, not a checkpoint (run it with --backend tvm)")
    if kind == CHECKPOINT:
        return load_checkpoint(source, experts=experts, progress=progress)
    cfg = load_config(source)
    target = cfg.expert_format if experts == "auto" else experts
    target_cfg = cfg.replace(expert_format=target)  # checks that the widths allow MXFP4
    check_fits(cfg)
    model = init_weights(K3ForCausalLM(cfg), seed=seed).eval()
    if target == cfg.expert_format:
        return model
    return assemble(target_cfg, convert_experts(model.state_dict(), target, torch.float32))
