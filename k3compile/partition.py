"""Partition and build for a mesh: one library and one weight file per rank (docs/architecture.md, "Sharding and the
runtime").

For each rank of the plan (sharding/plan.py) the model is assembled from that rank's tensors only (a checkpoint is
read through the state-dict adapter's `Selection`: its layer range and expert slice, nothing else), the rank's graph
is traced to ONNX with k3 ops (`RankGraph`: embedding on the first stage, the stage's layers, the head on the last;
each MoE layer's latent partial sum through `k3.AllReduce` when ep · tp > 1; with tp > 1 its share of the heads,
intermediate widths, latent MoE projections and vocabulary, sharding/tensor.py, each attention, MLP and MoE output,
each latent down projection and the embedding's lookups through `k3.AllReduce` over the tp group) and compiled by
TVM like any export. Ranks
whose graphs have the same structure (a stage's ranks with expert slices of one size: the slice's first expert and
a tp rank's place in its group are graph inputs, not constants) share one build; each still gets its own copy of
the library and its own weights.

OUT: `manifest.json` (kind tvm-sharded: the mesh, the plan, each rank's inputs, outputs, weight order and step
schedule, versions, the sha256 of every file), `config.json`, and `rank<r>/model.so` + `rank<r>/weights.safetensors`.
manifest.py (the artifact format) names the files and reads them back: `read_sharded` checks all of it (or one
rank's part) before anything is loaded.
"""

from __future__ import annotations

import hashlib
import shutil
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch import Tensor, nn

from k3compile import __version__, library
from k3compile.artifact import writing
from k3compile.config import K3Config
from k3compile.interface import (
    CONFIG_FILE,
    ExportError,
    flatten,
    sha256_file,
    unflatten,
    write_json,
)
from k3compile.manifest import CONSTANTS, DEVICE_SOURCE, LAUNCH_PLAN, LIBRARY, MANIFEST, WEIGHTS, rank_dir, rank_io
from k3compile.manifest import SHARDED_KIND as KIND
from k3compile.model.k3 import Carry, K3ForCausalLM
from k3compile.modes import Forms
from k3compile.sharding import Mesh, RankPlan, ShardPlan, carry_names, make_plan
from k3compile.sharding.plan import A2A_DISPATCH, A2A_OUTPUTS
from k3compile.sharding.tensor import rank_config

# ---- one rank's graph -----------------------------------------------------------------------------------------

class RankGraph(nn.Module):
    """One rank's step with flat tensors in and out (rank_io's order)."""

    def __init__(self, model: K3ForCausalLM, p: RankPlan, forms: Forms) -> None:
        super().__init__()
        from k3compile.model.moe import RoutedExperts

        self.model, self.p, self.forms = model, p, forms
        self.n_carry = 1 if p.first else len(carry_names(model.config, p.layers[0]))
        self._sliced = [m for m in model.modules() if isinstance(m, RoutedExperts) and m.sliced]
        self._placed = tensor_placed(model) if p.tp > 1 else []

    def forward(self, *flat: Tensor):
        # the scalars that tell ranks of one stage apart are inputs, so that they share one graph (rank_io)
        if self._placed:  # its place t in the tp group
            *flat, t = flat
            for part in self._placed:
                part.index = t
        if self._sliced:  # the slice's first expert
            *flat, offset = flat
            for experts in self._sliced:
                experts.expert_offset = offset
        n = self.n_carry
        carry = self.model.embed(flat[0]) if self.p.first else Carry(flat[0], tuple(flat[1:n]))
        carry, present = self.model.run_layers(carry, *self.p.layers, unflatten(flat[n + 1:]), flat[n], self.forms)
        out = [self.model.head(carry)] if self.p.last else [carry.hidden, *carry.bank]
        return (*out, *flatten(present))


def rank_sample(cfg: K3Config, p: RankPlan, sliced: bool, batch: int = 2, new: int = 3,
                past: int = 2) -> tuple[list, dict]:
    """Trace inputs (sizes >= 2 so that batch, seq and past stay symbolic) and their dynamic shapes."""
    from k3compile.interface import init_past

    gen = torch.Generator().manual_seed(0)
    bd, sd, pd = torch.export.Dim("batch"), torch.export.Dim("seq"), torch.export.Dim("past")
    if p.first:
        flat = [torch.randint(0, cfg.vocab_size, (batch, new), generator=gen)]
    else:
        flat = [torch.randn(batch, new, cfg.hidden_size, generator=gen) for _ in carry_names(cfg, p.layers[0])]
    shapes: list = [{0: bd, 1: sd} for _ in flat]
    flat.append(torch.ones(batch, past + new, dtype=torch.long))
    shapes.append({0: bd, 1: torch.export.Dim.AUTO})
    a, b = p.layers
    for i, state in zip(range(a, b), init_past(rank_config(cfg, p.tp), batch)[a:b]):
        for t in state:
            shape = (batch, past, t.shape[2]) if cfg.is_mla(i) else t.shape
            flat.append(torch.randn(shape, generator=gen) * (0.1 if t.dim() == 4 else 1.0))
            shapes.append({0: bd, 1: pd} if cfg.is_mla(i) else {0: bd})
    if sliced:
        flat.append(torch.tensor(p.experts[0], dtype=torch.int64))
        shapes.append({})
    if p.tp > 1:
        flat.append(torch.tensor(p.tensor, dtype=torch.int64))
        shapes.append({})
    return flat, {"flat": tuple(shapes)}


def rank_model(cfg: K3Config, state: dict[str, Tensor], p: RankPlan, sliced: bool,
               plan: ShardPlan | None = None) -> K3ForCausalLM:
    """A model holding exactly rank p's tensors (the rest of the decoder is left out): its layers, their expert
    slice (`sliced`), the embedding on the first stage, the head on the last, with tp > 1 its share of the heads,
    intermediate widths and vocabulary (`state` already cut: sharding/tensor.py). Sliced MoE layers join the other
    slices as `plan.dispatch` says: all-reduce (the default) or all-to-all (with tp > 1 each rank dispatching its
    share of its row group's slots, the shares' sums all-reduced over the tp group); split attention and MLPs sum
    over the tp group."""
    from k3compile.model.mlp import GatedMLP
    from k3compile.model.moe import RoutedExperts
    from k3compile.ops.collectives import all_reduce
    from k3compile.sharding.plan import AR_ATTENTION, AR_EMBED, AR_FFN, AR_LATENT, AR_LATENT_IN, AR_ROUTED
    from k3compile.sharding.tensor import rank_config, shared_width, vocab_slice

    rcfg = rank_config(cfg, p.tp)
    a, b = p.layers
    with torch.device("meta"):
        model = K3ForCausalLM(rcfg, p.experts if sliced else None)
        if p.tp > 1:  # its vocabulary slice of the embedding and the head
            lo, hi = vocab_slice(cfg, p.tensor, p.tp)
            model.model.embed_tokens = VocabSliceEmbedding(hi - lo, cfg.hidden_size, _Reduce(all_reduce, 0, AR_EMBED))
            model.lm_head = nn.Linear(cfg.hidden_size, hi - lo, bias=False)
        for i in range(a, b):
            moe = getattr(model.model.layers[i], "block_sparse_moe", None)
            if p.tp > 1 and moe is not None and cfg.num_shared_experts:
                moe.shared_experts = GatedMLP(rcfg, cfg.hidden_size, shared_width(cfg, p.tp))
            if p.tp > 1 and moe is not None and cfg.is_latent_moe:  # both by input columns (sharding/tensor.py)
                d, de = cfg.hidden_size // p.tp, cfg.latent_size // p.tp
                moe.routed_expert_down_proj = InputSliceLinear(d, cfg.latent_size, _Reduce(all_reduce, i,
                                                                                           AR_LATENT_IN))
                moe.routed_expert_up_proj = InputSliceLinear(de, cfg.hidden_size)
    for i in range(cfg.num_hidden_layers):
        if not a <= i < b:
            model.model.layers[i] = nn.Module()
    if not p.first:
        model.model.embed_tokens = None
    if not p.last:
        model.lm_head = model.model.norm = None
        if cfg.attn_res_block_size:
            model.model.output_attn_res_proj = model.model.output_attn_res_norm = None
    wanted = set(model.state_dict())
    missing = sorted(wanted - set(state))
    if missing:
        raise ExportError(f"rank {p.rank}: the source has no {missing[0]} (and {len(missing) - 1} more)")
    model.load_state_dict({k: v for k, v in state.items() if k in wanted}, strict=True, assign=True)
    if cfg.tie_word_embeddings and p.last:
        model.lm_head.weight = nn.Parameter(state["lm_head.weight"], requires_grad=False)
    for mod in model.modules():
        if isinstance(mod, RoutedExperts) and mod.sliced:
            mod.expert_offset = torch.tensor(p.experts[0], dtype=torch.int32)
    for i in range(a, b):
        layer = model.model.layers[i]
        moe = getattr(layer, "block_sparse_moe", None)
        if p.tp > 1:
            layer.self_attn.reduce = _Reduce(all_reduce, i, AR_ATTENTION)
            if moe is not None and cfg.is_latent_moe:  # the up projection's and shared experts' partials: one sum
                moe.out_reduce = _Reduce(all_reduce, i, AR_FFN)
            else:
                ffn = layer.mlp if moe is None else getattr(moe, "shared_experts", None)
                if ffn is not None:
                    ffn.reduce = _Reduce(all_reduce, i, AR_FFN)
        if sliced and moe is not None:
            if plan is not None and plan.dispatch == "all_to_all":
                moe.exchange = _Exchange(i, plan.slices, p.tp)
                if p.tp > 1:  # each rank of the group dispatched its share of the slots: their sum
                    moe.reduce = _Reduce(all_reduce, i, AR_ROUTED)
            else:
                moe.reduce = _Reduce(all_reduce, i, AR_LATENT)
    for part in tensor_placed(model):  # eager calls see its place; RankGraph feeds it as an input instead
        part.index = torch.tensor(p.tensor, dtype=torch.int64)
    return model.eval()


def tensor_placed(model: K3ForCausalLM) -> list:
    """The parts of a tensor-parallel rank's model whose computation depends on the rank's place t in its group
    (an `index` each: a vocabulary or column offset, the all-to-all's share of the slots)."""
    parts = [m for m in model.modules() if isinstance(m, (VocabSliceEmbedding, InputSliceLinear))]
    return parts + [m.exchange for m in model.modules() if isinstance(getattr(m, "exchange", None), _Exchange)
                    and m.exchange.tp > 1]


class VocabSliceEmbedding(nn.Module):
    """The embedding rows [t · rows, (t + 1) · rows) of tensor-parallel rank t (`index`, a scalar tensor): ids
    outside them look up zeros, and `reduce` sums the group's lookups into the whole embedding (sharding/tensor.py,
    vocab_slice)."""

    def __init__(self, rows: int, dim: int, reduce) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(rows, dim))
        self.reduce, self.index = reduce, torch.tensor(0)

    def forward(self, ids: Tensor) -> Tensor:
        local = ids - self.index * self.weight.shape[0]
        inside = (local >= 0) & (local < self.weight.shape[0])
        rows = torch.nn.functional.embedding(torch.where(inside, local, 0), self.weight)
        return self.reduce(torch.where(inside.unsqueeze(-1), rows, 0.0))


class InputSliceLinear(nn.Module):
    """Tensor-parallel rank t's share (`index`, a scalar tensor) of a linear layer split by input columns: the
    weight's columns [t · width, (t + 1) · width) applied to those columns of the input, a partial output; `reduce`
    (when set) sums it over the group (sharding/tensor.py: a latent MoE's projections). The input's width is the
    group's size times `width`."""

    def __init__(self, width: int, out: int, reduce=None) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out, width))
        self.reduce, self.index = reduce, torch.tensor(0)

    def forward(self, x: Tensor) -> Tensor:
        width = self.weight.shape[1]
        part = x.unflatten(-1, (x.shape[-1] // width, width)).index_select(-2, self.index.view(1)).squeeze(-2)
        y = nn.functional.linear(part, self.weight)
        return y if self.reduce is None else self.reduce(y)


class _Reduce:
    """A module's `reduce` in layer `tag`: the all-reduce op of that part (picklable, unlike a closure)."""

    def __init__(self, op, tag: int, part: int) -> None:
        self.op, self.tag, self.part = op, tag, part

    def __call__(self, y: Tensor) -> Tensor:
        return self.op(y, self.tag, self.part)


class _Exchange:
    """MoE.exchange of layer `tag` over an expert-parallel group holding `slices`: every token slot's latent vector,
    expert id and weight (one fp32 row: plan.A2A_PARTS) go to the rank holding that expert, in one block per
    destination with room for all of this rank's slots (static shapes, nothing dropped; slots for other ranks are
    zero, id -1); each rank runs its experts on what arrives (MoE.routed_local) and sends the weighted outputs back,
    where each token sums its slots. The runtime moves only the routed rows (runtime/worker.py, Rank._exchange).
    With tp > 1 the tp ranks of a row group share its rows: rank t (`index`, a scalar tensor) dispatches only each
    row's i-th slot for i mod tp = t (plan.slot_share), the others go nowhere (id -1), and its sum is that share's,
    which MoE.reduce sums over the group (AR_ROUTED)."""

    def __init__(self, tag: int, slices: tuple[tuple[int, int], ...], tp: int = 1) -> None:
        self.tag, self.bounds, self.group = tag, [b for _, b in slices[:-1]], len(slices)
        self.tp, self.index = tp, torch.tensor(0)

    def __call__(self, moe, z: Tensor, idx: Tensor, w: Tensor, act_quant) -> Tensor:
        from k3compile.ops.collectives import all_to_all

        n, k = idx.shape
        g, d = self.group, z.shape[-1]
        owner = (idx.unsqueeze(-1) >= torch.tensor(self.bounds, dtype=idx.dtype)).sum(-1)  # [n, k]: its rank
        hit = owner.unsqueeze(0) == torch.arange(g, dtype=owner.dtype).view(g, 1, 1)  # [g, n, k]
        if self.tp > 1:  # this rank's share of the row group's slots: a [k] mask, whatever the rows
            hit = hit & (torch.arange(k) % self.tp == self.index).view(1, 1, k)
        vectors = torch.where(hit.unsqueeze(-1), z.float().view(1, n, 1, d), 0.0)
        ids = torch.where(hit, idx.unsqueeze(0), -1).float()  # exact in fp32 below 2**24: .long() gives them back
        weights = torch.where(hit, w.float().unsqueeze(0), 0.0)
        slots = torch.cat([vectors, ids.unsqueeze(-1), weights.unsqueeze(-1)], dim=-1).reshape(g, n * k, d + 2)
        got = all_to_all(slots, self.tag, A2A_DISPATCH).reshape(g * n * k, d + 2)
        y = moe.routed_local(got[:, :d].to(z.dtype), got[:, d:d + 1].long(), got[:, d + 1:], act_quant)
        back = all_to_all(y.reshape(g, n * k, -1), self.tag, A2A_OUTPUTS)
        return back.reshape(g, n, k, -1).sum(dim=(0, 2))


# ---- the rank's tensors -----------------------------------------------------------------------------------------

class RankSource:
    """Where ranks get their tensors: a checkpoint folder (each rank reads its selection from the files) or a preset
    / config (the seeded model, built once, sliced per rank)."""

    def __init__(self, source: str, seed: int, experts: str) -> None:
        from k3compile.source import CHECKPOINT, kind_of

        self.source, self.seed, self.experts = source, seed, experts
        self.checkpoint = kind_of(source) == CHECKPOINT
        if self.checkpoint:  # names and the stored expert format from the files' headers; no tensor read yet
            from k3compile.checkpoint import _files, _scan
            from k3compile.config import read_config
            from k3compile.model.state_dict_adapter import detect_expert_format

            self.config = read_config(source)
            stored = detect_expert_format(_scan(_files(Path(source)))) or self.config.expert_format
            self.config = self.config.replace(expert_format=stored)
            self._fmt = stored if experts == "auto" else experts
        else:
            from k3compile.model.state_dict_adapter import to_checkpoint
            from k3compile.source import load_model

            model = load_model(source, seed=seed, experts=experts)
            self.config, self._fmt = model.config, model.config.expert_format
            self._tensors = to_checkpoint(model.state_dict(), self.config, "kimi_linear")  # once, not per rank

    def rank_config(self) -> K3Config:
        return self.config.replace(expert_format=self._fmt)

    def state(self, cfg: K3Config, p: RankPlan, plan: ShardPlan) -> dict[str, Tensor]:
        from k3compile.model.state_dict_adapter import Selection, convert_experts, from_checkpoint
        from k3compile.sharding.tensor import tp_slice

        select = Selection(p.layers if plan.mesh.pp > 1 else None, p.experts if plan.mesh.group > 1 else None)
        if not self.checkpoint:
            state = from_checkpoint({k: v for k, v in self._tensors.items() if select.keeps(k, cfg)}, cfg,
                                    "kimi_linear")
        else:
            from k3compile.checkpoint import load_state

            stored, state, _ = load_state(self.source, select=select)
            if stored.expert_format != self._fmt:
                state = convert_experts(state, self._fmt, torch.float32)
        return tp_slice(cfg, state, p.tensor, p.tp)  # its share of the heads and widths (tp > 1)


# ---- building -----------------------------------------------------------------------------------------------------

def structure_key(proto) -> str:
    """The graph without the weights' values: equal keys compile to the same library."""
    import onnx

    m = onnx.ModelProto()
    m.CopyFrom(proto)
    for t in m.graph.initializer:
        for field in ("raw_data", "float_data", "int32_data", "int64_data", "double_data", "uint64_data"):
            t.ClearField(field)
    return hashlib.sha256(m.SerializeToString(deterministic=True)).hexdigest()


def swap_weights(proto, state: dict[str, Tensor]):
    """A copy of a rank's traced graph holding another rank's tensors of the same stage and slice size (only the
    routed experts differ), or None where the graph's initializers do not map one to one onto those tensors."""
    import onnx
    from onnx import numpy_helper

    m = onnx.ModelProto()
    m.CopyFrom(proto)
    inits = {t.name: t for t in m.graph.initializer}
    for key, t in state.items():
        init = inits.get("model." + key)
        if init is None:
            if ".experts." in key:
                return None
            continue
        new = numpy_helper.from_array(t.detach().numpy(), init.name)
        if list(new.dims) != list(init.dims) or new.data_type != init.data_type:
            return None
        if ".experts." in key:
            init.CopyFrom(new)
        elif new.raw_data != init.raw_data and numpy_helper.to_array(init).tobytes() != t.numpy().tobytes():
            return None  # a replicated tensor that differs: this is not the same stage's graph
    return m


def check_mesh_target(tgt) -> None:
    """A mesh's ranks run in TVM's VM (llvm) or on a device executor (backends/executor.py), their collectives
    staged through host memory over gloo; other GPU targets (a k3compile.targets.Target) have no executor to run a
    rank yet."""
    from k3compile.backends.executor import DRIVERS

    if tgt.gpu and tgt.name not in DRIVERS:
        raise ExportError(f"--mesh with target {tgt.name!r}: no executor runs its ranks here (GPU ranks: "
                          f"{', '.join(DRIVERS)}; or llvm)")


def export_sharded(source: str, out: str | Path, mesh: Mesh, target="llvm", seed: int = 0,
                   experts: str = "auto", activations: str = "none", opset: int = 27, overwrite: bool = False,
                   progress: Callable[[str], None] | None = None, dispatch: str = "all_reduce") -> dict:
    """Build OUT for `mesh` from SOURCE (a preset, config.json or checkpoint folder); returns the manifest."""
    import tvm
    from safetensors.numpy import save_file

    from k3compile.compile import (
        build_proto,
        check_dense,
        dense_format,
        gpu_weight_transform,
        narrow_weights,
        write_gpu_build,
    )
    from k3compile.export import ACTIVATIONS, carry_tokenizer, check_format, source_paths, trace_graph
    from k3compile.frontend import to_relax
    from k3compile.ops import register_tvm_references
    from k3compile.source import record
    from k3compile.targets import host_record, resolve

    step = progress or (lambda msg: None)
    tgt = resolve(target)  # a Target, or its name
    check_mesh_target(tgt)
    # a rank whose graph another rank built copies these of its folder
    built_files = ([LIBRARY, f"{DEVICE_SOURCE}{tgt.source[1]}", LAUNCH_PLAN, CONSTANTS] if tgt.gpu else [LIBRARY])
    register_tvm_references()  # the VM resolves every extern a graph calls (k3.all_reduce) when it is created
    check_format(opset, activations)
    rec = record(source, seed, experts)
    t0 = time.perf_counter()
    src = RankSource(source, seed, experts)
    cfg = src.rank_config()
    plan = make_plan(cfg, mesh, dispatch)
    forms = Forms.exported(ACTIVATIONS[activations])
    builds: dict[str, tuple] = {}  # structure key -> (rank built, executable, weight names)
    traced: dict[tuple, object] = {}  # (stage, slice size) -> a traced graph of that shape
    ranks = []
    sliced = mesh.group > 1
    with writing(out, ExportError, overwrite, source_paths(rec)) as w:
        files: dict[str, str] = {}
        for p in plan.ranks():
            tag = f"rank {p.rank}/{mesh.size}"
            step(f"{tag}: reading its tensors")
            state = src.state(cfg, p, plan)
            inputs, outputs = rank_io(cfg, p, sliced)
            shape_key = (p.stage, p.experts[1] - p.experts[0], p.tensor)
            proto = swap_weights(traced[shape_key], state) if shape_key in traced else None
            if proto is None:
                model = rank_model(cfg, state, p, sliced, plan)
                sample, shapes = rank_sample(cfg, p, sliced)
                latent = next((n for n in inputs if n.endswith(".latent")), None)
                step(f"{tag}: tracing layers [{p.layers[0]}, {p.layers[1]}), experts [{p.experts[0]}, "
                     f"{p.experts[1]})")
                proto = trace_graph(RankGraph(model, p, forms), sample, shapes, inputs, outputs, opset, latent)
                traced[shape_key] = proto
                del model
            del state
            key = structure_key(proto)
            folder = w.path / rank_dir(p.rank)
            folder.mkdir()
            if key in builds:  # the same build: its files copied, its weight transform run on this rank's tensors
                built_by, loaded, names, built = builds[key]
                step(f"{tag}: same graph as rank {built_by}; its weights through that build's transform")
                for name in built_files:
                    shutil.copyfile(w.path / rank_dir(built_by) / name, folder / name)
                mod, raw_names, raw = to_relax(proto, keep_params=True)
                check_dense(built, raw_names, raw)  # a bf16 build cuts this rank's matrices too: they must be bf16
                if loaded is None:  # a GPU build: its weight transform compiled once, for the ranks that copy it
                    loaded = gpu_weight_transform(mod, tgt)
                    builds[key] = (built_by, loaded, names, built)
                weights = library.transform_weights(loaded, raw)
                if tgt.gpu:  # in the types the built graph takes (passes/device_legalize.py)
                    weights = narrow_weights(built, weights)
            else:
                mod, loaded, names, weights = build_proto(proto, tgt, progress=lambda m, t=tag: step(
                    f"{t}: {m}"), library_path=None if tgt.gpu else folder / LIBRARY)
                if tgt.gpu:  # the rank's launch plan and kernels (backends/executor.py runs them)
                    write_gpu_build(folder, mod, loaded, names, tgt, lambda m, t=tag: step(f"{t}: {m}"))
                    loaded = None
                builds[key] = (p.rank, loaded, names, mod)
                built_by = p.rank
            save_file({n: t.numpy() for n, t in zip(names, weights)}, str(folder / WEIGHTS))
            del weights, proto
            ranks.append({"rank": p.rank, "replica": p.replica, "stage": p.stage, "shard": p.shard,
                          **({"tensor": p.tensor} if p.tp > 1 else {}),
                          "layers": list(p.layers), "experts": list(p.experts), "inputs": inputs,
                          "outputs": outputs, "params": names, "built_with": built_by,
                          "library": f"{rank_dir(p.rank)}/{LIBRARY}", "weights": f"{rank_dir(p.rank)}/{WEIGHTS}",
                          **({"launch_plan": f"{rank_dir(p.rank)}/{LAUNCH_PLAN}",
                              "constants": f"{rank_dir(p.rank)}/{CONSTANTS}"} if tgt.gpu else {}),
                          "schedule": plan.schedule(p.rank, cfg)})
        cfg.save(w.path / CONFIG_FILE)
        tokenizer = carry_tokenizer(rec, cfg, w.path)  # what `serve OUT` reads (hashed with every file below)
        for f in sorted(w.path.rglob("*")):
            if f.is_file():
                files[f.relative_to(w.path).as_posix()] = sha256_file(f)
        manifest = {
            "k3compile": __version__, "kind": KIND, "target": tgt.name, "tvm_target": tgt.describe(),
            "versions": {"tvm": tvm.__version__, "torch": torch.__version__}, "source": rec,
            "activations": activations, "expert_format": cfg.expert_format, "opset": opset,
            "dense_weights": dense_format(next(iter(builds.values()))[3]),
            "plan": plan.as_record(), "ranks": ranks, "builds": len(builds),
            **({"host": cpu} if not tgt.gpu and (cpu := host_record()) else {}),  # each CPU rank's host check
            **({"tokenizer": tokenizer} if tokenizer else {}),
            "build_s": round(time.perf_counter() - t0, 3), "files": files,
        }
        write_json(w.path / MANIFEST, manifest)
        step("renaming into place")
        w.commit()
    return manifest


def compile_sharded(export_dir: str | Path, out: str | Path, mesh: Mesh, target="llvm",
                    overwrite: bool = False, progress: Callable[[str], None] | None = None,
                    dispatch: str = "all_reduce") -> dict:
    """`compile EXPORT --mesh`: an export sharded. The ranks are traced again from the source the export records (a
    rank's graph is not a cut of the whole graph's ONNX), with its seed, expert format, activations and opset; a
    checkpoint source must still hold what it held at the export (its content digest), or the sharded build would
    carry other weights than the export it says it comes from."""
    from k3compile.interface import open_export
    from k3compile.source import PRESET, check_unchanged, kind_of

    doc, _ = open_export(export_dir)
    src = doc.get("source") or {}
    source = src.get("source")
    if not isinstance(source, str) or not (kind_of(source) == PRESET or Path(source).exists()):
        raise ExportError(f"{export_dir}: its export.json records no source that exists here ({source!r}); export "
                          "the source with --mesh instead")
    check_unchanged(src, f"the export {export_dir}")
    return export_sharded(source, out, mesh, target, seed=int(src.get("seed", 0)), experts=src.get("experts", "auto"),
                          activations=doc["activations"], opset=doc["opset"], overwrite=overwrite, progress=progress,
                          dispatch=dispatch)
