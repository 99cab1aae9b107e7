"""The device mesh and the declarative shard plan (docs/architecture.md, "Sharding and the runtime").

A `Mesh` has four degrees: data parallel (dp: replicas, each decoding its own rows of the batch), pipeline parallel
(pp: stages, each a contiguous range of layers), expert parallel (ep) and tensor parallel (tp). A stage has
G = ep · tp ranks (its `group`); each holds a contiguous slice of every MoE layer's routed experts (expert
parallelism spans the tp × ep ranks of a stage, as serving systems do). With tp > 1 the ranks of a tensor-parallel
group (tp consecutive shards) also split the attention by heads, the dense MLP and shared experts by their
intermediate width and the embedding and head by vocabulary (sharding/tensor.py), each block's output summed over
the group and the logits gathered at the token source. Rank r = (d · pp + s) · G + g,
the shard g = e · tp + t.

`make_plan(cfg, mesh, dispatch)` places every layer and expert: stage cuts balanced by layer count and moved onto
Block AttnRes block edges where that keeps every stage non-empty; expert slices as even as the count allows (8
experts on 3 ranks: 3, 3, 2). A stage boundary carries the residual stream and, with Block AttnRes, the bank of
closed blocks' summaries (`carry_names`). Two ways to join the expert slices (`dispatch`):

- "all_reduce": every rank of a stage computes all of its replica's rows; each MoE layer's latent partial sums are
  all-reduced (latent width, before the latent norm). Best for the small batches of decode.
- "all_to_all": the ep row groups of a stage split the replica's rows (`rank_rows`, padded to one count: static
  shapes; with tp > 1 the tp ranks of a group share its rows); each MoE layer sends every token slot's latent
  vector, expert id and weight (one row) to the rank holding that expert and the weighted outputs come back. The
  graph's buffers have room for all of the sender's slots (static shapes, nothing is dropped); on the wire only the
  routed rows move, after a count per destination (runtime/worker.py). With tp > 1 each rank of a group sends its
  share of the slots (`slot_share`: a row's i-th of its top-k goes from rank i mod tp), and the group all-reduces
  its ranks' routed sums (AR_ROUTED) before the latent norm.

`schedule(rank)` is a rank's step: receive the carry, run its layers (with those collectives), send the carry on,
then the new tokens are broadcast from the last stage. The plan imports neither TVM nor the weights; the manifest
stores it (`as_record` / `from_record`).
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass

from k3compile.config import K3Config
from k3compile.errors import UserError


class PlanError(UserError):
    """A mesh the model cannot be split over, or a malformed mesh or plan."""


MAX_RANKS = 2**20  # the largest mesh (and `plan --devices`) taken: far past any supernode, still priced in seconds


@dataclass(frozen=True)
class Mesh:
    ep: int = 1
    pp: int = 1
    dp: int = 1
    tp: int = 1

    @classmethod
    def parse(cls, text: str) -> Mesh:
        """"ep=4,pp=2" (any order, each at most once, missing ones 1; ASCII digits only: `\\d` and int() would also
        take "２" and "١"), of at most MAX_RANKS ranks."""
        degrees: dict[str, int] = {}
        for part in filter(None, (p.strip() for p in str(text).split(","))):
            m = re.fullmatch(r"(tp|ep|pp|dp)\s*=\s*([0-9]+)", part)
            if not m or m.group(1) in degrees:
                raise PlanError(f"--mesh {text!r}: expected degrees like ep=4,pp=2 (tp, ep, pp, dp; each once)")
            if len(m.group(2).lstrip("0")) > len(str(MAX_RANKS)):  # int() refuses 4300 digits with a traceback
                raise PlanError(f"--mesh {text!r}: a mesh has at most {MAX_RANKS} ranks")
            degrees[m.group(1)] = int(m.group(2))
        mesh = cls(**degrees)
        if min(mesh.ep, mesh.pp, mesh.dp, mesh.tp) < 1:
            raise PlanError(f"--mesh {text!r}: every degree must be at least 1")
        if mesh.size > MAX_RANKS:
            raise PlanError(f"--mesh {text!r}: a mesh has at most {MAX_RANKS} ranks, this one {mesh.size}")
        return mesh

    @property
    def size(self) -> int:
        return self.group * self.pp * self.dp

    @property
    def group(self) -> int:
        """G: the ranks of one stage of one replica (they split its routed experts)."""
        return self.ep * self.tp

    def coords(self, rank: int) -> tuple[int, int, int]:
        """rank -> (d, s, g): replica, stage, shard within the stage's group."""
        return rank // (self.pp * self.group), rank // self.group % self.pp, rank % self.group

    def rank(self, d: int, s: int, g: int) -> int:
        return (d * self.pp + s) * self.group + g

    def __str__(self) -> str:
        degrees = (("tp", self.tp), ("ep", self.ep), ("pp", self.pp), ("dp", self.dp))
        return ",".join(f"{k}={v}" for k, v in degrees if v > 1) or "ep=1"


@dataclass(frozen=True)
class RankPlan:
    rank: int
    replica: int  # d
    stage: int  # s
    shard: int  # g: the index within the stage's group (ep · tp ranks)
    layers: tuple[int, int]
    experts: tuple[int, int]  # the routed-expert slice of every MoE layer of the stage
    first: bool  # holds the embedding (stage 0)
    last: bool  # holds the final norm and the head (the last stage)
    tensor: int = 0  # t = g % tp: its part of the heads, intermediate widths and vocabulary (sharding/tensor.py)
    tp: int = 1


def even_slices(n: int, parts: int) -> list[tuple[int, int]]:
    """[0, n) in `parts` contiguous slices, the first n % parts one longer."""
    return [even_slice(n, parts, i) for i in range(parts)]


def even_slice(n: int, parts: int, i: int) -> tuple[int, int]:
    """Slice i of even_slices(n, parts), without the others (a rank's rows of a batch over a large mesh)."""
    q, r = divmod(n, parts)
    a = i * q + min(i, r)
    return a, a + q + (1 if i < r else 0)


def slice_runs(n: int, parts: int) -> list[tuple[int, int, int]]:
    """even_slices(n, parts) as runs of slices of one length, (length, first slice, count): at most two."""
    q, r = divmod(n, parts)
    return [run for run in ((q + 1, 0, r), (q, r, parts - r)) if run[2]]


def micro_parts(mesh: Mesh, batch: int, micro_batches: int) -> int:
    """The micro-batches a mesh runs for `micro_batches` asked: 1 without stages to overlap (pp = 1), at most the
    smallest replica's rows (`run` refuses more)."""
    return 1 if mesh.pp == 1 else max(1, min(micro_batches, batch // mesh.dp))


AUTO_MICRO_BATCHES = 0  # `--micro-batches auto` (plan: cost.fastest_micro_batches; run: auto_micro_batches)


def auto_micro_batches(mesh: Mesh, batch: int) -> int:
    """`run --micro-batches auto`: pp micro-batches, as many as there are stages to keep busy, at most the smallest
    replica's rows (1 with pp = 1). Past pp each micro-batch reads its stage's weights again for no more overlap:
    the device model (sharding/cost.py) predicts a slower step where those reads dominate a step
    (docs/architecture.md, "Micro-batches")."""
    return micro_parts(mesh, batch, mesh.pp)


def stage_cuts(cfg: K3Config, pp: int) -> list[int]:
    """Layer boundaries [0, c1, ..., L]: balanced by layer count, each moved to the nearest AttnRes block edge when
    that edge lies within a quarter stage (at least one layer) of the balanced cut and keeps the stages non-empty."""
    n, block = cfg.num_hidden_layers, cfg.attn_res_block_size
    slack = max(1.0, n / pp / 4)
    cuts = [0]
    for s in range(1, pp):
        exact = n * s / pp
        c = round(exact)
        if block:
            edges = sorted({block * math.floor(exact / block), block * math.ceil(exact / block)},
                           key=lambda x: (abs(x - exact), x))
            c = next((x for x in edges if abs(x - exact) <= slack and cuts[-1] < x <= n - (pp - s)), c)
        cuts.append(min(max(c, cuts[-1] + 1), n - (pp - s)))
    cuts.append(n)
    return cuts


def carry_names(cfg: K3Config, layer: int) -> list[str]:
    """The tensors entering layer `layer` from the previous stage, each [B, T, D]: the residual stream and, with
    Block AttnRes, the summaries of the blocks closed before it (the embedding first)."""
    bank = -(-layer // cfg.attn_res_block_size) if cfg.attn_res_block_size else 0
    return ["hidden", *(f"bank.{i}" for i in range(bank))]


DISPATCH = ("all_reduce", "all_to_all")
# What each all-to-all of one MoE layer moves (its part): the dispatch's slots, each row the latent vector then its
# expert id (fp32, exact below 2**24; -1 where the slot is not for that rank) and weight, and the outputs back.
A2A_PARTS = ("dispatch", "outputs")
A2A_DISPATCH, A2A_OUTPUTS = range(len(A2A_PARTS))
A2A_ID_COLUMN = -2  # where a dispatch row holds its expert id
# What each all-reduce of a layer sums (its part): the MoE's latent partial sums over the stage's group (ep · tp), and
# with tp > 1 over the tensor-parallel group the attention's output partial sums, the dense MLP's / a MoE layer's
# output partial sums (the shared experts' and the latent up projection's), the embedding's (tag 0: each rank looks
# up the ids of its vocabulary slice) and a latent MoE's down projection's (its input: the latent the experts take).
# With the all-to-all and tp > 1, a MoE layer's routed sums (each rank of a tensor-parallel group dispatched its share
# of the group's slots) are summed over the group before the latent norm (routed_partial_sum, at the latent width).
AR_PARTS = ("latent_partial_sum", "attention_output", "ffn_output", "embedding_output", "latent_input",
            "routed_partial_sum")
AR_LATENT, AR_ATTENTION, AR_FFN, AR_EMBED, AR_LATENT_IN, AR_ROUTED = range(len(AR_PARTS))
AR_LATENT_WIDTH = (AR_LATENT, AR_LATENT_IN, AR_ROUTED)  # the parts summed at the latent width D_e (the others at D)


def slot_share(rows: int, top_k: int, t: int, tp: int) -> int:
    """How many of a row group's token slots (`rows` x `top_k`) rank t of its tp ranks dispatches with the
    all-to-all: each row's i-th slot for i mod tp = t (partition._Exchange; a static mask over the top-k, whatever
    the rows: tp dividing top-k, as K3's 16, gives each rank an equal share)."""
    return rows * len(range(t, top_k, tp))


@dataclass(frozen=True)
class ShardPlan:
    mesh: Mesh
    cuts: tuple[int, ...]
    slices: tuple[tuple[int, int], ...]
    moe_layers: tuple[int, ...]
    dispatch: str = "all_reduce"

    def rank(self, r: int) -> RankPlan:
        if not 0 <= r < self.mesh.size:
            raise PlanError(f"rank {r} is outside the mesh {self.mesh} ({self.mesh.size} ranks)")
        d, s, g = self.mesh.coords(r)
        return RankPlan(r, d, s, g, (self.cuts[s], self.cuts[s + 1]), self.slices[g], s == 0,
                        s == self.mesh.pp - 1, g % self.mesh.tp, self.mesh.tp)

    def ranks(self) -> list[RankPlan]:
        return [self.rank(r) for r in range(self.mesh.size)]

    def ep_group(self, r: int) -> list[int]:
        """The ranks of r's stage in its replica (ep · tp): they hold the stage's expert slices."""
        d, s, _ = self.mesh.coords(r)
        first = self.mesh.rank(d, s, 0)  # a stage's group is a run of ranks (Mesh.rank): built in C, not per rank
        return list(range(first, first + self.mesh.group))

    def tp_group(self, r: int) -> list[int]:
        """The tp ranks that split r's heads and intermediate widths (r alone at tp = 1)."""
        d, s, g = self.mesh.coords(r)
        first = self.mesh.rank(d, s, g - g % self.mesh.tp)
        return list(range(first, first + self.mesh.tp))

    def replica_group(self, d: int) -> list[int]:
        first = self.mesh.rank(d, 0, 0)
        return list(range(first, first + self.mesh.pp * self.mesh.group))

    def token_sources(self, d: int) -> list[int]:
        """The ranks that pick replica d's next tokens and broadcast them: the last stage's first shard (all_reduce:
        it has every row), or the first shard of each of the last stage's row groups for its rows (all_to_all: ep
        groups of tp ranks)."""
        first = self.mesh.rank(d, self.mesh.pp - 1, 0)
        groups = self.mesh.ep if self.dispatch == "all_to_all" else 1
        return list(range(first, first + groups * self.mesh.tp, self.mesh.tp))

    def rank_rows(self, batch: int, r: int) -> tuple[int, int, int]:
        """(first row, end row, padded count) of a batch of `batch` rows that rank r computes: its replica's rows,
        or with all_to_all its row group's part of them (shard g is of group g // tp), padded to the largest part
        (static buffers)."""
        d, _, g = self.mesh.coords(r)
        e = g // self.mesh.tp
        lo, hi = even_slice(batch, self.mesh.dp, d)
        if self.dispatch != "all_to_all":
            return lo, hi, hi - lo
        a, b = even_slice(hi - lo, self.mesh.ep, e)
        first = even_slice(hi - lo, self.mesh.ep, 0)
        return lo + a, lo + b, first[1] - first[0]

    def schedule(self, r: int, cfg: K3Config) -> list[dict]:
        """Rank r's decode step, in order: recv / run (with its collectives) / gather (tp > 1: the logits of each
        rank's vocabulary slice to the token source) / send / broadcast."""
        p, mesh = self.rank(r), self.mesh
        steps: list[dict] = []
        if not p.first:
            steps.append({"op": "recv", "from": mesh.rank(p.replica, p.stage - 1, p.shard),
                          "tensors": carry_names(cfg, p.layers[0])})
        a, b = p.layers
        group, tp = self.ep_group(r), self.tp_group(r)
        calls = []
        moe = frozenset(self.moe_layers)  # asked of each layer: plan's walk over thousands of ranks repeats this
        if mesh.tp > 1 and p.first:
            calls.append({"op": "all_reduce", "tag": 0, "part": AR_EMBED, "tensor": AR_PARTS[AR_EMBED], "group": tp})
        for i in range(a, b):  # in the order a layer runs them: attention, the latent down projection, routed
            # experts, the output (shared experts and the latent up projection, or the dense MLP)
            if mesh.tp > 1:
                calls.append({"op": "all_reduce", "tag": i, "part": AR_ATTENTION, "tensor": AR_PARTS[AR_ATTENTION],
                              "group": tp})
            if mesh.tp > 1 and i in moe and cfg.is_latent_moe:
                calls.append({"op": "all_reduce", "tag": i, "part": AR_LATENT_IN, "tensor": AR_PARTS[AR_LATENT_IN],
                              "group": tp})
            if i in moe and mesh.group > 1:
                if self.dispatch == "all_to_all":
                    calls += [{"op": "all_to_all", "tag": i, "part": k, "tensor": what, "group": group}
                              for k, what in enumerate(A2A_PARTS)]
                    if mesh.tp > 1:  # the group's ranks each dispatched a share of its slots
                        calls.append({"op": "all_reduce", "tag": i, "part": AR_ROUTED,
                                      "tensor": AR_PARTS[AR_ROUTED], "group": tp})
                else:
                    calls.append({"op": "all_reduce", "tag": i, "part": AR_LATENT, "tensor": AR_PARTS[AR_LATENT],
                                  "group": group})
            if mesh.tp > 1 and (i not in moe or cfg.num_shared_experts or cfg.is_latent_moe):
                calls.append({"op": "all_reduce", "tag": i, "part": AR_FFN, "tensor": AR_PARTS[AR_FFN], "group": tp})
        steps.append({"op": "run", "layers": [a, b], "embed": p.first, "head": p.last, "collectives": calls})
        source = next((x for x in self.token_sources(p.replica) if x in tp), None)  # of this tp group, if any
        if mesh.tp > 1 and p.last and source is not None:  # its vocabulary's logits to the source
            steps.append({"op": "gather", "to": source, "group": tp, "tensors": ["logits"]})
        if not p.last:
            steps.append({"op": "send", "to": mesh.rank(p.replica, p.stage + 1, p.shard),
                          "tensors": carry_names(cfg, b)})
        replica = self.replica_group(p.replica)  # one list, shared as `group` is by the collectives above
        for src in self.token_sources(p.replica):
            steps.append({"op": "broadcast", "from": src, "group": replica, "tensors": ["tokens"]})
        return steps

    def as_record(self) -> dict:
        mesh = {"ep": self.mesh.ep, "pp": self.mesh.pp, "dp": self.mesh.dp, **({"tp": self.mesh.tp}
                                                                                 if self.mesh.tp > 1 else {})}
        return {"mesh": mesh, "cuts": list(self.cuts),
                "expert_slices": [list(s) for s in self.slices], "moe_layers": list(self.moe_layers),
                "dispatch": self.dispatch}

    @classmethod
    def from_record(cls, doc, cfg: K3Config) -> ShardPlan:
        """The plan a manifest records, checked to be the one make_plan gives for its mesh and this config."""
        try:
            plan = make_plan(cfg, Mesh(**doc["mesh"]), doc["dispatch"])
        except (KeyError, TypeError) as e:
            raise PlanError(f"the recorded plan is malformed ({e})") from None
        if json.dumps(plan.as_record(), sort_keys=True) != json.dumps(doc, sort_keys=True):  # true is not 1 here
            raise PlanError("the recorded plan is not the plan of its mesh for this config (edited?)")
        return plan


def check_tp(cfg: K3Config, mesh: Mesh, moe_layers) -> None:
    """A PlanError naming each width tp does not divide."""
    widths = {"KDA heads (kda_num_heads)": cfg.kda_num_heads if len(cfg.full_attn_layers) < cfg.num_hidden_layers
              else None,
              "MLA heads (num_attention_heads)": cfg.num_attention_heads if cfg.full_attn_layers else None,
              "dense MLP width (intermediate_size)": cfg.intermediate_size
              if len(moe_layers) < cfg.num_hidden_layers else None,
              "shared experts' width (num_shared_experts x moe_intermediate_size)":
              cfg.num_shared_experts * cfg.moe_intermediate_size if moe_layers and cfg.num_shared_experts else None,
              "vocabulary (vocab_size)": cfg.vocab_size,
              "latent MoE's projections (hidden_size)": cfg.hidden_size if moe_layers and cfg.is_latent_moe else None,
              "latent MoE's projections (routed_expert_hidden_size)": cfg.latent_size
              if moe_layers and cfg.is_latent_moe else None}
    bad = [f"{n} {what}" for what, n in widths.items() if n is not None and n % mesh.tp]
    if bad:
        raise PlanError(f"mesh {mesh}: tp={mesh.tp} does not divide {cfg.name}'s {', '.join(bad)}")


def make_plan(cfg: K3Config, mesh: Mesh, dispatch: str = "all_reduce") -> ShardPlan:
    """The plan of `mesh` for `cfg`, or a PlanError naming what cannot be split."""
    if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 1 for v in (mesh.ep, mesh.pp, mesh.dp,
                                                                                   mesh.tp)):
        raise PlanError(f"mesh {mesh}: every degree must be an integer >= 1")
    if dispatch not in DISPATCH:
        raise PlanError(f"dispatch {dispatch!r} is not one of {', '.join(DISPATCH)}")
    if dispatch == "all_to_all" and mesh.ep == 1:
        raise PlanError(f"mesh {mesh}: all-to-all dispatch needs ep > 1")
    moe = tuple(i for i in range(cfg.num_hidden_layers) if cfg.is_moe(i))
    if mesh.ep > 1 and not moe:
        raise PlanError(f"mesh {mesh}: {cfg.name} has no MoE layer, so there are no experts to split over ep")
    if moe and mesh.group > cfg.num_experts:
        over = f"ep={mesh.ep}" if mesh.tp == 1 else f"ep x tp = {mesh.group}"
        raise PlanError(f"mesh {mesh}: {cfg.num_experts} experts cannot be split over {over} ranks (a rank "
                        "would hold none)")
    if mesh.tp > 1:
        check_tp(cfg, mesh, moe)
    if mesh.pp > cfg.num_hidden_layers:
        raise PlanError(f"mesh {mesh}: {cfg.num_hidden_layers} layers cannot be split into pp={mesh.pp} stages")
    return ShardPlan(mesh, tuple(stage_cuts(cfg, mesh.pp)), tuple(even_slices(cfg.num_experts, mesh.group)), moe,
                     dispatch)
