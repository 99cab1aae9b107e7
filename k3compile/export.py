"""`k3compile export`: trace the PyTorch model with torch.export and write ONNX with k3 custom ops.

The graph interface (ARCHITECTURE.md): inputs `input_ids [B, T]`, `attention_mask [B, P+T]` and per layer
`past.{i}.conv_state` / `past.{i}.recurrent_state` (KDA) or `past.{i}.latent` / `past.{i}.k_rope` (MLA); outputs
`logits [B, T, V]` and the matching `present.{i}.*`. B, T and P are dynamic, so one file serves prefill (P = 0) and
decode. The three k3 ops become single `k3`-domain nodes with registered schemas and model-local function bodies of
standard ops (KDA: opset-27 LinearAttention), so onnxruntime and onnx.reference run the file as it is.

Recipe (TOOLCHAIN.md): export at opset 23 with optimize=False (the default optimizer inlines functions and folds
packed weights into int64), raise the default-domain import to the requested opset (>= 27), fold only tiny
constants, then append the function bodies. Everything is written through `artifact.ArtifactWriter` (a locked work
folder renamed into place at the end), so a failed or interrupted export never leaves a half-written OUT, and
`--overwrite` replaces only an earlier k3compile artifact (docs/architecture.md, "Writing OUT").
"""

from __future__ import annotations

import collections
import hashlib
import json
import logging
import math
import re
import time
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from k3compile import __version__
from k3compile.artifact import ArtifactError, ArtifactWriter, check_out
from k3compile.config import EXPERT_CHOICES, K3Config, load_config
from k3compile.model.cache import init_past, state_names
from k3compile.model.k3 import K3ForCausalLM
from k3compile.ops import kda_recurrence, latent_moe_dispatch, mxfp4_matmul
from k3compile.ops.onnx_body import DOMAIN, register

log = logging.getLogger(__name__)

MODEL_FILE = "model.onnx"
CONFIG_FILE = "config.json"
DATA_FILE = "model.onnx.data"
EXPORT_JSON = "export.json"
TRACE_OPSET = 23  # torch.onnx's converter cannot reach 27 itself (no RMSNormalization adapter)
MIN_OPSET = kda_recurrence.MIN_OPSET
EXTERNAL_DATA_BYTES = 256 << 20  # weights beside the model past this size (protobuf caps a file at 2 GiB)
ACTIVATIONS = {"none": "none", "mxfp8": "e4m3", "mxfp8-e5m2": "e5m2"}
# The parity run's bound: fp32 on both sides, different kernels and summation orders (ORT's LinearAttention, the
# dense MoE body); observed ~1e-6 on k3-tiny and ~3e-5 on k3-small.
DEFAULT_TOL = 1e-4


class ExportError(ValueError):
    """An export that cannot be done as asked (bad option, unwritable folder); the message says why."""


@dataclass(frozen=True)
class GraphInterface:
    """Names of the graph's inputs and outputs for one config."""

    inputs: list[str]
    outputs: list[str]

    @classmethod
    def of(cls, cfg: K3Config) -> "GraphInterface":
        past = [f"past.{i}.{n}" for i in range(cfg.num_hidden_layers) for n in state_names(cfg, i)]
        present = [p.replace("past.", "present.", 1) for p in past]
        return cls(["input_ids", "attention_mask", *past], ["logits", *present])


class GraphModule(torch.nn.Module):
    """The model with the flat signature of the graph interface."""

    def __init__(self, model: K3ForCausalLM) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids, attention_mask, *past_flat):
        past = [(past_flat[2 * i], past_flat[2 * i + 1]) for i in range(len(past_flat) // 2)]
        logits, present = self.model(input_ids, attention_mask, past)
        return (logits, *[t for state in present for t in state])


def sample_inputs(cfg: K3Config, batch: int = 2, new: int = 3, past: int = 2, seed: int = 0) -> list[torch.Tensor]:
    """Trace/verification inputs: sizes >= 2 everywhere so that torch.export keeps B, T and P symbolic."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, cfg.vocab_size, (batch, new), generator=gen)
    mask = torch.ones(batch, past + new, dtype=torch.long)
    flat: list[torch.Tensor] = [ids, mask]
    for i, state in enumerate(init_past(cfg, batch)):  # the decode-state shapes, with P = past for MLA caches
        for t in state:
            shape = (batch, past, t.shape[2]) if cfg.is_mla(i) else t.shape
            flat.append(torch.randn(shape, generator=gen) * (0.1 if t.dim() == 4 else 1.0))  # S kept small
    return flat


def _dynamic_shapes(cfg: K3Config):
    """batch, seq and past are named; the mask's length is left to torch.export, which derives past + seq."""
    batch, seq, past = torch.export.Dim("batch"), torch.export.Dim("seq"), torch.export.Dim("past")
    states = []
    for i in range(cfg.num_hidden_layers):
        d = {0: batch, 1: past} if cfg.is_mla(i) else {0: batch}
        states += [d, d]
    return {"input_ids": {0: batch, 1: seq}, "attention_mask": {0: batch, 1: torch.export.Dim.AUTO},
            "past_flat": tuple(states)}


def translation_table() -> dict:
    return {
        torch.ops.k3.kda_recurrence.default: kda_recurrence.onnx_translation,
        torch.ops.k3.latent_moe_dispatch.default: latent_moe_dispatch.onnx_translation,
        torch.ops.k3.mxfp4_matmul.default: mxfp4_matmul.onnx_translation,
    }


def register_schemas() -> None:
    for s in [kda_recurrence.onnx_schema(), mxfp4_matmul.onnx_schema(), *latent_moe_dispatch.onnx_schemas()]:
        register(s)


def function_bodies(opset: int, used: set[str]) -> list:
    """The FunctionProtos for the k3 ops the graph uses (and those their bodies call)."""
    bodies = {  # callees before callers: onnx.reference resolves a body's k3 nodes against earlier functions
        mxfp4_matmul.ONNX_NAME: lambda: mxfp4_matmul.onnx_function(opset),
        kda_recurrence.ONNX_NAME: lambda: kda_recurrence.onnx_function(opset),
        latent_moe_dispatch.ONNX_NAME: lambda: latent_moe_dispatch.onnx_function(opset, mxfp4=False),
        latent_moe_dispatch.ONNX_NAME_MXFP4: lambda: latent_moe_dispatch.onnx_function(opset, mxfp4=True),
    }
    if latent_moe_dispatch.ONNX_NAME_MXFP4 in used:
        used = used | {mxfp4_matmul.ONNX_NAME}
    return [make() for name, make in bodies.items() if name in used]


@contextmanager
def export_mode(model: K3ForCausalLM, act_quant: str):
    """Fix the forms the graph carries: absorbed MLA for every T (decode's form; one graph for all shapes) and the
    chosen activation quantization; restore the model afterwards."""
    saved = []
    for layer in model.model.layers:
        if layer.is_mla:
            saved.append((layer.self_attn, "mode", layer.self_attn.mode))
            layer.self_attn.mode = "absorbed"
        moe = getattr(layer, "block_sparse_moe", None)
        if moe is not None:
            saved.append((moe, "act_quant", moe.act_quant))
            moe.act_quant = act_quant
    try:
        yield model
    finally:
        for obj, attr, value in saved:
            setattr(obj, attr, value)


def _rename_dims(model, names: dict[str, str]) -> None:
    """Give torch's symbols (s0, s12, ...) the interface's names (batch, seq, past) in every shape."""
    pattern = re.compile(r"\b(" + "|".join(map(re.escape, names)) + r")\b") if names else None

    def fix(vi):
        for d in vi.type.tensor_type.shape.dim:
            if d.dim_param and pattern:
                d.dim_param = pattern.sub(lambda m: names[m.group(1)], d.dim_param).replace(" ", "")

    for vi in [*model.graph.input, *model.graph.output, *model.graph.value_info]:
        fix(vi)


def _dim_names(model, cfg: K3Config) -> dict[str, str]:
    inputs = {i.name: [d.dim_param for d in i.type.tensor_type.shape.dim] for i in model.graph.input}
    names = {}
    b, t = inputs["input_ids"][:2]
    if b:
        names[b] = "batch"
    if t:
        names[t] = "seq"
    total = inputs["attention_mask"][1]
    if total:
        names[total] = "past+seq"
    for i in range(cfg.num_hidden_layers):
        if cfg.is_mla(i):
            p = inputs[f"past.{i}.latent"][1]
            if p:
                names[p] = "past"
            break
    return names


@contextmanager
def _quiet_exporter():
    """torch.onnx logs warnings about optional packages (torchvision) and deprecations that are not ours."""
    import warnings

    logger = logging.getLogger("torch.onnx")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        logger.setLevel(level)


def trace_to_onnx(model: K3ForCausalLM, opset: int, act_quant: str = "none"):
    """The k3 ONNX ModelProto of a model (weights inside as initializers)."""
    import onnx
    from onnxscript import optimizer

    cfg = model.config
    check_opset(opset)
    register_schemas()
    gi = GraphInterface.of(cfg)
    with export_mode(model, act_quant), torch.no_grad(), _quiet_exporter():
        prog = torch.onnx.export(
            GraphModule(model).eval(), tuple(sample_inputs(cfg)), dynamo=True, opset_version=TRACE_OPSET,
            optimize=False, dynamic_shapes=_dynamic_shapes(cfg), input_names=gi.inputs, output_names=gi.outputs,
            custom_translation_table=translation_table(), verbose=False,
        )
    m = prog.model_proto
    m = optimizer.optimize(m, input_size_limit=64, output_size_limit=64)  # fold only tiny constants
    for imp in m.opset_import:
        if imp.domain == "":
            imp.version = opset
    if not any(imp.domain == DOMAIN for imp in m.opset_import):
        m.opset_import.append(onnx.helper.make_opsetid(DOMAIN, 1))
    used = {n.op_type for n in m.graph.node if n.domain == DOMAIN}
    del m.functions[:]
    m.functions.extend(function_bodies(opset, used))
    default = [imp for imp in m.opset_import if imp.domain == ""]
    m.ir_version = max(m.ir_version, onnx.helper.find_min_ir_version_for(default))
    _rename_dims(m, _dim_names(m, cfg))
    return m


def summarize(m) -> dict:
    """Op counts, k3 node counts (graph and inside function bodies), weight bytes by dtype."""
    import onnx

    ops = collections.Counter(f"{n.domain}.{n.op_type}" if n.domain else n.op_type for n in m.graph.node)
    k3_graph = {k.split(".", 1)[1]: v for k, v in ops.items() if k.startswith(DOMAIN + ".")}
    k3_bodies: collections.Counter = collections.Counter()
    for f in m.functions:
        k3_bodies.update(n.op_type for n in f.node if n.domain == DOMAIN)
    by_dtype: collections.Counter = collections.Counter()
    for init in m.graph.initializer:
        dtype = onnx.helper.tensor_dtype_to_np_dtype(init.data_type)
        by_dtype[onnx.TensorProto.DataType.Name(init.data_type).lower()] += int(np.prod(init.dims)) * dtype.itemsize
    return {"op_counts": dict(sorted(ops.items())), "k3_nodes": k3_graph,
            "k3_nodes_in_function_bodies": dict(k3_bodies), "functions": [f.name for f in m.functions],
            "weight_bytes": dict(by_dtype)}


def _shape(vi) -> list:
    return [d.dim_param or d.dim_value for d in vi.type.tensor_type.shape.dim]


def check_opset(opset: int) -> None:
    import onnx

    if opset < MIN_OPSET:
        raise ExportError(f"--opset {opset} is below {MIN_OPSET}, which the graph needs (the KDA recurrence's body "
                          f"is the standard opset-{MIN_OPSET} LinearAttention)")
    if opset > onnx.defs.onnx_opset_version():
        raise ExportError(f"--opset {opset} is above {onnx.defs.onnx_opset_version()}, the newest this onnx knows")


def check_options(out: str | Path, opset: int, activations: str, overwrite: bool,
                  protect: tuple[Path, ...] = ()) -> Path:
    """Fail fast, before any weight is loaded or traced, creating nothing; returns OUT's parent."""
    check_opset(opset)
    if activations not in ACTIVATIONS:
        raise ExportError(f"--activations {activations!r} is not one of {', '.join(ACTIVATIONS)}")
    try:
        return check_out(out, overwrite, protect)
    except ArtifactError as e:
        raise ExportError(str(e)) from None


def source_paths(source: dict | None) -> tuple[Path, ...]:
    """The files a source record points at (a checkpoint folder, a config.json), which OUT must never replace."""
    src = (source or {}).get("source")
    if isinstance(src, str) and src and Path(src).exists():
        return (Path(src),)
    return ()


def export(
    model: K3ForCausalLM,
    out: str | Path,
    opset: int = MIN_OPSET,
    activations: str = "none",
    source: dict | None = None,
    overwrite: bool = False,
    verify: bool = True,
    tolerance: float = DEFAULT_TOL,
    progress: Callable[[str], None] | None = None,
) -> dict:
    """Export `model` into folder `out` (model.onnx [+ model.onnx.data], config.json, export.json); returns the
    export.json document. `source` records where the weights came from (for `k3compile verify`); OUT is never
    that source. With `verify`, onnxruntime must match eager within `tolerance` (max abs, every output, prefill
    and two decode steps) or the export fails and writes nothing."""
    import onnx

    step = progress or (lambda msg: None)
    out = Path(out)
    protect = source_paths(source)
    check_options(out, opset, activations, overwrite, protect)
    if not (tolerance >= 0 and math.isfinite(tolerance)):
        raise ExportError(f"tolerance must be a finite number >= 0, got {tolerance}")
    cfg = model.config
    t0 = time.perf_counter()
    try:
        with ArtifactWriter(out, overwrite, protect) as w:
            step("tracing with torch.export")
            m = trace_to_onnx(model, opset, ACTIVATIONS[activations])
            trace_s = time.perf_counter() - t0
            tmp = w.path
            summary = summarize(m)
            weight_bytes = sum(summary["weight_bytes"].values())
            external = weight_bytes > EXTERNAL_DATA_BYTES
            step("writing model.onnx" + (" + external weights" if external else ""))
            onnx.save_model(m, str(tmp / MODEL_FILE), save_as_external_data=external, all_tensors_to_one_file=True,
                            location=DATA_FILE, size_threshold=1024)
            step("checking the ONNX model")
            onnx.checker.check_model(str(tmp / MODEL_FILE), full_check=True)
            cfg.save(tmp / CONFIG_FILE)
            gi = GraphInterface.of(cfg)
            doc = {
                "k3compile": __version__,
                "versions": _versions(),
                "source": source or {},
                "opset": opset,
                "ir_version": m.ir_version,
                "activations": activations,
                "expert_format": cfg.expert_format,
                "config_sha256": sha256_file(tmp / CONFIG_FILE),
                "inputs": {i.name: _shape(i) for i in m.graph.input},
                "outputs": {o.name: _shape(o) for o in m.graph.output},
                "interface": {"inputs": gi.inputs, "outputs": gi.outputs},
                **summary,
                "external_data": DATA_FILE if external else None,
                "file_bytes": sum(f.stat().st_size for f in tmp.iterdir()),
                "export_s": round(trace_s, 3),
            }
            (tmp / EXPORT_JSON).write_text(dump_json(doc))  # the parity run opens the folder as any reader does
            if verify:
                step("checking onnxruntime against eager")
                from k3compile.verify import compare, worst

                doc["parity"] = compare(model, tmp, activations=activations)
                bad = worst(doc["parity"])
                if not bad["max_abs"] <= tolerance:  # NaN fails too
                    raise ExportError(
                        f"onnxruntime differs from eager by {bad['max_abs']:.3g} ({bad['output']}, {bad['phase']}), "
                        f"past the tolerance {tolerance:g}; nothing was written (--no-verify skips this check)")
                (tmp / EXPORT_JSON).write_text(dump_json(doc))
            step("renaming into place")
            w.commit()
    except ArtifactError as e:
        raise ExportError(str(e)) from None
    except OSError as e:  # a full disk, a folder removed under us
        raise ExportError(f"{out}: writing failed ({e.strerror or e}); nothing was written") from None
    log.info("exported %s in %.1fs", out, time.perf_counter() - t0)
    return doc


def dump_json(doc) -> str:
    """Strict JSON (no bare NaN / Infinity, which JSON does not have): a non-finite number is an error here."""
    try:
        return json.dumps(doc, indent=2, allow_nan=False) + "\n"
    except ValueError as e:
        raise ExportError(f"non-finite number in a JSON record ({e})") from None


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _versions() -> dict:
    import onnx
    import onnxruntime
    import onnxscript

    return {"torch": torch.__version__, "onnx": onnx.__version__, "onnxscript": onnxscript.__version__,
            "onnxruntime": onnxruntime.__version__}


def _record_error(folder: Path, what: str) -> ExportError:
    return ExportError(f"{folder / EXPORT_JSON}: {what} (the record is damaged or was edited; export again)")


def _no_constant(name: str):
    raise ValueError(f"{name} is not a JSON number")


def read_export(folder: str | Path) -> dict:
    """The export record, checked field by field before anything acts on it (verify rebuilds a model from it)."""
    folder = Path(folder)
    try:
        doc = json.loads((folder / EXPORT_JSON).read_text(), parse_constant=_no_constant)
    except FileNotFoundError:
        raise ExportError(f"{folder}: not an export folder (no {EXPORT_JSON}; run `k3compile export` first)") from None
    except (OSError, ValueError, RecursionError) as e:
        raise ExportError(f"{folder / EXPORT_JSON}: unreadable ({e})") from None
    if not isinstance(doc, dict) or not isinstance(doc.get("k3compile"), str):
        raise _record_error(folder, "not a k3compile export record")
    iface = doc.get("interface")
    if not (isinstance(iface, dict) and set(iface) == {"inputs", "outputs"}
            and all(isinstance(v, list) and all(isinstance(n, str) for n in v) for v in iface.values())):
        raise _record_error(folder, "interface: expected lists of input and output names")
    if not isinstance(doc.get("activations", "none"), str) or doc.get("activations", "none") not in ACTIVATIONS:
        raise _record_error(folder, f"activations: {doc.get('activations')!r} is not one of {', '.join(ACTIVATIONS)}")
    sha = doc.get("config_sha256")
    if sha is not None and not (isinstance(sha, str) and re.fullmatch(r"[0-9a-f]{64}", sha)):
        raise _record_error(folder, "config_sha256: not a sha256 digest")
    src = doc.get("source", {})
    if not isinstance(src, dict):
        raise _record_error(folder, "source: expected an object")
    if "source" in src and not (isinstance(src["source"], str) and src["source"]):
        raise _record_error(folder, f"source.source: expected a preset name or a path, got {src['source']!r}")
    seed = src.get("seed", 0)
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**64:
        raise _record_error(folder, f"source.seed: expected an integer in 0..2^64-1, got {seed!r}")
    if not isinstance(src.get("experts", "auto"), str) or src.get("experts", "auto") not in EXPERT_CHOICES:
        raise _record_error(folder, f"source.experts: {src.get('experts')!r} is not one of {', '.join(EXPERT_CHOICES)}")
    return doc


def open_export(folder: str | Path) -> tuple[dict, K3Config]:
    """The checked record and the config of an export folder: config.json must be the one the export wrote (its
    sha256) and give the graph interface the record names."""
    folder = Path(folder)
    doc = read_export(folder)
    cfg_path = folder / CONFIG_FILE
    if not cfg_path.is_file():
        raise ExportError(f"{folder}: no {CONFIG_FILE} beside {MODEL_FILE}")
    sha = doc.get("config_sha256")
    if sha is not None and sha256_file(cfg_path) != sha:
        raise ExportError(f"{cfg_path}: changed since the export (its sha256 differs from {EXPORT_JSON}'s); "
                          "the graph was built for the original, so export again instead of editing it")
    cfg = load_config(cfg_path)
    gi = GraphInterface.of(cfg)
    if doc["interface"] != {"inputs": gi.inputs, "outputs": gi.outputs}:
        raise ExportError(f"{cfg_path}: its layers do not give the graph interface {EXPORT_JSON} records")
    return doc, cfg


def check_graph(path: Path, cfg: K3Config) -> None:
    """model.onnx must be the k3 graph of this config: the interface's input and output names, the vocabulary."""
    import onnx

    try:
        m = onnx.load(str(path), load_external_data=False)
    except Exception as e:  # protobuf's DecodeError and friends
        why = str(e).splitlines()[0][:200] if str(e) else type(e).__name__
        raise ExportError(f"{path}: cannot load it (not a readable ONNX model: {why})") from None
    gi = GraphInterface.of(cfg)
    inputs = [i.name for i in m.graph.input]
    outputs = [o.name for o in m.graph.output]
    if inputs != gi.inputs or outputs != gi.outputs:
        raise ExportError(f"{path}: its inputs/outputs ({_short_names(inputs)} -> {_short_names(outputs)}) are not "
                          f"the k3 graph interface of its config.json; not a k3compile export of this model")
    dims = _shape(m.graph.output[0])
    if len(dims) != 3 or dims[2] != cfg.vocab_size:
        raise ExportError(f"{path}: logits {dims} do not end in the config's vocab_size {cfg.vocab_size}")


def _short_names(names: list[str], n: int = 3) -> str:
    return ", ".join(names[:n]) + (f", … ({len(names)} in all)" if len(names) > n else "")
