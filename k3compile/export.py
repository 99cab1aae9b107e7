"""`k3compile export`: trace the PyTorch model with torch.export and write ONNX with k3 custom ops.

The graph interface (ARCHITECTURE.md): inputs `input_ids [B, T]`, `attention_mask [B, P+T]` and per layer
`past.{i}.conv_state` / `past.{i}.recurrent_state` (KDA) or `past.{i}.latent` / `past.{i}.k_rope` (MLA); outputs
`logits [B, T, V]` and the matching `present.{i}.*`. B, T and P are dynamic, so one file serves prefill (P = 0) and
decode. The three k3 ops become single `k3`-domain nodes with registered schemas and model-local function bodies of
standard ops (KDA: opset-27 LinearAttention), so onnxruntime and onnx.reference run the file as it is.

Recipe (TOOLCHAIN.md): export at opset 23 with optimize=False (the default optimizer inlines functions and folds
packed weights into int64), raise the default-domain import to the requested opset (>= 27), fold only tiny
constants, then append the function bodies. Everything is written into a temporary folder renamed into place at
the end, so a failed export never leaves a half-written OUT.
"""

from __future__ import annotations

import collections
import json
import logging
import os
import re
import shutil
import tempfile
import time
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from k3compile import __version__
from k3compile.config import K3Config
from k3compile.model.cache import init_past, state_names
from k3compile.model.k3 import K3ForCausalLM
from k3compile.ops import kda_recurrence, latent_moe_dispatch, mxfp4_matmul
from k3compile.ops.onnx_body import DOMAIN, register

log = logging.getLogger(__name__)

MODEL_FILE = "model.onnx"
DATA_FILE = "model.onnx.data"
EXPORT_JSON = "export.json"
TRACE_OPSET = 23  # torch.onnx's converter cannot reach 27 itself (no RMSNormalization adapter)
MIN_OPSET = kda_recurrence.MIN_OPSET
EXTERNAL_DATA_BYTES = 256 << 20  # weights beside the model past this size (protobuf caps a file at 2 GiB)
ACTIVATIONS = {"none": "none", "mxfp8": "e4m3", "mxfp8-e5m2": "e5m2"}


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


def _writable_parent(out: Path) -> Path:
    parent = out.resolve().parent
    for p in (parent, *parent.parents):
        if p.exists() and not p.is_dir():
            raise ExportError(f"{out}: {p} is not a folder")
    try:
        parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ExportError(f"{out}: cannot create {parent} ({e.strerror})") from None
    if not os.access(parent, os.W_OK | os.X_OK):
        raise ExportError(f"{out}: cannot write into {parent}")
    return parent


def check_opset(opset: int) -> None:
    import onnx

    if opset < MIN_OPSET:
        raise ExportError(f"--opset {opset} is below {MIN_OPSET}, which the graph needs (the KDA recurrence's body "
                          f"is the standard opset-{MIN_OPSET} LinearAttention)")
    if opset > onnx.defs.onnx_opset_version():
        raise ExportError(f"--opset {opset} is above {onnx.defs.onnx_opset_version()}, the newest this onnx knows")


def check_options(out: Path, opset: int, activations: str, overwrite: bool) -> Path:
    """Fail fast, before any weight is loaded or traced; returns OUT's (writable) parent."""
    check_opset(opset)
    if activations not in ACTIVATIONS:
        raise ExportError(f"--activations {activations!r} is not one of {', '.join(ACTIVATIONS)}")
    if out.exists() and not (out.is_dir() and (overwrite or not any(out.iterdir()))):
        raise ExportError(f"{out} exists and is not empty (pass --overwrite to replace it)")
    return _writable_parent(out)


def export(
    model: K3ForCausalLM,
    out: str | Path,
    opset: int = MIN_OPSET,
    activations: str = "none",
    source: dict | None = None,
    overwrite: bool = False,
    verify: bool = True,
    progress: Callable[[str], None] | None = None,
) -> dict:
    """Export `model` into folder `out` (model.onnx [+ model.onnx.data], config.json, export.json); returns the
    export.json document. `source` records where the weights came from (for `k3compile verify`)."""
    import onnx

    step = progress or (lambda msg: None)
    out = Path(out)
    parent = check_options(out, opset, activations, overwrite)
    cfg = model.config
    t0 = time.perf_counter()
    step("tracing with torch.export")
    m = trace_to_onnx(model, opset, ACTIVATIONS[activations])
    trace_s = time.perf_counter() - t0
    step("checking the ONNX model")
    try:
        tmp = Path(tempfile.mkdtemp(prefix=".k3export-", dir=parent))
    except OSError as e:
        raise ExportError(f"{out}: cannot write into {parent} ({e.strerror})") from None
    try:
        summary = summarize(m)
        weight_bytes = sum(summary["weight_bytes"].values())
        external = weight_bytes > EXTERNAL_DATA_BYTES
        step("writing model.onnx" + (" + external weights" if external else ""))
        onnx.save_model(m, str(tmp / MODEL_FILE), save_as_external_data=external, all_tensors_to_one_file=True,
                        location=DATA_FILE, size_threshold=1024)
        onnx.checker.check_model(str(tmp / MODEL_FILE), full_check=True)
        cfg.save(tmp / "config.json")
        gi = GraphInterface.of(cfg)
        doc = {
            "k3compile": __version__,
            "versions": _versions(),
            "source": source or {},
            "opset": opset,
            "ir_version": m.ir_version,
            "activations": activations,
            "expert_format": cfg.expert_format,
            "inputs": {i.name: _shape(i) for i in m.graph.input},
            "outputs": {o.name: _shape(o) for o in m.graph.output},
            "interface": {"inputs": gi.inputs, "outputs": gi.outputs},
            **summary,
            "external_data": DATA_FILE if external else None,
            "file_bytes": sum(f.stat().st_size for f in tmp.iterdir()),
            "export_s": round(trace_s, 3),
        }
        if verify:
            step("checking onnxruntime against eager")
            from k3compile.verify import compare

            doc["parity"] = compare(model, tmp, activations=activations)
        (tmp / EXPORT_JSON).write_text(json.dumps(doc, indent=2) + "\n")
        _default_permissions(tmp)
        if out.exists():
            shutil.rmtree(out)
        tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    log.info("exported %s in %.1fs", out, time.perf_counter() - t0)
    return doc


def _default_permissions(folder: Path) -> None:
    """mkdtemp makes a 0700 folder and onnx writes external data 0600: give OUT the usual umask permissions."""
    umask = os.umask(0)
    os.umask(umask)
    folder.chmod(0o777 & ~umask)
    for f in folder.iterdir():
        f.chmod(0o666 & ~umask)


def _versions() -> dict:
    import onnx
    import onnxruntime
    import onnxscript

    return {"torch": torch.__version__, "onnx": onnx.__version__, "onnxscript": onnxscript.__version__,
            "onnxruntime": onnxruntime.__version__}


def read_export(folder: str | Path) -> dict:
    folder = Path(folder)
    try:
        return json.loads((folder / EXPORT_JSON).read_text())
    except FileNotFoundError:
        raise ExportError(f"{folder}: not an export folder (no {EXPORT_JSON}; run `k3compile export` first)") from None
    except (OSError, ValueError) as e:
        raise ExportError(f"{folder / EXPORT_JSON}: unreadable ({e})") from None
