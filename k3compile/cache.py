"""The build cache: exports and compiled artifacts made on a user's behalf (`generate SOURCE --backend onnx|tvm`,
`k3compile bench`), kept under `~/.cache/k3compile` (or `$K3COMPILE_CACHE`) and reused (docs/architecture.md,
"Build cache").

An entry's folder name is the sha256 of what determines its content: the source record (preset and seed, or the
resolved path of a config / checkpoint with the size and mtime of each of its files), the export options, the
target, the versions of k3compile, torch, onnx, onnxruntime and TVM, and a hash of k3compile's own source. An entry
is reused only once it opens cleanly (an export's record and hashes, an artifact's manifest with every file's
sha256); a damaged one is built again in place (it is this cache's own folder). Entries are written like every OUT
(artifact.ArtifactWriter), so an interrupted build leaves nothing half-written.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
from collections.abc import Callable
from pathlib import Path

from k3compile import __version__
from k3compile.interface import ExportError


def cache_root() -> Path:
    env = os.environ.get("K3COMPILE_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "k3compile"


@functools.cache
def _code_digest() -> str:
    """sha256 over k3compile's own source files (passes and targets included): a changed kernel or schedule is
    another entry even where the version number did not move."""
    import k3compile
    from k3compile import passes, targets

    digest = hashlib.sha256()
    for root in sorted({Path(m.__file__).parent for m in (k3compile, passes, targets)}):  # a set's order varies
        for f in sorted(root.rglob("*.py")):
            digest.update(str(f.relative_to(root)).encode())
            digest.update(f.read_bytes())
    return digest.hexdigest()


def _versions() -> dict:
    import onnx
    import onnxruntime
    import torch
    import tvm

    return {"k3compile": __version__, "code": _code_digest(), "torch": torch.__version__, "onnx": onnx.__version__,
            "onnxruntime": onnxruntime.__version__, "tvm": tvm.__version__}


def _files_of(record: dict) -> list:
    """(name, size, mtime_ns) of a checkpoint's or config's files: a changed file is another entry."""
    p = Path(record["source"])
    if not p.exists():
        return []
    files = sorted(p.iterdir()) if p.is_dir() else [p]
    return [(f.name, f.stat().st_size, f.stat().st_mtime_ns) for f in files if f.is_file()]


def entry_key(kind: str, record: dict, options: dict) -> str:
    doc = {"kind": kind, "source": record, "files": _files_of(record), "options": options, "versions": _versions()}
    return hashlib.sha256(json.dumps(doc, sort_keys=True).encode()).hexdigest()[:32]


def cached_export(source: str, seed: int = 0, weights: str = "auto", activations: str = "none",
                  progress: Callable[[str], None] | None = None) -> Path:
    """An export folder of SOURCE in the cache, exported (parity-checked) on first use."""
    from k3compile import source as sources
    from k3compile.interface import open_export
    from k3compile.pipeline import export_checked

    record = sources.record(source, seed, weights)
    folder = cache_root() / "exports" / entry_key("export", record, {"activations": activations})
    try:
        open_export(folder, graph=True)
        return folder
    except ExportError:
        pass
    step = progress or (lambda msg: None)
    step(f"exporting {source} into the cache ({folder})")
    folder.parent.mkdir(parents=True, exist_ok=True)
    model = sources.load_model(source, seed=seed, experts=weights)
    export_checked(model, folder, activations=activations, overwrite=True, source=record, progress=progress)
    return folder


def cached_artifact(source: str, target: str = "llvm", seed: int = 0, weights: str = "auto",
                    activations: str = "none", progress: Callable[[str], None] | None = None) -> Path:
    """A compiled artifact of SOURCE for `target` in the cache, exported and compiled on first use."""
    from k3compile import source as sources
    from k3compile.compile import compile_export, read_manifest
    from k3compile.targets import resolve

    record = sources.record(source, seed, weights)
    folder = cache_root() / "artifacts" / entry_key(
        "artifact", record, {"activations": activations, "target": resolve(target).describe()})
    try:
        read_manifest(folder)
        return folder
    except ExportError:
        pass
    export = cached_export(source, seed, weights, activations, progress)
    (progress or (lambda msg: None))(f"compiling {source} for {target} into the cache ({folder})")
    compile_export(export, folder, target=target, overwrite=True, progress=progress)
    return folder


def cached_sharded(source: str, mesh: str, target: str = "llvm", seed: int = 0, weights: str = "auto",
                   progress: Callable[[str], None] | None = None, dispatch: str = "all_reduce") -> Path:
    """A sharded artifact of SOURCE over `mesh` (`export --mesh`'s OUT) in the cache, built on first use."""
    from k3compile import source as sources
    from k3compile.partition import export_sharded, read_sharded
    from k3compile.sharding import Mesh
    from k3compile.targets import resolve

    parsed = Mesh.parse(mesh)
    record = sources.record(source, seed, weights)
    folder = cache_root() / "sharded" / entry_key("sharded", record, {"mesh": str(parsed), "dispatch": dispatch,
                                                                      "target": resolve(target).describe()})
    try:
        read_sharded(folder)
        return folder
    except ExportError:
        pass
    (progress or (lambda msg: None))(f"building {source} over {parsed} into the cache ({folder})")
    folder.parent.mkdir(parents=True, exist_ok=True)
    export_sharded(source, folder, parsed, target, seed=seed, experts=weights, overwrite=True, progress=progress,
                   dispatch=dispatch)
    return folder
