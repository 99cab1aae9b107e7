"""The graph I/O contract, owned here once (docs/architecture.md, "The graph interface").

Every executable k3compile makes (the ONNX export; the compiled artifacts to come) has the same interface:
inputs `input_ids [B, T]`, `attention_mask [B, P+T]` and per layer i `past.{i}.conv_state [B, 3·H·K, W−1]` +
`past.{i}.recurrent_state [B, H, K, V]` (KDA) or `past.{i}.latent [B, P, kv_lora_rank]` + `past.{i}.k_rope [B, P,
qk_rope_head_dim]` (MLA); outputs `logits [B, T, V]` and the matching `present.{i}.*`. The decode state is one
(first, second) pair per layer; flat, it is the pairs in layer order (`flatten` / `unflatten`).

This module also owns the artifact file names and the export record (export.json): writing it strictly, reading it
with every field checked, and checking a folder's config.json and model.onnx against it. It imports the config,
never the model code or the exporter; torch only inside the functions that make or check torch tensors, so a reader
of artifacts runs without it (k3compile/lean.py; docs/architecture.md, "The torch-free decode").
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from k3compile.config import EXPERT_CHOICES, K3Config, read_config
from k3compile.errors import UserError
from k3compile.modes import ACT_QUANT_FLAGS, DENSE_QUANT

if TYPE_CHECKING:
    import torch
    from torch import Tensor

MODEL_FILE = "model.onnx"
DATA_FILE = "model.onnx.data"
CONFIG_FILE = "config.json"
EXPORT_JSON = "export.json"
# the tokenizer files an export carries (k3compile/tokenizer.py reads them)
TOKENIZER_JSON = "tokenizer.json"
TIKTOKEN_MODEL = "tiktoken.model"
TOKENIZER_CONFIG = "tokenizer_config.json"
CHAT_TEMPLATE = "chat_template.jinja"
TOKENIZER_FILES = (TOKENIZER_JSON, TIKTOKEN_MODEL, TOKENIZER_CONFIG, CHAT_TEMPLATE)

# The export's parity run's bound (export, verify): fp32 on both sides, different kernels and summation orders (ORT's
# LinearAttention, the dense MoE body); observed ~1e-6 on k3-tiny and ~3e-5 on k3-small.
DEFAULT_TOL = 1e-4

KDA_STATE_NAMES = ("conv_state", "recurrent_state")
MLA_STATE_NAMES = ("latent", "k_rope")

Past = list[tuple["Tensor", "Tensor"]]


class ExportError(UserError):
    """An export folder or option that cannot be used as asked; the message says why."""


class StepInputError(UserError):
    """One step's inputs that no executable of this config can take (an id outside the vocabulary, a mask that does
    not span past + new tokens, a decode state of other shapes); the message says which."""


# ---- the decode state ----------------------------------------------------------------------------------------------

def state_names(cfg: K3Config, layer: int) -> tuple[str, str]:
    return MLA_STATE_NAMES if cfg.is_mla(layer) else KDA_STATE_NAMES


def state_shapes(cfg: K3Config, batch: int, past: int = 0) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """The shapes of each layer's two decode-state tensors for `batch` rows after `past` tokens (init_past's, with the
    MLA caches `past` rows long): what check_step compares a state with, computed without making one."""
    hk = cfg.kda_num_heads * cfg.kda_head_dim
    mla = ((batch, past, cfg.kv_lora_rank), (batch, past, cfg.qk_rope_head_dim))
    kda = ((batch, 3 * hk, cfg.conv_kernel_size - 1), (batch, cfg.kda_num_heads, cfg.kda_head_dim, cfg.kda_head_dim))
    return [mla if cfg.is_mla(i) else kda for i in range(cfg.num_hidden_layers)]


def init_past(cfg: K3Config, batch: int, dtype: torch.dtype | None = None, device=None) -> Past:
    """Empty decode state: zero KDA states (the recurrent state always fp32) and zero-length MLA caches; `dtype`:
    the others' (fp32 when None)."""
    import torch

    dtype = torch.float32 if dtype is None else dtype
    return [(torch.zeros(a, dtype=dtype, device=device),
             torch.zeros(b, dtype=dtype if cfg.is_mla(i) else torch.float32, device=device))
            for i, (a, b) in enumerate(state_shapes(cfg, batch))]


def past_length(cfg: K3Config, past: Past) -> int:
    """Tokens already seen (the MLA cache length); 0 for a model with no MLA layer."""
    for i, (a, _) in enumerate(past):
        if cfg.is_mla(i):
            return a.shape[1]
    return 0


def as_input_type(x: np.ndarray, name: str, dtype: str) -> np.ndarray:
    """A host input in the integer type a compiled main takes (int32 on WebGPU: passes/device_legalize.py narrowed
    the ids, the mask and a rank's expert offset), its values and its sizes (positions run to them) checked to fit;
    any other input as it is. What the executors (backends/executor.py) and the kernel-by-kernel runner
    (backends/device.py) feed."""
    want = np.dtype(dtype)
    if x.dtype == want or x.dtype.kind not in "iub" or want.kind not in "iu":
        return x
    info = np.iinfo(want)
    if x.size and (int(x.min()) < info.min or int(x.max()) > info.max) or any(n > info.max for n in x.shape):
        raise ExportError(f"main's {name} takes {want}: an input of {x.dtype} {list(x.shape)} does not fit")
    return x.astype(want)


def check_step(cfg: K3Config, input_ids, attention_mask, past: Past) -> None:
    """Every backend's step checks its inputs first: compiled code indexes the embedding with the ids as they come
    (an id past the vocabulary reads other memory: garbage logits, or a segfault) and trusts the shapes."""
    import torch

    ids, mask = torch.as_tensor(input_ids), torch.as_tensor(attention_mask)
    if ids.dim() != 2 or ids.dtype.is_floating_point or ids.dtype.is_complex or ids.dtype == torch.bool:
        raise StepInputError(f"input_ids must be integer ids [batch, seq], got {ids.dtype} {list(ids.shape)}")
    b, t = ids.shape
    if b == 0 or t == 0:
        raise StepInputError(f"input_ids [batch, seq] must hold at least one id, got {list(ids.shape)}")
    lo, hi = (int(x) for x in torch.aminmax(ids))
    if lo < 0 or hi >= cfg.vocab_size:
        bad = lo if lo < 0 else hi
        raise StepInputError(f"token id {bad} is outside the vocabulary 0..{cfg.vocab_size - 1}")
    if len(past) != cfg.num_hidden_layers:
        raise StepInputError(f"the decode state has {len(past)} layers, the model {cfg.num_hidden_layers}")
    p = past_length(cfg, past)
    if mask.dim() != 2 or tuple(mask.shape) != (b, p + t):
        raise StepInputError(f"attention_mask must be [batch, past + seq] = [{b}, {p + t}], got {list(mask.shape)}")
    if not _zeros_and_ones(mask):
        raise StepInputError("attention_mask must hold only 0 (padding) and 1 (token)")
    for i, (got, want) in enumerate(zip(past, state_shapes(cfg, b, p))):
        for name, g, shape in zip(state_names(cfg, i), got, want):
            if tuple(g.shape) != shape:
                raise StepInputError(f"past.{i}.{name} is {list(g.shape)}, expected {list(shape)}")


def _zeros_and_ones(mask: torch.Tensor) -> bool:
    """Whether `mask` holds only 0 and 1: for integers its least and greatest value say so (one pass; a decode
    step's checks are on its critical path), for any other dtype every value is compared."""
    import torch

    if mask.dtype == torch.bool or mask.numel() == 0:
        return True
    if not (mask.dtype.is_floating_point or mask.dtype.is_complex):
        lo, hi = torch.aminmax(mask)
        return int(lo) >= 0 and int(hi) <= 1
    return bool(((mask == 0) | (mask == 1)).all())


def numpy_inputs(input_ids, attention_mask, past: Past) -> list[np.ndarray]:
    """One step's graph inputs as numpy arrays, in GraphInterface.inputs order (int64 ids and mask, fp32 state)."""
    return [np.asarray(input_ids, dtype=np.int64), np.asarray(attention_mask, dtype=np.int64),
            *(numpy_state(t) for t in flatten(past))]


def numpy_state(t) -> np.ndarray:
    """A decode-state tensor as the graph takes it: fp32 numpy on the host (shared with `t` when it already is)."""
    return t.detach().cpu().numpy().astype(np.float32, copy=False)


def flatten(past) -> list:
    """Per-layer pairs -> the flat list the graph takes: layer 0's two tensors, then layer 1's, ..."""
    return [t for state in past for t in state]


def unflatten(flat) -> list:
    """The inverse of `flatten`."""
    if len(flat) % 2:
        raise ValueError(f"a flat decode state has two tensors per layer, got {len(flat)}")
    return [(flat[2 * i], flat[2 * i + 1]) for i in range(len(flat) // 2)]


@dataclass(frozen=True)
class GraphInterface:
    """Names of the graph's inputs and outputs for one config."""

    inputs: list[str]
    outputs: list[str]

    @classmethod
    def of(cls, cfg: K3Config) -> GraphInterface:
        past = [f"past.{i}.{n}" for i in range(cfg.num_hidden_layers) for n in state_names(cfg, i)]
        present = [p.replace("past.", "present.", 1) for p in past]
        return cls(["input_ids", "attention_mask", *past], ["logits", *present])

    @property
    def past_inputs(self) -> list[str]:
        return self.inputs[2:]

    def as_record(self) -> dict:
        return {"inputs": self.inputs, "outputs": self.outputs}


# ---- the export record -----------------------------------------------------------------------------------------------

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


def write_json(path: Path, doc: dict) -> None:
    Path(path).write_text(dump_json(doc))


def write_record(folder: Path, doc: dict) -> None:
    write_json(Path(folder) / EXPORT_JSON, doc)


def _record_error(folder: Path, what: str) -> ExportError:
    return ExportError(f"{folder / EXPORT_JSON}: {what} (the record is damaged or was edited; export again)")


def _no_constant(name: str):
    raise ValueError(f"{name} is not a JSON number")


def loads(text: str):
    """json.loads without its NaN / Infinity extensions (they are not JSON): every k3compile reader uses this."""
    return json.loads(text, parse_constant=_no_constant)


def read_json(path: Path, missing: str):
    """A JSON file of ours, strictly parsed; `missing` is the error when it is not there."""
    try:
        return loads(Path(path).read_text())
    except FileNotFoundError:
        raise ExportError(missing) from None
    except (OSError, ValueError, RecursionError) as e:
        raise ExportError(f"{path}: unreadable ({e})") from None


def _choice(value, choices) -> bool:
    return isinstance(value, str) and value in choices


def read_record(folder: str | Path) -> dict:
    """The export record, checked field by field before anything acts on it (verify rebuilds a model from it)."""
    folder = Path(folder)
    doc = read_json(folder / EXPORT_JSON,
                    f"{folder}: not an export folder (no {EXPORT_JSON}; run `k3compile export` first)")
    if not isinstance(doc, dict) or not isinstance(doc.get("k3compile"), str):
        raise _record_error(folder, "not a k3compile export record")
    iface = doc.get("interface")
    if not (isinstance(iface, dict) and set(iface) == {"inputs", "outputs"}
            and all(isinstance(v, list) and all(isinstance(n, str) for n in v) for v in iface.values())):
        raise _record_error(folder, "interface: expected lists of input and output names")
    if not _choice(doc.get("activations", "none"), ACT_QUANT_FLAGS):
        raise _record_error(folder, f"activations: {doc.get('activations')!r} is not one of "
                                    f"{', '.join(ACT_QUANT_FLAGS)}")
    if not _choice(doc.get("dense_weights", "source"), DENSE_QUANT):
        raise _record_error(folder, f"dense_weights: {doc.get('dense_weights')!r} is not one of "
                                    f"{', '.join(DENSE_QUANT)}")
    tok = doc.get("tokenizer", {})
    if not (isinstance(tok, dict) and all(k in TOKENIZER_FILES and isinstance(v, str)
                                          and re.fullmatch(r"[0-9a-f]{64}", v) for k, v in tok.items())):
        raise _record_error(folder, "tokenizer: expected {tokenizer file name: sha256}")
    sha = doc.get("config_sha256")
    if sha is not None and not (isinstance(sha, str) and re.fullmatch(r"[0-9a-f]{64}", sha)):
        raise _record_error(folder, "config_sha256: not a sha256 digest")
    files = doc.get("files", [])
    if not (isinstance(files, list) and all(isinstance(f, str) and Path(f).name == f for f in files)):
        raise _record_error(folder, "files: expected a list of file names")
    src = doc.get("source", {})
    if not isinstance(src, dict):
        raise _record_error(folder, "source: expected an object")
    if "source" in src and not (isinstance(src["source"], str) and src["source"]):
        raise _record_error(folder, f"source.source: expected a preset name or a path, got {src['source']!r}")
    if "digest" in src and not (isinstance(src["digest"], str) and re.fullmatch(r"[0-9a-f]{64}", src["digest"])):
        raise _record_error(folder, "source.digest: not a sha256 digest")
    seed = src.get("seed", 0)
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**64:
        raise _record_error(folder, f"source.seed: expected an integer in 0..2^64-1, got {seed!r}")
    if not _choice(src.get("experts", "auto"), EXPERT_CHOICES):
        raise _record_error(folder, f"source.experts: {src.get('experts')!r} is not one of {', '.join(EXPERT_CHOICES)}")
    return doc


def open_export(folder: str | Path, graph: bool = False) -> tuple[dict, K3Config]:
    """The checked record and the config of an export folder: config.json must be the one the export wrote (its
    sha256) and give the graph interface the record names. With `graph` (a backend about to run it), model.onnx
    must be there and be that graph (check_graph)."""
    folder = Path(folder)
    if graph and not (folder / MODEL_FILE).is_file():
        raise ExportError(f"{folder}: not an export folder (no {MODEL_FILE}; run `k3compile export` first)")
    doc = read_record(folder)
    cfg_path = folder / CONFIG_FILE
    if not cfg_path.is_file():
        raise ExportError(f"{folder}: no {CONFIG_FILE} beside {MODEL_FILE}")
    sha = doc.get("config_sha256")
    if sha is not None and sha256_file(cfg_path) != sha:
        raise ExportError(f"{cfg_path}: changed since the export (its sha256 differs from {EXPORT_JSON}'s); "
                          "the graph was built for the original, so export again instead of editing it")
    cfg = read_config(cfg_path)
    if doc["interface"] != GraphInterface.of(cfg).as_record():
        raise ExportError(f"{cfg_path}: its layers do not give the graph interface {EXPORT_JSON} records")
    if graph:
        check_graph(folder / MODEL_FILE, cfg)
    return doc, cfg


def _dims(vi) -> list:
    return [d.dim_param or d.dim_value for d in vi.type.tensor_type.shape.dim]


def _short_names(names: list[str], n: int = 3) -> str:
    return ", ".join(names[:n]) + (f", … ({len(names)} in all)" if len(names) > n else "")


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
    dims = _dims(m.graph.output[0])
    if len(dims) != 3 or dims[2] != cfg.vocab_size:
        raise ExportError(f"{path}: logits {dims} do not end in the config's vocab_size {cfg.vocab_size}")
