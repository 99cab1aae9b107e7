"""The library functions behind the commands that span several layers (docs/architecture.md, "Layers").

`export_checked` traces, writes and gates an export on an onnxruntime-vs-eager parity run; `verify_export` checks
an export folder and compares eager with onnxruntime (and onnx.reference). They sit one floor above `export`,
`verify` and the backends, so that data flows down: export.py knows nothing of backends or verify.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from k3compile import verify
from k3compile.backends.eager import EagerBackend
from k3compile.backends.onnx import OnnxBackend
from k3compile.export import DEFAULT_TOL, MIN_OPSET, export
from k3compile.interface import ExportError, open_export
from k3compile.model.k3 import K3ForCausalLM
from k3compile.modes import ACT_QUANT_FLAGS, Forms
from k3compile.quant.dense import with_dense_weights
from k3compile.source import check_unchanged, load_model
from k3compile.threads import default_threads, use_threads


def parity_check(model: K3ForCausalLM, activations: str = "none", threads: int | None = None,
                 decode_steps: int = 2) -> Callable[[Path], list[dict]]:
    """check(folder): onnxruntime on the folder against eager in the exported forms (absorbed MLA, the activation
    quantization the graph carries), prefill and `decode_steps` decode steps."""
    forms = Forms.exported(ACT_QUANT_FLAGS[activations])

    def check(folder: Path) -> list[dict]:
        return verify.compare(EagerBackend(model, forms), OnnxBackend(folder, threads=threads),
                              decode_steps=decode_steps)

    return check


def export_checked(
    model: K3ForCausalLM,
    out: str | Path,
    opset: int = MIN_OPSET,
    activations: str = "none",
    source: dict | None = None,
    overwrite: bool = False,
    verify_parity: bool = True,
    tolerance: float = DEFAULT_TOL,
    threads: int | None = None,
    progress: Callable[[str], None] | None = None,
    dense_weights: str = "source",
) -> dict:
    """`export` gated on parity: onnxruntime must match eager within `tolerance` in every output (prefill and two
    decode steps) or nothing is written. Returns the export.json document, parity rows included. `dense_weights`
    "mxfp8" exports (and checks against) a copy of `model` whose dense matrices hold their MXFP8 values
    (quant/dense.py); the record says so, and `eager_of` quantizes the same way."""
    model = with_dense_weights(model, dense_weights)
    check = parity_check(model, activations, threads) if verify_parity else None
    return export(model, out, opset=opset, activations=activations, source=source, overwrite=overwrite,
                  check=check, tolerance=tolerance, progress=progress, dense_weights=dense_weights)


def eager_of(folder: str | Path, source: str | None = None, threads: int | None = None) -> EagerBackend:
    """The eager model an export folder (an artifact, a sharded OUT) was made from, rebuilt from its record (or
    `source`) after checking that the source's config is the exported one; run in the forms the export used."""
    from k3compile.manifest import is_sharded, read_sharded

    if is_sharded(folder):  # export --mesh's record is its manifest (its every file's sha256 checked first)
        doc, cfg, _ = read_sharded(folder)
        # its dense_weights is the format the ranks store (fp32, or bf16 cut exactly from bf16 values): the values
        # are the source's unless the build holds MXFP8 ones
        quant = "mxfp8" if doc.get("dense_weights") == "mxfp8" else "source"
    else:
        doc, cfg = open_export(folder)
        quant = doc.get("dense_weights", "source")
    rec = doc.get("source") or {}
    src = source or rec.get("source")
    if not src:
        raise ExportError(f"{folder}: export.json does not say where the weights came from; pass --source")
    verify.check_source(src, cfg)
    if source is None:  # the recorded source: still the files the export was made from
        check_unchanged(rec, f"the export {folder}")
    model = load_model(src, seed=rec.get("seed", 0), experts=rec.get("experts", "auto"))
    verify.check_model(model.config, cfg)
    model = with_dense_weights(model, quant)
    use_threads(threads or default_threads(cfg))
    return EagerBackend(model, Forms.exported(ACT_QUANT_FLAGS[doc.get("activations", "none")]))


def verify_export(folder: str | Path, source: str | None = None, reference: bool = False, decode_steps: int = 2,
                  threads: int | None = None, device: int | None = None) -> list[dict]:
    """Check an export folder (record, config.json, source) before building anything, rebuild the eager model from
    the record (or `source`), and compare it with onnxruntime (and onnx.reference): rows with a `backend` key.
    A compiled artifact (it holds its export) is checked the same way and compared too: in TVM's VM (llvm), or on its
    device from its launch plan (a GPU target an executor runs here: backends/executor.py; `device` picks it). The
    compiled backend is opened first, so that a missing driver or device is one line before any comparison runs.
    A sharded OUT (`export --mesh`) has no whole-model graph: its ranks, started here, are compared with eager."""
    from k3compile.manifest import is_sharded, read_manifest
    from k3compile.source import ARTIFACT, kind_of

    if is_sharded(folder):
        return _verify_sharded(folder, source, reference, decode_steps, threads, device)
    compiled = kind_of(folder) == ARTIFACT
    compiled_backend = None
    if compiled:
        from k3compile.backends.executor import DRIVERS, ExecutorBackend
        from k3compile.backends.tvm import TvmBackend
        from k3compile.manifest import is_gpu_artifact

        target = read_manifest(folder)["target"]  # every file's sha256, before anything is built
        if is_gpu_artifact(folder):  # on its device, from its launch plan, where an executor runs its target
            compiled_backend = ExecutorBackend(folder, device, host=True) if target in DRIVERS else None
        else:
            compiled_backend = TvmBackend(folder)
    if device is not None and compiled_backend is None:
        raise ExportError("--device picks the device of a GPU artifact's executor; FOLDER is not a GPU artifact an "
                          "executor runs here")
    eager = eager_of(folder, source, threads)
    rows = [dict(r, backend="onnxruntime")
            for r in verify.compare(eager, OnnxBackend(folder, threads=threads), decode_steps=decode_steps)]
    if reference:
        rows += [dict(r, backend="onnx.reference")
                 for r in verify.compare(eager, OnnxBackend(folder, reference=True), decode_steps=decode_steps)]
    if compiled_backend is not None:
        rows += [dict(r, backend=compiled_backend.name)
                 for r in verify.compare(eager, compiled_backend, decode_steps=decode_steps)]
    return rows


def _verify_sharded(folder, source, reference: bool, decode_steps: int, threads, device) -> list[dict]:
    """verify_export for `export --mesh`'s OUT: its ranks on this machine (backends/sharded.py) against eager, every
    position's logits and every layer's state (fetched from the ranks each step)."""
    from k3compile.backends.sharded import ShardedBackend

    if reference or device is not None:
        raise ExportError(f"{folder}: a sharded artifact has no whole-model graph for onnx.reference, and its "
                          "ranks take their devices from `run --device`; drop --reference / --device")
    eager = eager_of(folder, source, threads)  # the manifest and every rank file checked before any rank starts
    backend = ShardedBackend(folder, threads=threads)
    try:
        return [dict(r, backend=backend.name) for r in verify.compare(eager, backend, decode_steps=decode_steps)]
    finally:
        backend.close()


def verify_device(folder: str | Path, device: str, source: str | None = None, decode_steps: int = 2,
                  threads: int | None = None, progress=None) -> tuple[list, list[dict], str | None]:
    """`verify --kernels`: the k3 kernels of the folder's model (an export, or an artifact of that device's target),
    each run on the device against the llvm build and the eager op (device_check.Row), then the whole model run on
    the device kernel by kernel against eager (verify rows, backend "<device>-device"). Returns (kernel rows, step
    rows, why the whole model did not run: the target's refusal, or None)."""
    import onnx

    from k3compile import device_check, devices
    from k3compile.frontend import to_relax
    from k3compile.interface import MODEL_FILE
    from k3compile.manifest import read_manifest
    from k3compile.passes import run_phases
    from k3compile.source import ARTIFACT, kind_of
    from k3compile.targets import resolve

    step = progress or (lambda msg: None)
    if kind_of(folder) == ARTIFACT:
        target = read_manifest(folder)["target"]
        if target != device:
            raise ExportError(f"{folder}: compiled for {target}, not {device} (give the export folder, or compile it "
                              f"with --target {device})")
    else:
        open_export(folder, graph=True)
    dev = devices.driver(device)
    target = resolve(device)
    step(f"lowering the k3 ops for {device}")
    mod = to_relax(onnx.load(str(Path(folder) / MODEL_FILE)))
    ops = device_check.kernels_of(run_phases(mod, target, upto="lower-k3-calls"))
    kernel_rows = []
    for op, key in ops:
        step(f"running {op} on {dev.describe()}")
        kernel_rows += device_check.check_op(target, op, key, dev)
    from k3compile.backends.device import DeviceBackend

    try:
        backend = DeviceBackend(folder, device, progress=step)
    except ExportError as e:
        return kernel_rows, [], str(e)
    eager = eager_of(folder, source, threads)
    step_rows = [dict(r, backend=backend.name) for r in verify.compare(eager, backend, decode_steps=decode_steps)]
    return kernel_rows, step_rows, None
