"""Where a model comes from (docs/architecture.md, "Sources"): a preset name, an HF config.json (or a folder with
only a config.json), a checkpoint folder (config.json + safetensors), or an export folder (which runs through a
backend, not as an eager model). One function resolves which, and one builds the eager model.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from k3compile.config import EXPERT_CHOICES
from k3compile.interface import EXPORT_JSON, MODEL_FILE, sha256_file
from k3compile.manifest import MANIFEST
from k3compile.presets import PRESETS, load_config

if TYPE_CHECKING:
    from k3compile.model.k3 import K3ForCausalLM

# torch, the model and the checkpoint reader are imported by the functions that build a model: kind_of and
# tokenizer_for run without torch (k3compile/lean.py).

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
    """Where the weights came from, as an export records it, so that `verify` can rebuild the eager model: a preset
    and its seed, or the resolved path of a config.json / checkpoint folder and the digest of its content."""
    if kind_of(source) == PRESET:
        return {"source": source, "seed": seed, "experts": experts}
    path = Path(source).resolve()
    rec = {"source": str(path), "seed": seed, "experts": experts}
    if path.exists():
        rec["digest"] = content_digest(path)
    return rec


def content_digest(path: Path) -> str:
    """sha256 over the names and contents of a file, or of a folder's files (not its subfolders): a checkpoint's
    identity. Memoized per user (cachedir) by each file's path, device, inode, size, mtime and ctime, so it is
    recomputed whenever any of them changes (ctime moves on every write and every metadata change)."""
    from k3compile import cachedir

    path = Path(path)
    files = sorted(f for f in path.iterdir() if f.is_file()) if path.is_dir() else [path]
    stamp = []
    for f in files:
        st = f.stat()
        stamp.append([str(f.resolve()), st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns])
    try:
        known = cachedir.recall_digest(stamp)
    except cachedir.CacheError:  # no usable cache folder: digest without the memo
        known = None
    if known:
        return known
    h = hashlib.sha256()
    for f in files:
        h.update(f.name.encode() + b"\0" + sha256_file(f).encode() + b"\n")
    digest = h.hexdigest()
    try:
        cachedir.remember_digest(stamp, digest)
    except cachedir.CacheError:
        pass
    return digest


def check_unchanged(rec: dict, what: str) -> None:
    """A recorded source (an export's) is still what it was: its content digest, where one was recorded, matches
    the files there now. Raises CheckpointError naming the source otherwise."""
    from k3compile.checkpoint import CheckpointError

    digest = rec.get("digest")
    src = rec.get("source")
    if digest is None or not isinstance(src, str) or kind_of(src) == PRESET:
        return
    if not Path(src).exists():
        raise CheckpointError(f"{src}: {what} was made from it, and it is gone")
    if content_digest(Path(src)) != digest:
        raise CheckpointError(f"{src}: its files changed since {what} was made from them (their content digest "
                              "differs from the record's); export it again")


def load_model(
    source: str | Path, seed: int = 0, experts: str = "auto", progress: Callable[[int, int], None] | None = None
) -> K3ForCausalLM:
    """A preset name or config.json (seeded random weights) or a checkpoint folder (its weights).

    `experts` means the same for both: "auto" keeps the stored format, "float" dequantizes MXFP4 experts and
    "mxfp4" quantizes float ones; for a preset, the stored weights are the seeded draw in the preset's own format,
    so `--experts float` gives the same model as `--experts auto`, dequantized."""
    import torch

    from k3compile.checkpoint import CheckpointError, assemble, load_checkpoint
    from k3compile.model.k3 import K3ForCausalLM, init_weights
    from k3compile.model.state_dict_adapter import convert_experts
    from k3compile.sizing import check_fits

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


def tokenizer_for(source, cfg):
    """The tokenizer (k3compile.tokenizer.Tokenizer) of a SOURCE (docs/architecture.md, "Tokenizers"): a preset or
    a bare config.json gets `preset_tokenizer`; a checkpoint folder its own files (None when it ships none); an
    export, artifact or sharded OUT its own files (the copy the export carried, checked against the sha256 its
    export.json or manifest.json records), else those of the source its record names (an export made before exports
    carried one)."""
    from k3compile.interface import read_json, read_record, sha256_file
    from k3compile.manifest import is_sharded
    from k3compile.tokenizer import MIN_VOCAB, TokenizerError, load_tokenizer, preset_tokenizer

    kind = kind_of(source)

    def built():
        return preset_tokenizer(cfg.vocab_size, cfg.bos_token_id, cfg.eos_token_id) \
            if cfg.vocab_size >= MIN_VOCAB else None

    if kind == PRESET:
        return built()
    path = Path(source)
    folder = path if path.is_dir() else path.parent
    sharded = kind == CHECKPOINT and is_sharded(folder)  # export --mesh's OUT: its manifest is its record
    if kind in (EXPORT, ARTIFACT) or sharded:  # the files the export carried, as its record hashed them
        record_doc = read_json(folder / MANIFEST, "") if sharded else read_record(folder)
        carried = record_doc.get("tokenizer", {}) if isinstance(record_doc, dict) else None
        if not (isinstance(carried, dict) and all(isinstance(k, str) and isinstance(v, str) and Path(k).name == k
                                                  for k, v in carried.items())):
            raise TokenizerError(f"{folder}: its record's tokenizer entry is malformed; export again")
        for name, digest in carried.items():
            if not (folder / name).is_file() or sha256_file(folder / name) != digest:
                raise TokenizerError(f"{folder / name}: missing or changed since the export (its sha256 differs "
                                     f"from {MANIFEST if sharded else EXPORT_JSON}'s); export again")
    tok = load_tokenizer(folder, cfg.vocab_size, cfg.bos_token_id, cfg.eos_token_id)
    if tok is None and (kind in (EXPORT, ARTIFACT) or sharded):  # an export made before exports carried one
        origin = record_doc.get("source")
        origin = origin.get("source") if isinstance(origin, dict) else None
        usable = isinstance(origin, str) and origin and (kind_of(origin) == PRESET or Path(origin).exists())
        return tokenizer_for(origin, cfg) if usable else None
    return tok if tok is not None or kind != CONFIG else built()  # a bare config.json: random weights, any tokenizer
