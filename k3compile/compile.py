"""`k3compile compile`: an export folder compiled by TVM into an artifact folder (docs/architecture.md, "The
compile path").

OUT holds the library (`model.so`: the Relax VM executable for the target, k3 ops lowered to TIR kernels where a
kernel covers them), the weights as named parameters (`weights.safetensors`), the ONNX it came from with its
config.json and export.json, and `manifest.json` (target, versions, interface, the parameter order, the sha256 of
every file), which `backends.tvm` checks before loading anything. OUT is written through artifact.ArtifactWriter.
"""

from __future__ import annotations

import shutil
import time
from collections.abc import Callable
from pathlib import Path

from k3compile import __version__
from k3compile.artifact import ArtifactError, ArtifactWriter
from k3compile.interface import (
    CONFIG_FILE,
    DATA_FILE,
    EXPORT_JSON,
    MODEL_FILE,
    ExportError,
    GraphInterface,
    open_export,
    read_json,
    sha256_file,
    write_json,
)

LIBRARY = "model.so"
WEIGHTS = "weights.safetensors"
MANIFEST = "manifest.json"
KIND = "tvm-executable"
TARGETS = ("llvm",)


def check_target(target: str) -> None:
    if target not in TARGETS:
        raise ExportError(f"target {target!r}: only {', '.join(TARGETS)} (this CPU) is supported so far")


def compile_export(export_dir: str | Path, out: str | Path, target: str = "llvm", overwrite: bool = False,
                   progress: Callable[[str], None] | None = None) -> dict:
    """Compile an export folder for `target` into the artifact folder `out`; returns the manifest."""
    import onnx
    import tvm
    from safetensors.numpy import save_file

    step = progress or (lambda msg: None)
    export_dir = Path(export_dir)
    check_target(target)
    doc, cfg = open_export(export_dir, graph=True)
    t0 = time.perf_counter()
    try:
        with ArtifactWriter(out, overwrite, protect=(export_dir,)) as w:
            _, executable, names, params = build(export_dir, target, keep_params=True, progress=step)
            executable.export_library(str(w.path / LIBRARY))
            save_file({n: p.numpy() for n, p in zip(names, params)}, str(w.path / WEIGHTS))
            for name in (MODEL_FILE, DATA_FILE, CONFIG_FILE, EXPORT_JSON):
                if (export_dir / name).is_file():
                    shutil.copyfile(export_dir / name, w.path / name)
            manifest = {
                "k3compile": __version__,
                "kind": KIND,
                "target": target,
                "versions": {"tvm": tvm.__version__, "onnx": onnx.__version__},
                "interface": GraphInterface.of(cfg).as_record(),
                "params": names,
                "compile_s": round(time.perf_counter() - t0, 3),
                "files": {f.name: sha256_file(f) for f in sorted(w.path.iterdir())},
            }
            write_json(w.path / MANIFEST, manifest)
            step("renaming into place")
            w.commit()
    except ArtifactError as e:
        raise ExportError(str(e)) from None
    except OSError as e:
        raise ExportError(f"{out}: writing failed ({e.strerror or e}); nothing was written") from None
    return manifest


def build(export_dir: Path, target: str, keep_params: bool = False, progress: Callable[[str], None] | None = None):
    """An export folder (already checked) imported, lowered (passes.PHASES) and compiled for `target`: returns
    (module, executable, weight names, weights); with `keep_params` the weights are parameters, else constants."""
    import onnx
    import tvm

    from k3compile.frontend import to_relax
    from k3compile.passes import run_phases

    step = progress or (lambda msg: None)
    step("importing into TVM Relax")
    imported = to_relax(onnx.load(str(Path(export_dir) / MODEL_FILE)), keep_params=keep_params)
    mod, names, params = imported if keep_params else (imported, [], [])
    step("lowering the k3 ops")
    mod = run_phases(mod)
    step(f"compiling for {target}")
    return mod, tvm.compile(mod, target=target), names, params


def read_manifest(folder: str | Path) -> dict:
    """The artifact's manifest, checked: its fields, and every listed file present with its recorded sha256."""
    import re

    folder = Path(folder)
    doc = read_json(folder / MANIFEST, f"{folder}: not a compiled artifact (no {MANIFEST}; run `k3compile compile`)")
    files = doc.get("files") if isinstance(doc, dict) else None
    if not (isinstance(doc, dict) and doc.get("kind") == KIND and isinstance(doc.get("k3compile"), str)
            and isinstance(doc.get("target"), str) and isinstance(files, dict)
            and isinstance(doc.get("params"), list) and all(isinstance(p, str) for p in doc["params"])
            and all(isinstance(k, str) and Path(k).name == k and isinstance(v, str) and re.fullmatch(r"[0-9a-f]{64}", v)
                    for k, v in files.items())
            and {LIBRARY, WEIGHTS, CONFIG_FILE} <= set(files)):
        raise ExportError(f"{folder / MANIFEST}: not a k3compile {KIND} manifest (damaged or edited; compile again)")
    for name, digest in files.items():
        path = folder / name
        if not path.is_file():
            raise ExportError(f"{path}: missing (listed in {MANIFEST})")
        if sha256_file(path) != digest:
            raise ExportError(f"{path}: its sha256 differs from {MANIFEST}'s (changed or corrupt; compile again)")
    return doc
