"""`k3compile export`: trace the PyTorch model with torch.export and write ONNX with k3 custom ops.

The graph interface is interface.py's: inputs `input_ids [B, T]`, `attention_mask [B, P+T]` and the decode state
per layer, outputs `logits [B, T, V]` and the next state. B, T and P are dynamic, so one file serves prefill
(P = 0) and decode. The k3 ops (the ops.SPECS registry) become single `k3`-domain nodes with registered schemas and
model-local function bodies of standard ops (KDA: opset-27 LinearAttention), so onnxruntime and onnx.reference run
the file as it is.

Recipe (docs/toolchain.md): export at opset 23 with optimize=False (the default optimizer inlines functions and folds
packed weights into int64), raise the default-domain import to the requested opset (>= 27), fold only tiny
constants, then append the function bodies. Everything is written through `artifact.ArtifactWriter` (a locked work
folder renamed into place at the end), so a failed or interrupted export never leaves a half-written OUT, and
`--overwrite` replaces only an earlier k3compile artifact (docs/architecture.md, "Writing OUT"). The parity run that
gates an export is handed in as a callback (pipeline.py), so this module never imports a backend or verify.
"""

from __future__ import annotations

import collections
import logging
import math
import re
import time
from collections.abc import Callable
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import torch

from k3compile import __version__
from k3compile.artifact import ArtifactError, check_out, writing
from k3compile.config import K3Config
from k3compile.interface import (
    CONFIG_FILE,
    DATA_FILE,
    DEFAULT_TOL,
    EXPORT_JSON,
    MODEL_FILE,
    ExportError,
    GraphInterface,
    flatten,
    init_past,
    sha256_file,
    unflatten,
    write_record,
)
from k3compile.model.k3 import K3ForCausalLM
from k3compile.modes import ACT_QUANT_FLAGS, DENSE_QUANT, Forms
from k3compile.ops import function_bodies, kda_recurrence, register_schemas, translation_table
from k3compile.ops.onnx_body import DOMAIN

log = logging.getLogger(__name__)

TRACE_OPSET = 23  # torch.onnx's converter cannot reach 27 itself (no RMSNormalization adapter)
MIN_OPSET = kda_recurrence.MIN_OPSET
EXTERNAL_DATA_BYTES = 256 << 20  # weights beside the model past this size (protobuf caps a file at 2 GiB)
ACTIVATIONS = ACT_QUANT_FLAGS  # --activations spelling -> modes.ActQuant


class GraphModule(torch.nn.Module):
    """The model with the flat signature of the graph interface, in the forms the graph carries."""

    def __init__(self, model: K3ForCausalLM, forms: Forms) -> None:
        super().__init__()
        self.model = model
        self.forms = forms

    def forward(self, input_ids, attention_mask, *past_flat):
        logits, present = self.model(input_ids, attention_mask, unflatten(past_flat), forms=self.forms)
        return (logits, *flatten(present))


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


def _rename_dims(model, names: dict[str, str]) -> None:
    """Give torch's symbols (s0, s12, ...) the interface's names (batch, seq, past) in every shape."""
    pattern = re.compile(r"\b(" + "|".join(map(re.escape, names)) + r")\b") if names else None

    def fix(vi):
        for d in vi.type.tensor_type.shape.dim:
            if d.dim_param and pattern:
                d.dim_param = pattern.sub(lambda m: names[m.group(1)], d.dim_param).replace(" ", "")

    for vi in [*model.graph.input, *model.graph.output, *model.graph.value_info]:
        fix(vi)


def _dim_names(model, first: str, latent: str | None) -> dict[str, str]:
    """torch's symbols -> batch and seq (axes 0, 1 of input `first`), past+seq (the mask's axis 1; `total` in a
    graph without an MLA cache) and past (axis 1 of the MLA cache input `latent`)."""
    inputs = {i.name: [d.dim_param for d in i.type.tensor_type.shape.dim] for i in model.graph.input}
    names = {}
    b, t = inputs[first][:2]
    if b:
        names[b] = "batch"
    if t:
        names[t] = "seq"
    total = inputs["attention_mask"][1]
    if total:  # without an MLA cache input no `past` symbol exists to spell it with
        names[total] = "past+seq" if latent is not None else "total"
    if latent is not None and inputs[latent][1]:
        names[inputs[latent][1]] = "past"
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
    """The k3 ONNX ModelProto of a model (weights inside as initializers), in the exported forms (absorbed MLA) with
    `act_quant` (a modes.ActQuant value: none, e4m3, e5m2)."""
    cfg = model.config
    gi = GraphInterface.of(cfg)
    latent = next((f"past.{i}.latent" for i in range(cfg.num_hidden_layers) if cfg.is_mla(i)), None)
    return trace_graph(GraphModule(model, Forms.exported(act_quant)).eval(), sample_inputs(cfg), _dynamic_shapes(cfg),
                       gi.inputs, gi.outputs, opset, latent)


def trace_graph(module: torch.nn.Module, sample: list[torch.Tensor], dynamic_shapes: dict, inputs: list[str],
                outputs: list[str], opset: int, latent: str | None):
    """The k3 ONNX ModelProto of `module(*sample)` (flat tensors in and out, named `inputs` / `outputs`; the first
    input's axes 0 and 1 are batch and seq, the MLA cache input `latent` has the past axis): the recipe of this
    module's docstring. The whole model's graph and a rank's (k3compile/partition.py) are both traced here."""
    import onnx
    from onnxscript import optimizer

    check_opset(opset)
    register_schemas()
    with torch.no_grad(), _quiet_exporter():
        prog = torch.onnx.export(
            module, tuple(sample), dynamo=True, opset_version=TRACE_OPSET, optimize=False,
            dynamic_shapes=dynamic_shapes, input_names=inputs, output_names=outputs,
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
    _rename_dims(m, _dim_names(m, inputs[0], latent))
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


def check_format(opset: int, activations: str, dense_weights: str = "source") -> None:
    check_opset(opset)
    if activations not in ACTIVATIONS:
        raise ExportError(f"--activations {activations!r} is not one of {', '.join(ACTIVATIONS)}")
    if dense_weights not in DENSE_QUANT:
        raise ExportError(f"dense weights {dense_weights!r}: an export holds one of {', '.join(DENSE_QUANT)}")


def check_options(out: str | Path, opset: int, activations: str, overwrite: bool,
                  protect: tuple[Path, ...] = ()) -> Path:
    """Fail fast, before any weight is loaded or traced, creating nothing; returns OUT's parent."""
    check_format(opset, activations)
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
    check: Callable[[Path], list[dict]] | None = None,
    tolerance: float = DEFAULT_TOL,
    progress: Callable[[str], None] | None = None,
    dense_weights: str = "source",
) -> dict:
    """Export `model` into folder `out` (model.onnx [+ model.onnx.data], config.json, export.json); returns the
    export.json document. `source` records where the weights came from (for `k3compile verify`); OUT is never
    that source. `check(folder)` runs on the finished folder before it is renamed into place and returns parity
    rows (phase, output, max_abs, max_rel); past `tolerance` (or on NaN) the export fails and writes nothing.
    `pipeline.export_checked` passes onnxruntime-vs-eager as the check. `dense_weights` is recorded: what the
    model's dense matrices hold ("source", or "mxfp8" for a model `quant.dense.with_dense_weights` quantized)."""
    import onnx

    step = progress or (lambda msg: None)
    out = Path(out)
    protect = source_paths(source)
    check_format(opset, activations, dense_weights)  # OUT is checked by the writer, before anything is traced
    if not (tolerance >= 0 and math.isfinite(tolerance)):
        raise ExportError(f"tolerance must be a finite number >= 0, got {tolerance}")
    cfg = model.config
    t0 = time.perf_counter()
    with writing(out, ExportError, overwrite, protect) as w:
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
        tokenizer = carry_tokenizer(source, cfg, tmp)
        gi = GraphInterface.of(cfg)
        doc = {
            "k3compile": __version__,
            "versions": _versions(),
            "source": source or {},
            "opset": opset,
            "ir_version": m.ir_version,
            "activations": activations,
            "dense_weights": dense_weights,
            **({"tokenizer": tokenizer} if tokenizer else {}),
            "expert_format": cfg.expert_format,
            "config_sha256": sha256_file(tmp / CONFIG_FILE),
            "inputs": {i.name: _shape(i) for i in m.graph.input},
            "outputs": {o.name: _shape(o) for o in m.graph.output},
            "interface": gi.as_record(),
            **summary,
            "external_data": DATA_FILE if external else None,
            "file_bytes": sum(f.stat().st_size for f in tmp.iterdir()),
            "files": sorted({f.name for f in tmp.iterdir()} | {EXPORT_JSON}),  # what --overwrite may replace
            "export_s": round(trace_s, 3),
        }
        write_record(tmp, doc)  # the parity run opens the folder as any reader does
        if check is not None:
            step("checking onnxruntime against eager")
            doc["parity"] = check(tmp)
            failed = [r for r in doc["parity"] if not r["max_abs"] <= tolerance]  # a NaN row fails too
            if failed:
                bad = max(failed, key=lambda r: (math.isnan(r["max_abs"]), r["max_abs"]))
                raise ExportError(
                    f"onnxruntime differs from eager by {bad['max_abs']:.3g} ({bad['output']}, {bad['phase']}), "
                    f"past the tolerance {tolerance:g}; nothing was written (--no-verify skips this check)")
            write_record(tmp, doc)
        step("renaming into place")
        w.commit()
    log.info("exported %s in %.1fs", out, time.perf_counter() - t0)
    return doc


def carry_tokenizer(source: dict | None, cfg: K3Config, folder: Path) -> dict:
    """The source's tokenizer files (k3compile/tokenizer.py) written into the export: {file name: sha256} for the
    record, {} when the source ships none (or no source is recorded)."""
    from k3compile.source import tokenizer_for

    origin = (source or {}).get("source")
    tok = tokenizer_for(origin, cfg) if origin else None
    if tok is None:
        return {}
    return {name: sha256_file(folder / name) for name in tok.save(folder)}


def _versions() -> dict:
    import onnx
    import onnxruntime
    import onnxscript

    return {"torch": torch.__version__, "onnx": onnx.__version__, "onnxscript": onnxscript.__version__,
            "onnxruntime": onnxruntime.__version__}
