"""The artifact format, owned here (docs/architecture.md, "What an artifact is"): the file names of a compiled OUT,
single-device and sharded, and the readers that check a manifest (its fields, and every file's sha256) before
anything is loaded. Writers (compile.py, partition.py) take the names from here; every reader (source.py, the
backends, the sharded runtime, verify, bench, the cache) reads through here. Neither the compiler nor the model is
imported: reading an artifact costs no TVM build and no trace.

A single-device OUT (kind `tvm-executable`): `manifest.json` (target, TVM target, weight order `params`, versions,
the sha256 of every file), `config.json`, `model.so`, `weights.safetensors`, the export it came from, and on a GPU
target the device source (`device.cl`, ...), the launch plan `launch.json` and its `constants.safetensors`.
A sharded OUT (kind `tvm-sharded`): `manifest.json` (the mesh, the plan, each rank's inputs, outputs, weight order
and step schedule), `config.json`, and `rank<r>/model.so` + `rank<r>/weights.safetensors` per rank.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from k3compile.config import K3Config
from k3compile.interface import CONFIG_FILE, ExportError, read_json, sha256_file, state_names
from k3compile.sharding import RankPlan, ShardPlan, carry_names

MANIFEST = "manifest.json"
LIBRARY = "model.so"
WEIGHTS = "weights.safetensors"
DEVICE_SOURCE = "device"  # + the target's suffix: device.cl, device.wgsl, device.metal, device.cu
LAUNCH_PLAN = "launch.json"  # GPU targets: main's calls and kernels as data (targets/launch_plan.py)
CONSTANTS = "constants.safetensors"  # GPU targets: main's constant tensors the plan names
KIND = "tvm-executable"
SHARDED_KIND = "tvm-sharded"
OFFSET = "expert_offset"  # a sliced rank's graph input: the first expert of its slice
TENSOR = "tensor_index"  # a tensor-parallel rank's graph input: its place t in its tp group
_SHA256 = re.compile(r"[0-9a-f]{64}")


def rank_dir(r: int) -> str:
    return f"rank{r}"


def rank_io(cfg: K3Config, p: RankPlan, sliced: bool) -> tuple[list[str], list[str]]:
    """A rank's graph inputs and outputs: (input_ids | the carry), attention_mask, its layers' past[, the first
    expert of its slice (int64 scalar) when `sliced`][, its place in its tensor-parallel group (int64 scalar) when
    tp > 1] -> (logits | the carry on), their present. Both scalars are inputs, not constants, so that the ranks of
    a stage share one graph and one build (partition.py)."""
    a, b = p.layers
    past = [f"past.{i}.{n}" for i in range(a, b) for n in state_names(cfg, i)]
    first = ["input_ids"] if p.first else [f"carry.{n}" for n in carry_names(cfg, a)]
    last = ["logits"] if p.last else [f"carry.{n}" for n in carry_names(cfg, b)]
    scalars = [OFFSET] * sliced + [TENSOR] * (p.tp > 1)
    return [*first, "attention_mask", *past, *scalars], [*last, *(n.replace("past.", "present.", 1) for n in past)]


def loose_manifest(folder: str | Path) -> dict:
    """A folder's manifest read loosely (the readers below check it whole), or {}."""
    try:
        doc = json.loads((Path(folder) / MANIFEST).read_text())
        return doc if isinstance(doc, dict) else {}
    except (OSError, ValueError):
        return {}


def is_gpu_artifact(folder: str | Path) -> bool:
    """A single-device artifact whose manifest names a target other than llvm."""
    doc = loose_manifest(folder)
    return doc.get("kind") == KIND and doc.get("target") not in (None, "llvm")


def is_sharded(folder: str | Path) -> bool:
    """A folder whose manifest says it is `export --mesh`'s OUT."""
    return loose_manifest(folder).get("kind") == SHARDED_KIND


def check_files(folder: Path, files: dict[str, str], names, again: str = "compile again") -> None:
    """Each of `names` present in `folder` with the sha256 `files` records for it."""
    for name in names:
        path = folder / name
        if not path.is_file():
            raise ExportError(f"{path}: missing (listed in {MANIFEST})")
        if sha256_file(path) != files[name]:
            raise ExportError(f"{path}: its sha256 differs from {MANIFEST}'s (changed or corrupt; {again})")


def read_manifest(folder: str | Path) -> dict:
    """A single-device artifact's manifest, checked: its fields, and every listed file present with its recorded
    sha256."""
    folder = Path(folder)
    doc = read_json(folder / MANIFEST, f"{folder}: not a compiled artifact (no {MANIFEST}; run `k3compile compile`)")
    files = doc.get("files") if isinstance(doc, dict) else None
    if not (isinstance(doc, dict) and doc.get("kind") == KIND and isinstance(doc.get("k3compile"), str)
            and isinstance(doc.get("target"), str) and isinstance(doc.get("tvm_target"), str)
            and isinstance(files, dict)
            and isinstance(doc.get("params"), list) and all(isinstance(p, str) for p in doc["params"])
            and all(isinstance(k, str) and Path(k).name == k and isinstance(v, str) and _SHA256.fullmatch(v)
                    for k, v in files.items())
            and {LIBRARY, WEIGHTS, CONFIG_FILE} <= set(files)
            and ("host" not in doc or isinstance(doc["host"], dict))
            and ("tuning" not in doc or isinstance(doc["tuning"], dict)
                 and isinstance(doc["tuning"].get("library"), str) and doc["tuning"]["library"] in files)):
        raise ExportError(f"{folder / MANIFEST}: not a k3compile {KIND} manifest (damaged or edited; compile again)")
    check_files(folder, files, files)
    return doc


def read_sharded(folder: str | Path, rank: int | None = None) -> tuple[dict, K3Config, ShardPlan]:
    """The manifest of a sharded OUT, checked: its fields, the plan against the config, and the sha256 of every file
    (with `rank`, of config.json and that rank's files only: what a worker loads)."""
    from k3compile.config import ConfigError, read_config
    from k3compile.sharding import PlanError

    folder = Path(folder)
    doc = read_json(folder / MANIFEST, f"{folder}: not a sharded artifact (no {MANIFEST}; run `k3compile export "
                                       "--mesh`)")

    def bad(why: str) -> ExportError:
        return ExportError(f"{folder / MANIFEST}: not a k3compile {SHARDED_KIND} manifest ({why}; build it again)")

    if not isinstance(doc, dict) or doc.get("kind") != SHARDED_KIND:
        raise bad("wrong kind")
    files, ranks = doc.get("files"), doc.get("ranks")
    if not (isinstance(files, dict) and all(isinstance(k, str) and isinstance(v, str) and _SHA256.fullmatch(v)
                                            for k, v in files.items())):
        raise bad("files")
    if any(Path(k).is_absolute() or ".." in Path(k).parts for k in files):
        raise bad("a file outside the folder")
    if CONFIG_FILE not in files:
        raise bad("no config.json")
    check_files(folder, files, [CONFIG_FILE], "build it again")
    try:
        cfg = read_config(folder / CONFIG_FILE)
        plan = ShardPlan.from_record(doc.get("plan"), cfg)
    except (ConfigError, PlanError) as e:
        raise ExportError(f"{folder}: {e}") from None
    if not (isinstance(ranks, list) and len(ranks) == plan.mesh.size and all(isinstance(r, dict) for r in ranks)):
        raise bad("ranks")
    gpu = doc.get("target") not in (None, "llvm")  # its ranks run their launch plans (backends/executor.py)
    for p, entry in zip(plan.ranks(), ranks):
        inputs, outputs = rank_io(cfg, p, plan.mesh.group > 1)
        own = {"library": LIBRARY, "weights": WEIGHTS, **({"launch_plan": LAUNCH_PLAN, "constants": CONSTANTS}
                                                           if gpu else {})}
        want = {"rank": p.rank, "layers": list(p.layers), "experts": list(p.experts), "inputs": inputs,
                "outputs": outputs, "schedule": plan.schedule(p.rank, cfg),
                **{k: f"{rank_dir(p.rank)}/{name}" for k, name in own.items()}}
        if not (_same({k: entry.get(k) for k in want}, want) and isinstance(entry.get("params"), list)
                and all(isinstance(n, str) for n in entry["params"])):
            raise bad(f"rank {p.rank}'s entry does not match the plan")
        if any(entry[k] not in files for k in own):
            raise bad(f"rank {p.rank}'s files are not listed")
    # every file of the folder, or config.json and the files of the rank's own folder (all a worker reads)
    check_files(folder, files, [n for n in files if n != CONFIG_FILE and (
        rank is None or n.startswith(f"{rank_dir(rank)}/"))], "build it again")
    return doc, cfg, plan


def _same(a, b) -> bool:
    """Equal as JSON (true is not 1 here, as it is to Python's ==)."""
    return json.dumps(a, sort_keys=True) == json.dumps(b, sort_keys=True)
