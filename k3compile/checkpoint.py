"""HF-layout safetensors checkpoint files of the family (docs/model.md, "Checkpoints"): find, check, read, write.

The name and layout mapping (Kimi-Linear and K3 layouts, per-expert tensors <-> stacked experts, a selection of
layers or experts) is model/state_dict_adapter.py's; this module does the file work. Single files and sharded
`model.safetensors.index.json` folders both load, and `load_state` reads only the tensors a selection keeps. A
missing, extra, misshaped or wrongly typed tensor is reported by its checkpoint name before any weight is read; a
weight holding NaN / Inf, or an E8M0 scale byte 0xFF (NaN), is reported by name as it is read.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from k3compile.config import EXPERT_CHOICES, ConfigError, K3Config, read_config
from k3compile.errors import UserError
from k3compile.model.k3 import K3ForCausalLM
from k3compile.model.state_dict_adapter import (
    ALL,
    LAYOUTS,
    Selection,
    convert_experts,
    dense_aliases,
    detect_expert_format,
    detect_layout,
    expected,
    from_checkpoint,
    to_checkpoint,
)
from k3compile.quant.mx import E8M0_NAN

log = logging.getLogger(__name__)

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
_SHARD = re.compile(r"^model-\d{5}-of-\d{5}\.safetensors$")
FLOAT_DTYPES = ("F16", "BF16", "F32", "F64")  # safetensors' names
BYTE_DTYPES = {"weight_packed": ("U8",), "weight_scale": ("U8", "F8_E8M0")}  # MXFP4 nibbles, E8M0 scale bytes


class CheckpointError(UserError):
    """A checkpoint that does not match its config, or cannot be read; the message names the tensors."""


# ---- reading --------------------------------------------------------------------------------------------------------

def _files(folder: Path) -> list[Path]:
    if (folder / INDEX).is_file():
        try:
            wm = json.loads((folder / INDEX).read_text())["weight_map"]
        except (OSError, ValueError, KeyError, TypeError, RecursionError) as e:
            raise CheckpointError(f"{folder / INDEX}: unreadable shard index ({e})") from None
        if not isinstance(wm, dict) or not all(isinstance(f, str) and f and Path(f).name == f for f in wm.values()):
            raise CheckpointError(f"{folder / INDEX}: weight_map must map tensor names to file names in {folder}")
        files = sorted({folder / f for f in wm.values()})
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise CheckpointError(f"{folder}: shard(s) named in the index are missing: {', '.join(missing)}")
        return files
    if (folder / SINGLE).is_file():
        return [folder / SINGLE]
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{folder}: no *.safetensors weights found")
    return files


def _scan(files: list[Path]) -> dict[str, tuple[Path, tuple[int, ...], str]]:
    found: dict[str, tuple[Path, tuple[int, ...], str]] = {}
    for f in files:
        try:
            with safe_open(f, "pt") as h:
                for k in h.keys():
                    sl = h.get_slice(k)
                    found[k] = (f, tuple(sl.get_shape()), sl.get_dtype())
        except (SafetensorError, OSError, ValueError) as e:
            raise CheckpointError(f"{f}: not a readable safetensors file ({e})") from None
    return found


def _short(names: list[str], n: int = 6) -> str:
    names = sorted(names)
    more = f" … and {len(names) - n} more" if len(names) > n else ""
    return ", ".join(names[:n]) + more


def _want_dtypes(name: str) -> tuple[str, ...]:
    return BYTE_DTYPES.get(name.rsplit(".", 1)[-1], FLOAT_DTYPES)


def check_names(cfg: K3Config, found: dict[str, tuple[int, ...]], layout: str,
                dtypes: dict[str, str] | None = None, select: Selection = ALL) -> None:
    """Raise CheckpointError naming every missing, extra, misshaped or (given `dtypes`) wrongly typed tensor."""
    want = expected(cfg, layout, select)
    missing = [k for k in want if k not in found]
    extra = [k for k in found if k not in want]
    bad = []
    for k, shape in want.items():
        if k in found and found[k] != shape:
            if k.endswith(".A_log") and layout == "k3" and len(found[k]) == 1 and found[k][0] >= cfg.kda_num_heads:
                continue  # any zero padding past H is accepted
            bad.append(f"{k} {list(found[k])} (expected {list(shape)})")
    typed = [f"{k} {dtypes[k]} (expected {' or '.join(_want_dtypes(k))})" for k in want
             if dtypes and k in dtypes and dtypes[k] not in _want_dtypes(k)]
    problems = []
    if typed:
        problems.append(f"wrong dtype: {_short(typed, 4)}")
    if missing:
        problems.append(f"missing {len(missing)} tensor(s): {_short(missing)}")
    if extra:
        problems.append(f"unexpected {len(extra)} tensor(s): {_short(extra)}")
    if bad:
        problems.append(f"misshaped: {_short(bad, 4)}")
    if problems:
        raise CheckpointError("checkpoint does not match its config: " + "; ".join(problems))


def load_state(
    folder: str | Path,
    cfg: K3Config | None = None,
    select: Selection = ALL,
    dtype: torch.dtype = torch.float32,
    progress: Callable[[int, int], None] | None = None,
) -> tuple[K3Config, dict[str, torch.Tensor], str]:
    """Read a checkpoint folder's tensors, or the `select`ed subset of them (a layer range, an expert slice): only
    those tensors are read from the files. Returns (config with the stored expert format, native state dict,
    layout). Names, shapes and dtypes are checked before any tensor is read."""
    folder = Path(folder)
    if not folder.is_dir():
        raise CheckpointError(f"{folder}: not a checkpoint folder")
    if cfg is None:
        try:
            cfg = read_config(folder)
        except ConfigError as e:
            raise CheckpointError(str(e)) from None
    try:
        select.check(cfg)
    except ValueError as e:
        raise CheckpointError(f"{folder}: {e}") from None
    found = _scan(_files(folder))
    layout = detect_layout(found)
    alias = dense_aliases(list(found), cfg, layout)
    shapes = {a: found[k][1] for a, k in alias.items()}
    shapes.update({k: v[1] for k, v in found.items() if k not in alias.values()})
    shapes = {k: v for k, v in shapes.items() if select.keeps(k, cfg)}
    dtypes = {k: found[alias.get(k, k)][2] for k in shapes}
    stored = detect_expert_format(shapes) or cfg.expert_format
    try:
        stored_cfg = cfg.replace(expert_format=stored)
    except ConfigError as e:
        raise CheckpointError(f"{folder}: {e}") from None
    check_names(stored_cfg, shapes, layout, dtypes, select)
    tensors: dict[str, torch.Tensor] = {}
    src = {k: alias.get(k, k) for k in shapes}
    by_file: dict[Path, list[str]] = {}
    for k, s in src.items():
        by_file.setdefault(found[s][0], []).append(k)
    done = 0
    for f, keys in by_file.items():
        try:
            with safe_open(f, "pt") as h:
                for k in keys:
                    t = h.get_tensor(src[k])
                    if t.dtype == getattr(torch, "float8_e8m0fnu", None):
                        t = t.view(torch.uint8)
                    _check_finite(src[k], t)
                    tensors[k] = t if t.dtype == torch.uint8 else t.to(dtype)
                    done += 1
                    if progress:
                        progress(done, len(src))
        except (SafetensorError, OSError, RuntimeError) as e:
            raise CheckpointError(f"{f}: cannot read its tensors ({str(e).splitlines()[0][:200]})") from None
    log.info("read %s (%s layout, %s experts, %d tensors)", folder, layout, stored, len(tensors))
    return stored_cfg, from_checkpoint(tensors, stored_cfg, layout), layout


def load_checkpoint(
    folder: str | Path,
    cfg: K3Config | None = None,
    experts: str = "auto",
    dtype: torch.dtype = torch.float32,
    progress: Callable[[int, int], None] | None = None,
) -> K3ForCausalLM:
    """Load a checkpoint folder (config.json + safetensors). `experts`: "auto" keeps the checkpoint's expert
    format, "mxfp4" quantizes float experts (OCP FLOOR rule), "float" dequantizes MXFP4 experts."""
    if experts not in EXPERT_CHOICES:
        raise CheckpointError(f"experts: {experts!r} is not one of auto, float, mxfp4")
    stored_cfg, state, _ = load_state(folder, cfg, dtype=dtype, progress=progress)
    target = stored_cfg.expert_format if experts == "auto" else experts
    try:
        target_cfg = stored_cfg.replace(expert_format=target)
    except ConfigError as e:
        raise CheckpointError(f"experts={target}: {e}") from None
    if target != stored_cfg.expert_format:
        state = convert_experts(state, target, dtype)
    return assemble(target_cfg, state)


def _check_finite(name: str, t: torch.Tensor) -> None:
    """A NaN / Inf weight or a NaN E8M0 scale would make every output NaN (and greedy decode print token 0)."""
    if t.is_floating_point():
        bad = int((~torch.isfinite(t)).sum())
        if bad:
            raise CheckpointError(f"{name}: {bad} non-finite value(s) (NaN or Inf)")
    elif name.endswith(".weight_scale") and t.dtype == torch.uint8:
        bad = int((t == E8M0_NAN).sum())
        if bad:
            raise CheckpointError(f"{name}: {bad} E8M0 scale byte(s) 0xFF, which encode NaN")


def assemble(cfg: K3Config, state: dict[str, torch.Tensor]) -> K3ForCausalLM:
    """A model holding exactly these tensors (built on the meta device: no second copy of the weights)."""
    with torch.device("meta"):
        model = K3ForCausalLM(cfg)
    model.load_state_dict(state, strict=True, assign=True)
    if cfg.tie_word_embeddings:  # assign made two Parameters of one tensor: make them one again
        model.lm_head.weight = model.model.embed_tokens.weight
    return model.eval()


# ---- writing --------------------------------------------------------------------------------------------------------

def save_checkpoint(
    model: K3ForCausalLM,
    folder: str | Path,
    layout: str | None = None,
    dtype: torch.dtype | None = None,
    max_shard_bytes: int = 4 << 30,
    overwrite: bool = False,
    tokenizer="auto",
) -> Path:
    """Write config.json + safetensors (sharded with an index past max_shard_bytes). Layout defaults to k3 for
    configs with K3 features, else kimi_linear.

    The folder must be empty or absent. With `overwrite`, the files an earlier save wrote there (config.json, the
    single file or the index and its shards) are removed first, so that no stale index or shard can be loaded in
    place of the new weights; any other file (a tokenizer, a README) is left alone.

    `tokenizer` (a k3compile.tokenizer.Tokenizer, "auto", or None): its files are written beside the weights where
    the folder has no tokenizer file yet (one already there is the user's and is kept); "auto" writes the tokenizer
    presets get (tokenizer.preset_tokenizer for the config's vocabulary and bos / eos ids; none below
    tokenizer.MIN_VOCAB ids), None none."""
    cfg = model.config
    layout = layout or ("k3" if cfg.is_k3 else "kimi_linear")
    if layout not in LAYOUTS:
        raise CheckpointError(f"layout: {layout!r} is not one of {LAYOUTS}")
    folder = Path(folder)
    if folder.exists() and not folder.is_dir():
        raise CheckpointError(f"{folder}: exists and is not a folder")
    if folder.is_dir() and any(folder.iterdir()):
        if not overwrite:
            raise CheckpointError(f"{folder}: not empty (overwrite=True replaces an earlier checkpoint's files)")
        for f in _saved_files(folder):
            f.unlink()
    folder.mkdir(parents=True, exist_ok=True)
    tensors = to_checkpoint(model.state_dict(), cfg, layout)
    tensors = {
        k: (v.to(dtype) if dtype is not None and v.is_floating_point() else v).contiguous().clone()
        for k, v in tensors.items()
    }
    cfg.save(folder / "config.json")
    _save_tokenizer(folder, cfg, tokenizer)
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for k, v in tensors.items():
        nbytes = v.numel() * v.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][k] = v
        size += nbytes
    if len(shards) == 1:
        save_file(shards[0], str(folder / SINGLE), metadata={"format": "pt"})
        return folder
    weight_map = {}
    for i, shard in enumerate(shards):
        name = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(folder / name), metadata={"format": "pt"})
        weight_map.update({k: name for k in shard})
    total = sum(v.numel() * v.element_size() for v in tensors.values())
    (folder / INDEX).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    return folder


def _save_tokenizer(folder: Path, cfg, tokenizer) -> None:
    from k3compile.tokenizer import MIN_VOCAB, TOKENIZER_FILES, preset_tokenizer

    if tokenizer is None or any((folder / n).exists() for n in TOKENIZER_FILES):
        return
    if tokenizer == "auto":
        if cfg.vocab_size < MIN_VOCAB:
            return  # a toy vocabulary: no tokenizer
        tokenizer = preset_tokenizer(cfg.vocab_size, cfg.bos_token_id, cfg.eos_token_id)
    tokenizer.save(folder)


def _saved_files(folder: Path) -> list[Path]:
    """The files save_checkpoint writes, as an earlier save left them in `folder`."""
    names = {"config.json", SINGLE, INDEX}
    try:
        names |= set(json.loads((folder / INDEX).read_text())["weight_map"].values())
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        pass
    return [f for f in folder.iterdir()
            if (f.name in names or _SHARD.match(f.name)) and f.is_file() and not f.is_symlink()]
