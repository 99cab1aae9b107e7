"""`k3compile compile`: an export folder compiled by TVM into an artifact folder (docs/architecture.md, "The
compile path").

OUT holds the library (`model.so`: the Relax VM executable for the target, every k3 op lowered to a TIR kernel; a
build that would leave one extern is refused), the weights in the target's layout in the order the library takes
them (`weights.safetensors`), the ONNX it came from with its config.json and export.json, and `manifest.json`
(target and full TVM target, versions, interface, the parameter order, the sha256 of every file), which
`backends.tvm` checks before loading anything. OUT is written through artifact.ArtifactWriter.
"""

from __future__ import annotations

import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from k3compile import __version__, library
from k3compile.artifact import writing
from k3compile.interface import (
    CONFIG_FILE,
    DATA_FILE,
    EXPORT_JSON,
    MODEL_FILE,
    ExportError,
    GraphInterface,
    open_export,
    sha256_file,
    write_json,
)
from k3compile.manifest import (  # the artifact format
    CONSTANTS,
    DEVICE_SOURCE,
    KIND,
    LAUNCH_PLAN,
    LIBRARY,
    MANIFEST,
    WEIGHTS,
)

if TYPE_CHECKING:
    from k3compile.targets import Target


def compile_export(export_dir: str | Path, out: str | Path, target="llvm", overwrite: bool = False,
                   progress: Callable[[str], None] | None = None, dump_ir: str | Path | None = None,
                   tune: int = 0, dense: str = "auto", decode_library: bool = True, host_gemm: bool = True,
                   matmul_precision: str = "fp32") -> dict:
    """Compile an export folder for `target` (a k3compile.targets.Target, or its name) into the artifact folder
    `out`; returns the manifest. On a CPU target the artifact also holds decode.so, the decode step at batch 1 built
    with static shapes (k3compile/tune.py; docs/architecture.md, "The decode library and tuning"), unless
    `decode_library` is False; with `tune` > 0 its functions are tuned with that many meta_schedule trials. `dense`:
    how the dense matrices are stored (`dense_target`). Without `host_gemm` no kernel calls k3compile's host GEMM
    (Target.without_host_gemm): a plain TVM runtime runs the whole library. `matmul_precision` "bf16": the dense matmuls
    round their activations to bf16 (Target.with_matmul_precision; refused when no matmul of the build can)."""
    import tempfile

    import onnx
    import tvm
    from safetensors.numpy import save_file

    from k3compile.targets import host_record, resolve
    from k3compile.tune import DECODE_LIBRARY, RECORDS, WORKLOADS

    step = progress or (lambda msg: None)
    export_dir = Path(export_dir)
    tgt = resolve(target)
    if not host_gemm:
        tgt = tgt.without_host_gemm()
    tgt = tgt.with_matmul_precision(matmul_precision)
    if tune < 0:
        raise ExportError(f"--tune takes a number of trials >= 0, got {tune}")
    if tune and tgt.gpu:
        raise ExportError(f"--tune tunes CPU code; target {tgt.name!r} is scheduled by dlight and its own kernels")
    if tune and not decode_library:
        raise ExportError(f"--tune {tune} tunes the decode library, which --no-decode-library leaves out")
    if tune and tgt.matmul_precision != "fp32":
        raise ExportError(f"--tune tunes TVM's schedules; under --matmul-precision {tgt.matmul_precision} the dense "
                          "matmuls run a C kernel (targets/bf16_gemm.c) that meta_schedule cannot build or time")
    if dump_ir is not None:
        _dump_folder(dump_ir, create=False, apart_from=(out, export_dir))  # refused before any work; created once
        # the compile starts
    doc, cfg = open_export(export_dir, graph=True)
    dense = export_dense(doc, dense)
    t0 = time.perf_counter()
    with writing(out, ExportError, overwrite, protect=(export_dir,)) as w, tempfile.TemporaryDirectory() as work:
        mod, executable, names, params = build(export_dir, tgt, progress=step, dump_ir=dump_ir,
                                               library_path=None if tgt.gpu else w.path / LIBRARY, dense=dense)
        tgt = tgt.with_dense(dense_format(mod))
        bf16 = bf16_gemm_record(mod)
        if tgt.matmul_precision == "bf16" and bf16 is None:
            raise ExportError(f"--matmul-precision bf16 multiplies bf16 dense panels; this build stores its dense "
                              f"matrices as {tgt.dense_format.value} (--dense-weights bf16, or auto on a bf16 model)")
        if tgt.gpu:
            write_gpu_build(w.path, mod, executable, names, tgt, step)
        tuning = None
        if decode_library and not tgt.gpu:
            decode, rows = build_decode(export_dir, tgt, tune, work, w.path / DECODE_LIBRARY, progress=step)
            for name in (WORKLOADS, RECORDS) if tune else ():
                shutil.copyfile(Path(work) / name, w.path / name)
            tuning = {"trials": tune, "library": DECODE_LIBRARY, "batch": 1, "seq": 1, "functions": rows}
        save_file({n: p.numpy() for n, p in zip(names, params)}, str(w.path / WEIGHTS))
        for name in (MODEL_FILE, DATA_FILE, CONFIG_FILE, EXPORT_JSON, *doc.get("tokenizer", {})):
            if (export_dir / name).is_file():
                shutil.copyfile(export_dir / name, w.path / name)
        manifest = {
            "k3compile": __version__,
            "kind": KIND,
            "target": tgt.name,
            "tvm_target": tgt.describe(),
            **({"host": cpu} if not tgt.gpu and (cpu := host_record()) else {}),  # lean.py's host check
            "entry_points": entry_points(mod),
            "versions": {"tvm": tvm.__version__, "onnx": onnx.__version__},
            "interface": GraphInterface.of(cfg).as_record(),
            "params": names,
            "dense_weights": tgt.dense_format.value,
            "dense_matrices": dense_matrices(mod),
            "expert_params": expert_weights(mod),
            **({"host_gemm": host} if (host := host_gemm_record(mod)) else {}),
            **({"matmul_precision": bf16} if bf16 else {}),
            **({"fp32_gemm": f32} if (f32 := f32_gemm_record(mod)) else {}),
            **({"tuning": tuning} if tuning else {}),
            "compile_s": round(time.perf_counter() - t0, 3),
            "files": {f.name: sha256_file(f) for f in sorted(w.path.iterdir())},
        }
        write_json(w.path / MANIFEST, manifest)
        step("renaming into place")
        w.commit()
    return manifest


def _dump_folder(path: str | Path, create: bool = True, apart_from: tuple = ()) -> Path:
    """The --dump-ir folder: created if missing; an existing one must be empty (its files are never replaced), and
    apart from OUT and the export (neither one of them, inside one, nor holding one: the IR would land in the
    artifact, or the artifact's swap would take the IR)."""
    path = Path(path)
    here = path.resolve()
    for other in map(lambda p: Path(p).resolve(), apart_from):
        if here == other or other in here.parents or here in other.parents:
            raise ExportError(f"{path}: --dump-ir must be a folder apart from OUT and the export folder ({other})")
    if path.exists() and (not path.is_dir() or any(path.iterdir())):
        raise ExportError(f"{path}: --dump-ir needs a new or empty folder")
    if not create:
        return path
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ExportError(f"{path}: cannot create it ({e.strerror or e})") from None
    return path


def write_gpu_build(folder: Path, mod, executable, names: list[str], tgt, step: Callable[[str], None]) -> None:
    """A GPU build's files in `folder` (an artifact's, or a sharded artifact's rank folder): the library (host code,
    for the record), the device source, the launch plan with the weight names it takes, and its constants."""
    from safetensors.numpy import save_file

    from k3compile.targets.gpu import device_source
    from k3compile.targets.launch_plan import launch_plan

    executable.export_library(str(folder / LIBRARY))
    (folder / f"{DEVICE_SOURCE}{tgt.source[1]}").write_text(device_source(executable, tgt.source[0]))
    step("writing the launch plan")  # what the executors run (backends/executor.py), without TVM
    plan, constants = launch_plan(mod, tgt)
    plan["main"]["weights"] = names  # the names the plan takes, as the library's signature does on llvm
    write_json(folder / LAUNCH_PLAN, plan)
    save_file(constants, str(folder / CONSTANTS))


def build(export_dir: Path, tgt: Target, progress: Callable[[str], None] | None = None,
          dump_ir: str | Path | None = None, executable: bool = True, library_path: Path | None = None,
          dense: str = "auto"):
    """An export folder (already checked) imported, lowered (passes.PHASES) and compiled for `tgt`: returns
    (module, executable, weight names, weights): the weights are main's parameters after the graph inputs, already
    put in the target's layout by running the lifted `main_transform_params` once. A GPU target with
    `executable=False` stops before TVM's code generation (the executable is then None): what the device runner
    (k3compile/devices.py) needs. With `library_path` (a CPU target), the library is exported there first and the
    executable returned is that file, loaded (library.transform_weights says why). `dense`: how the dense matrices
    are stored (`dense_target`); the module returned records it (`dense_format(mod)`)."""
    import onnx

    return build_proto(onnx.load(str(Path(export_dir) / MODEL_FILE)), tgt, progress, dump_ir, executable,
                       library_path, dense)


def build_proto(proto, tgt: Target, progress: Callable[[str], None] | None = None,
                dump_ir: str | Path | None = None, executable: bool = True, library_path: Path | None = None,
                dense: str = "auto"):
    """build() of a k3 ONNX ModelProto (an export's, or one rank's graph: k3compile/partition.py). A k3 call left
    extern after the phases (a kernel factory declined it, or none is written) is refused (`_no_extern_calls`) before
    TVM compiles anything, on every target."""
    import tvm

    from k3compile.frontend import to_relax
    from k3compile.passes import run_phases

    step = progress or (lambda msg: None)
    if tgt.matmul_precision != "fp32" and library_path is None:
        raise ExportError(f"--matmul-precision {tgt.matmul_precision} links a C kernel into a library written to "
                          "disk (compile); an in-process build cannot carry it")
    if library_path is not None:
        tgt = tgt.with_f32_gemm()  # the library links the C kernel in (export_library)
    step("importing into TVM Relax")
    mod, raw_names, raw = to_relax(proto, keep_params=True)
    tgt = dense_target(tgt, raw_names, raw, dense)
    if tgt.dense_format == "mxfp8":
        mod = dense_values(raw_names, raw, mod)
    step(f"lowering and scheduling for {tgt.describe()}")
    dump = _dump_folder(dump_ir) if dump_ir is not None else None
    if tgt.gpu:
        return _build_gpu(mod, raw, tgt, dump, step, executable)
    phased = run_phases(mod, tgt, dump_dir=dump).with_attr(DENSE_FORMAT, tgt.dense_format.value)
    # auto chose bf16 having read every 2-D fp32 matrix (dense_target): only other packed weights are left to read
    seen = {n for n, w in zip(raw_names, raw) if len(w.shape) == 2 and str(w.dtype) == "float32"} \
        if dense == "auto" else set()
    try:
        check_dense(phased, raw_names, raw, checked=seen)
    except ExportError:
        if dense != "auto":
            raise
        tgt = tgt.with_dense("fp32")  # auto: a packed weight that was not 2-D holds other values; keep fp32
        phased = run_phases(mod, tgt).with_attr(DENSE_FORMAT, tgt.dense_format.value)
    mod = phased
    if tgt.dense_format == "mxfp8" and "mxfp8" not in dense_matrices(mod):
        raise ExportError("--dense-weights mxfp8: no matrix this build multiplies by holds MXFP8 values along its "
                          "reduction dim; export with --dense-weights mxfp8")
    _no_extern_calls(mod, tgt)
    names = weight_names(mod)
    step("compiling")
    with tgt.compiling():
        executable = tvm.compile(library.with_signature(mod, names), target=tgt.tvm(),
                                 relax_pipeline=tvm.transform.Sequential(tgt.finish_passes()))
    if library_path is not None:
        export_library(executable, mod, library_path)
        executable = library.load(Path(library_path))
    step("putting the weights in the target's layout")
    return mod, executable, names, library.transform_weights(executable, raw)


def export_library(executable, mod, path: str | Path) -> None:
    """A CPU build's `executable` (of the scheduled module `mod`) written to `path`, linked with the C kernels its
    functions call (targets/bf16_gemm.c: the bf16 GEMM under --matmul-precision bf16, else the fp32 GEMM)."""
    import tempfile

    from k3compile.targets.llvm import bf16_gemm_object

    with tempfile.TemporaryDirectory() as objects:
        addons = [bf16_gemm_object(objects)] if bf16_gemm_record(mod) or f32_gemm_record(mod) else None
        executable.export_library(str(path), addons=addons)


DENSE_FORMAT = "k3.dense_format"  # module attr: the dense format a build stores (modes.DenseFormat)


def _holds_bf16(value) -> bool:
    """Every value of an fp32 array is a bf16 value (its lower 16 bits are zero): cutting it to bf16 is exact."""
    import numpy as np

    return not np.any(np.ascontiguousarray(value).view(np.uint32) & 0xFFFF)


def dense_target(tgt: Target, names: list[str], raw: list, dense: str = "auto") -> Target:
    """`tgt` storing its dense matrices as `dense` (docs/architecture.md, "Dense weights"): "fp32"; "bf16" (half the
    bytes, widened in the kernel; only for weights that hold bf16 values, checked by `check_dense`); "mxfp8" (a
    quarter, decoded in the kernel: the matrices an export quantized, `dense_values`); "auto": bf16 when every fp32
    matrix (2-D weight) holds bf16 values (a bf16 checkpoint, a preset), else fp32 (`compile_export` turns auto
    into mxfp8 for an export made so). A target without dense panels (the GPUs) keeps fp32."""
    from k3compile.modes import DENSE_CHOICES, DenseFormat

    if dense not in DENSE_CHOICES:
        raise ExportError(f"--dense-weights takes one of {', '.join(DENSE_CHOICES)}, got {dense!r}")
    if not tgt.dense_panel:
        if dense in (DenseFormat.BF16, DenseFormat.MXFP8):
            raise ExportError(f"--dense-weights {dense}: target {tgt.name!r} reads its dense weights as fp32 (its "
                              "matmul kernels have no bf16 or mxfp8 form yet); use fp32 or auto")
        return tgt.with_dense(DenseFormat.FP32)
    if dense == "auto":
        matrices = [w for w in raw if len(w.shape) == 2 and str(w.dtype) == "float32"]
        dense = DenseFormat.BF16 if matrices and all(_holds_bf16(m.numpy()) for m in matrices) else DenseFormat.FP32
    return tgt.with_dense(dense)


def dense_values(names: list[str], raw: list, *mods):
    """`mods` with the attrs an mxfp8 build's phase 2 reads (passes/pack_dense_weights.py): which 2-D fp32 weights
    hold MXFP8 values, and along which axis ("name:axis"), and which hold bf16 values (stored so when they are
    not MXFP8). Read from the values themselves (`raw`, named `names`), so an export's record is never trusted for
    it. One module in, one out; several in (main and the tuned decode step), a tuple."""
    from k3compile.passes.pack_dense_weights import BF16_WEIGHTS, MXFP8_WEIGHTS
    from k3compile.quant.dense import holds_mxfp8

    mx, bf16 = [], []
    for name, w in zip(names, raw):
        if len(w.shape) != 2 or str(w.dtype) != "float32":
            continue
        value = w.numpy()
        mx += [f"{name}:{axis}" for axis in (0, 1) if holds_mxfp8(value, axis)]
        if _holds_bf16(value):
            bf16.append(name)
    out = tuple(m.with_attr(MXFP8_WEIGHTS, mx).with_attr(BF16_WEIGHTS, bf16) for m in mods)
    return out[0] if len(out) == 1 else out


def export_dense(doc: dict, dense: str) -> str:
    """The --dense-weights a build of an export (its record `doc`) uses: auto is mxfp8 for an export quantized so
    (quant/dense.py); mxfp8 needs such an export (the values are chosen when the model is exported, where eager
    is quantized alike, not by the compiler)."""
    from k3compile.modes import DenseFormat

    held = doc.get("dense_weights", "source")
    if dense == "auto" and held == DenseFormat.MXFP8:
        return DenseFormat.MXFP8.value
    if dense == DenseFormat.MXFP8 and held != DenseFormat.MXFP8:
        raise ExportError("--dense-weights mxfp8: this export holds the source's dense weights; export it with "
                          "--dense-weights mxfp8 (the model is quantized there, so eager and verify hold the same "
                          "values)")
    return dense


def dense_matrices(mod) -> dict[str, int]:
    """How many of a built module's packed matrices each dense format stores ({} before phase 2, or on a GPU)."""
    from k3compile.passes.pack_dense_weights import PACKED

    counts: dict[str, int] = {}
    if mod.attrs is not None and PACKED in mod.attrs:
        for fmt in mod.attrs[PACKED].values():
            counts[str(fmt)] = counts.get(str(fmt), 0) + 1
    return counts


def entry_points(mod) -> list[str]:
    """The library's Relax functions by name (main, and main_inplace / main_inplace_last where
    passes/inplace_caches.py made them): what a reader may call, said without loading it (lean.eligible)."""
    from tvm import relax

    return sorted(gv.name_hint for gv, f in mod.functions_items() if isinstance(f, relax.Function))


def _kernels_with(mod, attr: str) -> int:
    """How many of a built module's PrimFuncs carry the function attribute `attr` (targets/llvm.py marks them)."""
    import tvm

    return sum(1 for _, f in mod.functions_items() if isinstance(f, tvm.tirx.PrimFunc) and f.attrs is not None
               and attr in f.attrs)


def host_gemm_record(mod) -> dict | None:
    """What a CPU build's kernels call on the host (targets/llvm.py, k3compile/host_gemm.py): the packed function,
    the row count from which they call it and how many kernels do; None when none does."""
    from k3compile.targets.llvm import HOST_GEMM, HOST_GEMM_ATTR, HOST_GEMM_ROWS

    kernels = _kernels_with(mod, HOST_GEMM_ATTR)
    return {"function": HOST_GEMM, "min_rows": HOST_GEMM_ROWS, "kernels": kernels} if kernels else None


def bf16_gemm_record(mod) -> dict | None:
    """What a `--matmul-precision bf16` build's kernels call (targets/llvm.py, targets/bf16_gemm.c, linked into the
    library): the precision, the C function, the row count from which they call it and how many kernels do; None
    when none does."""
    from k3compile.targets.llvm import BF16_GEMM, BF16_GEMM_ATTR

    kernels = _kernels_with(mod, BF16_GEMM_ATTR)
    return {"precision": "bf16", "function": BF16_GEMM, "min_rows": 1, "kernels": kernels} if kernels else None


def f32_gemm_record(mod) -> dict | None:
    """What an exact build's kernels call for its matmuls over bf16 panels (targets/llvm.py, targets/bf16_gemm.c,
    linked into the library; Target.with_f32_gemm): the C function and how many kernels do; None when none does."""
    from k3compile.targets.llvm import F32_GEMM, F32_GEMM_ATTR

    kernels = _kernels_with(mod, F32_GEMM_ATTR)
    return {"function": F32_GEMM, "kernels": kernels} if kernels else None


def dense_format(mod) -> str:
    """The dense format a built module stores ("fp32" for a module built before phase 2 or for a GPU)."""
    attrs = mod.attrs if mod.attrs is not None else {}
    return str(attrs[DENSE_FORMAT]) if DENSE_FORMAT in attrs else "fp32"


def check_dense(mod, names: list[str], raw: list, checked: set[str] = frozenset()) -> None:
    """A bf16 build's packed weights (passes/pack_dense_weights.py: PACKED) among `raw` (named `names`) hold bf16
    values, so cutting them is exact; ExportError naming the first that does not. Run on every set of weights a
    build's transform takes (a sharded rank's too); `checked`: names already found to hold bf16 values."""
    from k3compile.passes.pack_dense_weights import PACKED

    if dense_format(mod) != "bf16":
        return
    stored = mod.attrs[PACKED].items() if PACKED in mod.attrs else ()
    packed = {str(n) for n, fmt in stored if str(fmt) == "bf16"}
    for name, w in zip(names, raw):
        if name in packed and name not in checked and not _holds_bf16(w.numpy()):
            raise ExportError(f"--dense-weights bf16: weight {name} holds values bf16 cannot represent exactly; "
                              "k3compile narrows only bf16 values (a bf16 checkpoint, a preset): use fp32")


def weight_names(mod) -> list[str]:
    """main's weight parameters (after its graph inputs), each name once: the manifest's `params`."""
    main = mod["main"]
    return _unique([p.name for p in main.params[int(main.attrs["num_input"]):]])


def expert_weights(mod) -> list[str]:
    """The weights of main that its routed-expert kernels (k3_latent_moe_dispatch*) take: the manifest's
    `expert_params` (a decode token reads top-k / E of them: bench's roofline)."""
    import tvm
    from tvm import relax

    main = mod["main"]
    weights = main.params[int(main.attrs["num_input"]):]
    names = dict(zip(weights, weight_names(mod)))  # the manifest's names: a repeated binding name is suffixed there
    call_tir = tvm.ir.Op.get("relax.call_tir")
    found: list[str] = []

    def visit(expr):
        if (isinstance(expr, relax.Call) and expr.op.same_as(call_tir)
                and expr.args[0].name_hint.startswith("k3_latent_moe_dispatch")):
            found.extend(names[a] for a in expr.args[1].fields if isinstance(a, relax.Var) and a in names)

    relax.analysis.post_order_visit(main, visit)
    return found


def _build_gpu(mod, raw, tgt, dump, step, executable: bool = True):
    """build() for a GPU target: the weight transform (phase 3's `main_transform_params`) is compiled for this CPU
    and run here, `main` alone goes on through phases 4-6, the target's limits are checked on every PrimFunc
    (targets/gpu.py: check), then TVM compiles it (host code for this CPU, device source for the target). The
    executable cannot run here (no device runtime in this TVM): k3compile/devices.py runs its kernels."""
    import tvm

    from k3compile.passes import run_phases
    from k3compile.targets import gpu

    mod, transform = _split_transform(mod, tgt, dump)
    step("putting the weights in the target's layout (on this CPU)")
    weights = library.transform_weights(transform, raw)
    mod = run_phases(mod, tgt, dump_dir=dump, start="device-legalize")
    weights = narrow_weights(mod, weights)
    step(f"checking the kernels against {tgt.name}'s limits")
    _no_extern_calls(mod, tgt)
    gpu.check(mod, tgt)
    if executable:
        step("compiling")
        with tgt.compiling():
            executable = tvm.compile(mod, target=tgt.tvm(), relax_pipeline=tvm.transform.Sequential(
                tgt.finish_passes()), tir_pipeline=gpu.tir_pipeline(tgt))
    names = weight_names(mod)
    return mod, executable or None, names, weights


def narrow_weights(mod, weights: list) -> list:
    """The weights in the dtypes main takes after phase 4 (passes/device_legalize.py: an int64 or a boolean weight main
    now takes as int32 is cast, its values checked to fit)."""
    import numpy as np
    import tvm

    main = mod["main"]
    out = []
    for p, w in zip(main.params[int(main.attrs["num_input"]):], weights):
        want = str(p.ty.dtype)
        if str(w.dtype) != want:
            value = w.numpy()
            info = np.iinfo(want)
            if value.size and (value.min() < info.min or value.max() > info.max):
                raise ExportError(f"weight {p.name} holds {value.max()}, which does not fit the {want} the "
                                  "target takes")
            w = tvm.runtime.tensor(value.astype(want))
        out.append(w)
    return out


def _split_transform(mod, tgt, dump=None):
    """Phases 1-3 of a GPU build: (main alone, to go on through phases 4-5; its lifted weight transform compiled for
    this CPU)."""
    import tvm
    from tvm import relax

    from k3compile.passes import run_phases

    mod = run_phases(mod, tgt, upto="lift-weight-transforms", dump_dir=dump)
    transform = tvm.IRModule({gv: f for gv, f in mod.functions_items() if gv.name_hint == "main_transform_params"})
    mod = relax.transform.DeadCodeElimination(["main"])(tvm.IRModule(  # attrs: phase 1's declined reasons
        {gv: f for gv, f in mod.functions_items() if gv.name_hint != "main_transform_params"}, attrs=mod.attrs))
    return mod, tvm.compile(transform, target="llvm")


def gpu_weight_transform(mod, tgt: Target):
    """The compiled weight transform of an imported k3 graph's GPU build (`frontend.to_relax`'s module), without
    building it: what a sharded rank whose graph another rank built runs on its own tensors (k3compile/partition.py)."""
    return _split_transform(mod, tgt)[1]


def _no_extern_calls(mod, tgt) -> None:
    """Every k3 call must have become a kernel (docs/architecture.md, "The compile path"): one left as a call of its
    extern symbol could only run the op's in-process reference, which no written artifact carries. Refused, naming
    the op and the reason phase 1 recorded (passes/lower_k3_calls.py: `Declined`); the collectives are exempt
    (`extern_by_design`: the distributed runtime registers them). The same check for CPU and GPU targets."""
    import tvm
    from tvm import relax

    from k3compile.passes.lower_k3_calls import NO_FACTORY, declined, extern_by_design

    call_dps = tvm.ir.Op.get("relax.call_dps_packed")
    left: list[str] = []

    def visit(expr):
        if (isinstance(expr, relax.Call) and expr.op.same_as(call_dps) and isinstance(expr.args[0], relax.ExternFunc)
                and expr.args[0].global_symbol.startswith("k3.")
                and expr.args[0].global_symbol not in extern_by_design()
                and expr.args[0].global_symbol not in left):
            left.append(expr.args[0].global_symbol)

    for _, func in mod.functions_items():
        if isinstance(func, relax.Function):
            relax.analysis.post_order_visit(func, visit)
    if left:
        reasons = declined(mod)
        raise ExportError("; ".join(f"{symbol} has no {tgt.name} kernel: {'; '.join(reasons.get(symbol, [NO_FACTORY]))}"
                                    for symbol in left))


def build_decode(export_dir: Path, tgt: Target, trials: int, work_dir: str | Path, path: str | Path,
                 progress: Callable[[str], None] | None = None):
    """The decode library (k3compile/tune.py) written to `path`: the export imported with batch = seq = 1, lowered
    and scheduled like `main`, its static functions tuned when `trials` > 0; it takes main's weights, which is
    checked (the two weight transforms must be the same function). Returns (executable, tuning rows)."""
    import onnx
    import tvm
    import tvm_ffi

    from k3compile.frontend import to_relax
    from k3compile.passes import run_phases
    from k3compile.passes.legalize_fuse import legalize_fuse
    from k3compile.passes.schedule import schedule
    from k3compile.tune import decode_proto, tune_decode

    step = progress or (lambda msg: None)
    step("importing the decode step (batch = seq = 1)")
    proto = onnx.load(str(Path(export_dir) / MODEL_FILE))
    main_mod, names, raw = to_relax(proto, keep_params=True)
    mod, _, _ = to_relax(decode_proto(proto), keep_params=True)
    if tgt.dense_format == "mxfp8":  # the same matrices stored the same way as main's
        main_mod, mod = dense_values(names, raw, main_mod, mod)
    main_mod = run_phases(main_mod, tgt, upto="lift-weight-transforms")
    del proto, raw
    mod = run_phases(mod, tgt, upto="lift-weight-transforms")
    if not _same_transform(mod, main_mod, tvm_ffi.structural_equal):
        raise ExportError(f"{export_dir}: the decode step's weights are not main's; it cannot be tuned apart")
    legalized = legalize_fuse(tgt)(mod)
    mod, rows = schedule(tgt if trials else tgt.with_f32_gemm())(legalized), []  # tuned: TVM's loops (tune.py)
    if trials:
        mod, rows = tune_decode(legalized, mod, tgt, trials, work_dir, progress=step)
    _no_extern_calls(mod, tgt)
    step("compiling the decode library")
    with tgt.compiling():  # it takes main's weights: it carries main's names (library.py)
        executable = tvm.compile(library.with_signature(mod, weight_names(main_mod)), target=tgt.tvm(),
                                 relax_pipeline=tvm.transform.Sequential(tgt.finish_passes()))
    export_library(executable, mod, path)
    return executable, rows


def _same_transform(a, b, equal) -> bool:
    """Whether modules a and b lift the same weight transform: `main_transform_params` printed alike, and every
    PrimFunc it calls (phase 2's bf16 cut) the same function under the same name. A GlobalVar is a module's own
    object, so the Relax functions themselves never compare equal across modules once they call one."""
    from tvm import relax

    fa, fb = a["main_transform_params"], b["main_transform_params"]
    if fa.script() != fb.script():
        return False
    called: set[str] = set()

    def visit(expr):
        if isinstance(expr, relax.Call) and isinstance(expr.args[0] if expr.args else None, relax.GlobalVar):
            called.add(expr.args[0].name_hint)

    relax.analysis.post_order_visit(fa, visit)
    names_b = {gv.name_hint for gv in b.get_global_vars()}
    return all(n in names_b and equal(a[n], b[n]) for n in called)


def _unique(names: list[str]) -> list[str]:
    """The names, a repeated one suffixed `#2`, `#3`… (lifted weights are named after bindings, which can repeat)."""
    seen: dict[str, int] = {}
    out = []
    for n in names:
        seen[n] = seen.get(n, 0) + 1
        out.append(n if seen[n] == 1 else f"{n}#{seen[n]}")
    return out
