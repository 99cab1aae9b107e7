"""The build cache: exports and compiled artifacts made on a user's behalf (`generate SOURCE --backend onnx|tvm`,
`k3compile bench`), kept in the user's private folder (cachedir.py: `~/.cache/k3compile` or `$K3COMPILE_CACHE`,
0700) and reused (docs/architecture.md, "Build cache").

An entry's folder name is the sha256 of what determines its content: the source record (preset and seed, or the
resolved path of a config / checkpoint with the digest of its content), the export options, the target, the
versions of k3compile, torch, onnx, onnxruntime and TVM, and a hash of k3compile's own source. Beside each entry,
`<name>.tag` holds an HMAC (cachedir's key) of every file the entry holds: an entry is reused only when its tag
holds and it opens cleanly (an export's record and hashes, an artifact's manifest with every file's sha256); a
missing, damaged, edited or planted one is removed (it is in the cache's own folder) and built again, never loaded.
Building runs under the entry's lock, so two processes asking for the same entry at once build it once. Entries are
written like every OUT (artifact.ArtifactWriter), so an interrupted build leaves nothing half-written.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import shutil
from collections.abc import Callable
from pathlib import Path

from k3compile import __version__, cachedir
from k3compile.interface import ExportError, sha256_file

log = logging.getLogger(__name__)


def cache_root() -> Path:
    """The checked cache folder (cachedir.root: private to the user, a folder of its own)."""
    return cachedir.root()


def code_files() -> list[tuple[Path, Path]]:
    """k3compile's own source files as (package folder, file), in a fixed order: its Python (passes and targets
    included) and the C kernel a CPU library links (targets/bf16_gemm.c)."""
    import k3compile
    from k3compile import passes, targets

    return [(root, f) for root in sorted({Path(m.__file__).parent for m in (k3compile, passes, targets)})  # a set's
            for f in sorted(f for f in root.rglob("*") if f.suffix in (".py", ".c"))]  # order varies by process


@functools.cache
def _code_digest() -> str:
    """sha256 over code_files(): a changed kernel or schedule is another entry even where the version number did not
    move."""
    digest = hashlib.sha256()
    for root, f in code_files():
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


def entry_key(kind: str, record: dict, options: dict) -> str:
    """The entry's name: a hash of the source record (a checkpoint's or config's content digest included, see
    source.record), the options and the versions."""
    doc = {"kind": kind, "source": record, "options": options, "versions": _versions()}
    return hashlib.sha256(json.dumps(doc, sort_keys=True).encode()).hexdigest()[:32]


def _contents(folder: Path) -> dict:
    """What an entry holds: every file's relative path and sha256 (what its tag covers)."""
    return {f.relative_to(folder).as_posix(): sha256_file(f) for f in sorted(folder.rglob("*")) if f.is_file()}


def _tag_file(folder: Path) -> Path:
    return folder.with_name(folder.name + ".tag")


def _authentic(folder: Path) -> bool:
    """The entry is there and holds exactly what this user's k3compile put there (its tag holds)."""
    if not folder.is_dir() or folder.is_symlink():
        return False
    try:
        value = _tag_file(folder).read_text().strip()
    except OSError:
        return False
    return cachedir.tag_matches({"entry": folder.name, "files": _contents(folder)}, value)


def _cached(kind: str, key: str, opener: Callable[[Path], object], build: Callable[[Path], object],
            progress: Callable[[str], None] | None = None) -> Path:
    """The entry kind/key: reused when authentic and it opens cleanly, else (missing, damaged, edited, planted)
    removed and built again. Under the entry's lock: a second process building the same entry waits for the first
    and reuses its entry."""
    folder = cache_root() / kind / key
    with cachedir.locked(key):
        if _authentic(folder):
            try:
                opener(folder)
                return folder
            except ExportError:
                pass
        if folder.exists() or folder.is_symlink() or _tag_file(folder).exists():
            log.info("rebuilding the cache entry %s (missing its tag, damaged or not made here)", folder)
            (progress or (lambda msg: None))(f"discarding the cache entry {folder}: not authentic or damaged")
            _discard(folder)
        try:
            folder.parent.mkdir(mode=0o700, exist_ok=True)
        except OSError as e:
            raise cachedir.CacheError(f"cannot write into {folder.parent} ({e.strerror or e})") from None
        build(folder)
        _tag_file(folder).write_text(cachedir.tag({"entry": folder.name, "files": _contents(folder)}) + "\n")
    return folder


def _discard(folder: Path) -> None:
    """Remove an entry of the cache's own folder (never outside it: a link is removed, not followed)."""
    _tag_file(folder).unlink(missing_ok=True)
    if folder.is_symlink() or folder.is_file():
        folder.unlink()
    elif folder.is_dir():
        shutil.rmtree(folder)


def cached_export(source: str, seed: int = 0, weights: str = "auto", activations: str = "none",
                  progress: Callable[[str], None] | None = None, dense_weights: str = "source") -> Path:
    """An export folder of SOURCE in the cache, exported (parity-checked) on first use; `dense_weights` "mxfp8":
    its dense matrices quantized (k3compile/quant/dense.py)."""
    from k3compile import source as sources
    from k3compile.interface import open_export
    from k3compile.pipeline import export_checked

    record = sources.record(source, seed, weights)
    step = progress or (lambda msg: None)

    def build(folder: Path) -> None:
        step(f"exporting {source} into the cache ({folder})")
        model = sources.load_model(source, seed=seed, experts=weights)
        export_checked(model, folder, activations=activations, source=record, progress=progress,
                       dense_weights=dense_weights)

    return _cached("exports", entry_key("export", record, {"activations": activations, **_dense_key(dense_weights)}),
                   lambda f: open_export(f, graph=True), build, progress)


def _dense_key(dense_weights: str) -> dict:
    """The key's part for the dense weights: none for the source's (the entries made before there was a choice)."""
    return {} if dense_weights == "source" else {"dense_weights": dense_weights}


def cached_artifact(source: str, target="llvm", seed: int = 0, weights: str = "auto",
                    activations: str = "none", progress: Callable[[str], None] | None = None,
                    dense_weights: str = "source", matmul_precision: str = "fp32") -> Path:
    """A compiled artifact of SOURCE for `target` (a k3compile.targets.Target, or its name) in the cache, exported
    and compiled on first use (its dense matrices as compile's auto stores them: MXFP8 for `dense_weights`
    "mxfp8"; its dense matmuls at `matmul_precision`, compile's --matmul-precision)."""
    from k3compile import source as sources
    from k3compile.compile import compile_export
    from k3compile.manifest import read_manifest
    from k3compile.targets import resolve

    record = sources.record(source, seed, weights)
    tgt = resolve(target).with_matmul_precision(matmul_precision)  # a Target may carry one already

    def build(folder: Path) -> None:
        export = cached_export(source, seed, weights, activations, progress, dense_weights)
        (progress or (lambda msg: None))(f"compiling {source} for {tgt.name} into the cache ({folder})")
        compile_export(export, folder, target=tgt, progress=progress)

    precision = {} if tgt.matmul_precision == "fp32" else {"matmul_precision": tgt.matmul_precision}  # the keys
    # made before the option stay valid
    return _cached("artifacts", entry_key("artifact", record, {"activations": activations, **_dense_key(dense_weights),
                                                               **precision, "target": tgt.describe()}),
                   read_manifest, build, progress)


def cached_sharded(source: str, mesh: str, target: str = "llvm", seed: int = 0, weights: str = "auto",
                   progress: Callable[[str], None] | None = None, dispatch: str = "all_reduce") -> Path:
    """A sharded artifact of SOURCE over `mesh` (`export --mesh`'s OUT) in the cache, built on first use."""
    from k3compile import source as sources
    from k3compile.manifest import read_sharded
    from k3compile.partition import export_sharded
    from k3compile.sharding import Mesh
    from k3compile.targets import resolve

    parsed = Mesh.parse(mesh)
    record = sources.record(source, seed, weights)

    def build(folder: Path) -> None:
        (progress or (lambda msg: None))(f"building {source} over {parsed} into the cache ({folder})")
        export_sharded(source, folder, parsed, target, seed=seed, experts=weights, progress=progress,
                       dispatch=dispatch)

    return _cached("sharded", entry_key("sharded", record, {"mesh": str(parsed), "dispatch": dispatch,
                                                            "target": resolve(target).describe()}),
                   read_sharded, build, progress)
