"""What a plan costs, from the config alone (docs/architecture.md, "Sharding and the runtime"): memory per device and
bytes per decode step per collective. Shapes come from a meta-device model (no weights, any size).

Bytes are payload bytes a rank hands to a collective during one decode step (one new token for each of the B rows of
its replica): an all-reduce counts the tensor each member contributes (a ring moves 2(n-1)/n of it over each link),
a send its tensors, a broadcast its tensor at the source only. The runtime counts the same way, so its measured
figures equal these (`k3compile run --stats`), but for the all-to-all dispatch's. `evaluate` prices both dispatch
modes of a mesh; the all-to-all one at latent width D_e (as built) and, for comparison, at full width D. It moves
exactly the token slots routed to other ranks (and a count per destination), which depends on the router: the plan
prices the expectation under uniform routing, the runtime counts what moved.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from fractions import Fraction

from k3compile.config import K3Config
from k3compile.sharding.plan import (
    AR_LATENT,
    AR_LATENT_WIDTH,
    Mesh,
    PlanError,
    RankPlan,
    ShardPlan,
    carry_names,
    make_plan,
    micro_parts,
    slice_runs,
    slot_share,
)
from k3compile.sharding.tensor import ARGMAX_BYTES

COLLECTIVES = ("all_reduce", "all_to_all", "send", "broadcast", "gather")  # what a step's bytes are counted by
TOKEN_BYTES = 8  # int64 token ids
COUNT_BYTES = 8  # an all-to-all's int64 row count for each destination
WIRE_BYTES = {"fp32": 4, "bf16": 2}  # `run --wire-dtype`: the all-to-all's latent vectors
DTYPE_BYTES = {"fp32": 4, "bf16": 2}
_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


@dataclass(frozen=True)
class Sizes:
    """Element counts of a config's tensors from a meta model: per layer (dense elements every rank of a stage holds
    whole, routed-expert elements that are float, routed-expert bytes that are MXFP4 packed codes and scales, dense
    elements tensor parallelism splits: sharding/tensor.py), and the embedding and the head (the final norm, the
    output AttnRes and lm_head; a tied head counts the embedding again), and of the head lm_head's elements (split
    by vocabulary with tp > 1, as the embedding is)."""

    layers: tuple[tuple[int, int, int, int], ...]
    embed: int
    head: int
    lm_head: int = 0

    @classmethod
    def of(cls, cfg: K3Config) -> Sizes:
        import torch

        from k3compile.model.k3 import K3ForCausalLM
        from k3compile.sharding.tensor import split_dim

        with torch.device("meta"):
            model = K3ForCausalLM(cfg)
        layers = [[0, 0, 0, 0] for _ in range(cfg.num_hidden_layers)]
        embed = head = lm_head = 0
        for name, t in [*model.named_parameters(remove_duplicate=False), *model.named_buffers()]:
            m = _LAYER.match(name)
            if m:
                row = layers[int(m.group(1))]
                row[2 if ".experts." in name and t.element_size() == 1 else 1 if ".experts." in name else
                    3 if split_dim(cfg, name) is not None else 0] += t.numel()
            elif "embed_tokens" in name:
                embed += t.numel()
            else:
                head += t.numel()
                lm_head += t.numel() if name.startswith("lm_head.") else 0
        return cls(tuple(map(tuple, layers)), embed, head, lm_head)


def rank_weights(cfg: K3Config, sizes: Sizes, p: RankPlan, dtype_bytes: int) -> dict[str, int]:
    """Weight bytes a rank holds by format: dense (attention, router, shared experts, norms, embedding / head) at
    `dtype_bytes` per element (what tensor parallelism splits, its 1/tp share), routed experts as stored (MXFP4:
    packed bytes + E8M0 scales; float: dtype_bytes)."""
    share = (p.experts[1] - p.experts[0]) / cfg.num_experts if cfg.num_experts else 0.0
    rows = sizes.layers[p.layers[0]:p.layers[1]]
    out = {"dense": (dense_elements(sizes, p) + (sizes.embed // p.tp if p.first else 0)) * dtype_bytes}
    if cfg.expert_format == "mxfp4":
        out["experts_mxfp4"] = round(sum(r[2] for r in rows) * share)
    else:
        out["experts_float"] = round(sum(r[1] for r in rows) * share) * dtype_bytes
    return out


def dense_elements(sizes: Sizes, p: RankPlan) -> int:
    """The elements of the dense matrices rank `p` holds but the embedding's (its 1/tp share of what tensor
    parallelism splits): its layers' attention, router, shared experts and norms, and on the last stage the head."""
    rows = sizes.layers[p.layers[0]:p.layers[1]]
    return sum(r[0] + r[3] // p.tp for r in rows) + (sizes.head - sizes.lm_head + sizes.lm_head // p.tp if p.last
                                                      else 0)


def rank_state(cfg: K3Config, p: RankPlan, batch: int, context: int, dtype_bytes: int) -> dict[str, int]:
    """Decode state of a rank's layers for `batch` rows of `context` tokens: KDA conv windows (dtype) and recurrent
    states (fp32 always) of its heads (1/tp of them), MLA latent cache (kv_lora_rank + rope per token, dtype; whole
    on every rank of a tensor-parallel group: the heads share it)."""
    heads = cfg.kda_num_heads // p.tp
    hk = heads * cfg.kda_head_dim
    kda = mla = 0
    for i in range(*p.layers):
        if cfg.is_mla(i):
            mla += batch * context * (cfg.kv_lora_rank + cfg.qk_rope_head_dim) * dtype_bytes
        else:
            kda += batch * (3 * hk * (cfg.conv_kernel_size - 1) * dtype_bytes
                            + heads * cfg.kda_head_dim * cfg.kda_head_dim * 4)
    return {"kda_state": kda, "mla_cache": mla}


def rank_activations(cfg: K3Config, p: RankPlan, batch: int, dtype_bytes: int) -> int:
    """Live activations of one decode step (an estimate, not a measurement): the carry (residual + AttnRes bank) in
    and out, the widest layer intermediate (dense MLP, or top-k routed experts' 2I plus the shared experts'), and on
    the last stage the fp32 logits."""
    d = cfg.hidden_size
    carry = (len(carry_names(cfg, p.layers[1])) + 1) * d
    widest = max(cfg.intermediate_size, cfg.num_experts_per_token * 2 * cfg.moe_intermediate_size
                 + 2 * cfg.num_shared_experts * cfg.moe_intermediate_size)
    return batch * ((carry + 2 * widest) * dtype_bytes + (cfg.vocab_size * 4 if p.last else 0))


def step_bytes(cfg: K3Config, plan: ShardPlan, rank: int, batch: int, dtype_bytes: int = 4,
               width: int | None = None, wire_bytes: int | None = None, tp_key: bool = False,
               greedy: bool = False) -> dict[str, int]:
    """Payload bytes rank `rank` sends in one decode step of a `batch`-row batch (over the whole mesh), by collective
    (the schedule's all_reduce / all_to_all / send / broadcast); `dtype_bytes` is the activations' element size (4:
    the runtime's fp32). An all-to-all counts the rows that leave the rank (below). `width`:
    the vectors an all-to-all moves (default the latent width; the hidden width prices full-width dispatch);
    `wire_bytes`: their element size on the all-to-all's wire (default `dtype_bytes`; `run --wire-dtype`). An
    all-reduce counts its tensor: a MoE layer's latent partial sums [rows, D_e], with tp > 1 an attention's or an
    MLP's (or MoE layer's) output [rows, D] and a latent MoE's down projection [rows, D_e] (`tp_key`: those also
    apart, as "all_reduce_tp", for their ring of tp ranks; with the all-to-all a MoE layer's routed sums [rows, D_e]
    too); with tp > 1
    the embedding's lookups [rows, D] on the first stage, and a gather of the last position's logits of each rank's
    vocabulary slice [rows, V / tp] from the token source's tensor-parallel group (the source's own piece does not
    cross), or with `greedy` (temperature 0: a distributed argmax) only each slice's candidate, ARGMAX_BYTES a row.

    The all-to-all's figure is an expectation under uniform routing (each slot on expert e with probability 1/E):
    per MoE layer a count to each other rank of the stage (int64), then the slots it dispatches (all its row group's,
    or with tp > 1 its share, plan.slot_share) that are routed off this rank (the share of experts others hold) out,
    each a latent vector and its fp32 expert id and weight, and back the outputs of the slots that the other ranks
    dispatch (every row group's equal row count) and route here; each call's expectation in whole bytes (rounded,
    exactly: Fraction)."""
    rows = plan.rank_rows(batch, rank)[2]  # padded: what the static shapes carry (padding rows are routed too)
    slots = rows * cfg.num_experts_per_token  # its row group's
    own = slot_share(rows, cfg.num_experts_per_token, plan.rank(rank).tensor, plan.mesh.tp)  # all of them at tp 1
    lo, hi = plan.rank(rank).experts
    here = Fraction(hi - lo, cfg.num_experts) if cfg.num_experts else Fraction(0)
    moved = {"dispatch": own * (1 - here), "outputs": (plan.mesh.ep * slots - own) * here}  # every group's slots
    width = width or cfg.latent_size
    wire = wire_bytes or dtype_bytes
    a2a = {"dispatch": width * wire + 2 * 4, "outputs": width * wire}  # per token slot (the id and weight: fp32)
    per_call = {t: round(moved[t] * a2a[t]) for t in moved}  # the same for every MoE layer's call
    out = dict.fromkeys(COLLECTIVES, 0)
    for step in plan.schedule(rank, cfg):
        if step["op"] == "run":
            for c in step["collectives"]:
                if c["op"] == "all_reduce":
                    width_of = cfg.latent_size if c["part"] in AR_LATENT_WIDTH else cfg.hidden_size
                    out["all_reduce"] += rows * width_of * dtype_bytes
                    if tp_key and c["part"] != AR_LATENT:
                        out["all_reduce_tp"] = out.get("all_reduce_tp", 0) + rows * width_of * dtype_bytes
                else:
                    counts = (plan.mesh.group - 1) * COUNT_BYTES if c["tensor"] == "dispatch" else 0
                    out["all_to_all"] += counts + per_call[c["tensor"]]
        elif step["op"] == "send":
            out["send"] += len(step["tensors"]) * rows * cfg.hidden_size * dtype_bytes
        elif step["op"] == "broadcast" and step["from"] == rank:
            out["broadcast"] += rows * TOKEN_BYTES
        elif step["op"] == "gather" and step["to"] != rank:
            out["gather"] += rows * (ARGMAX_BYTES if greedy else cfg.vocab_size // plan.mesh.tp * dtype_bytes)
    return out


@dataclass(frozen=True)
class Device:
    """The accelerator a plan predicts decode time for (docs/architecture.md, "The plan's device model"): memory
    bandwidth in bytes/s, the bytes/s one device sends to its peers (every collective of a step shares it), and the
    floating-point operations a second its matrix units sustain."""

    bandwidth: float
    link: float
    flops: float = 312e12


# The default class: a 64 GiB HBM2e accelerator at 1.6 TB/s with 100 GB/s of interconnect per device and 312 TFLOP/s
# of dense bf16 (an A100-class part). An assumed class, not a measured one (`plan --device-bandwidth /
# --link-bandwidth / --device-tflops` set another).
DEFAULT_DEVICE = Device(bandwidth=1.6e12, link=100e9, flops=312e12)


def rank_read_bytes(cfg: K3Config, sizes: Sizes, p: RankPlan, rows: int, context: int, dtype_bytes: int) -> int:
    """Bytes rank `p` reads from its memory in one decode step of `rows` rows after `context` tokens: every dense
    weight it holds but the embedding (one row per token), of its routed experts the share that the step's
    rows x top-k routings touch at least once under uniform routing, 1 - (1 - 1/E)^(rows k), its KDA states read and
    written back, and its MLA caches read (context positions) plus the new position written."""
    w = rank_weights(cfg, sizes, p, dtype_bytes)
    dense = w["dense"] - (sizes.embed // p.tp * dtype_bytes - rows * cfg.hidden_size * dtype_bytes if p.first else 0)
    experts = w.get("experts_mxfp4", w.get("experts_float", 0))
    touched = 1 - (1 - 1 / cfg.num_experts) ** (rows * cfg.num_experts_per_token) if cfg.num_experts else 0.0
    state = rank_state(cfg, p, rows, context, dtype_bytes)
    new_row = rank_state(cfg, p, rows, 1, dtype_bytes)["mla_cache"]
    return dense + round(experts * touched) + 2 * state["kda_state"] + state["mla_cache"] + new_row


def rank_flops(cfg: K3Config, sizes: Sizes, p: RankPlan, rows: int, routed_rows: int, context: int) -> int:
    """Floating-point operations rank `p` computes in one decode step of `rows` rows after `context` tokens (an
    estimate: the matrix work, not the norms and activations): 2 per element and row of every dense matrix it holds
    but the embedding (a lookup); of its routed experts, 2 per element of each expert a routing picks on this rank
    (uniform routing: `routed_rows` x top-k x its share of the experts; `routed_rows` are the rows whose picks reach
    it: its stage's with the all-to-all); MLA's absorbed attention over the cache, 2 · context · heads/tp ·
    (2 · kv_lora_rank + rope) a row and layer (the scores against latent + k_rope, the weighted sum of latents); and
    KDA's state update and read, 8 · heads/tp · K · V a row and layer."""
    share = (p.experts[1] - p.experts[0]) / cfg.num_experts if cfg.num_experts else 0.0
    layers = sizes.layers[p.layers[0]:p.layers[1]]
    dense = dense_elements(sizes, p)  # the embedding is a lookup
    # a layer's routed-expert elements: float as counted, MXFP4 from its bytes (16 code bytes + 1 scale per 32)
    elements = sum(r[1] if cfg.expert_format != "mxfp4" else r[2] * 32 // 17 for r in layers)
    experts = 2 * routed_rows * cfg.num_experts_per_token * share * elements / cfg.num_experts if cfg.num_experts \
        else 0.0
    attention = 0
    for i in range(*p.layers):
        if cfg.is_mla(i):
            attention += 2 * context * (cfg.num_attention_heads // p.tp) * (2 * cfg.kv_lora_rank + cfg.qk_rope_head_dim)
        else:
            attention += 8 * (cfg.kda_num_heads // p.tp) * cfg.kda_head_dim * cfg.kda_head_dim
    return round(2 * rows * dense + experts + rows * attention)


def link_seconds(moved: dict[str, int], mesh: Mesh, device: Device) -> float:
    """Seconds a rank's collectives of one step take on its link, from the payload bytes step_bytes counts (with
    tp_key): a ring all-reduce over n ranks sends 2(n-1)/n of its tensor (n: the stage's ep · tp ranks for the MoE's
    latent sums, tp for the attention's and MLP's), an all-to-all the blocks that leave, a send or broadcast its
    tensor."""
    def ring(n: int) -> float:
        return 2 * (n - 1) / n

    tp = moved.get("all_reduce_tp", 0)
    return ((moved["all_reduce"] - tp) * ring(mesh.group) + tp * ring(mesh.tp) + moved["all_to_all"]
            + moved["send"] + moved["broadcast"] + moved["gather"]) / device.link


def candidate_meshes(cfg: K3Config, devices: int) -> list[Mesh]:
    """Every (tp, ep, pp, dp) with tp · ep · pp · dp = devices that make_plan accepts: tp = 1 first, then wider tensor
    parallelism; within a tp the widest expert parallelism first."""
    out = []
    for tp in (t for t in range(1, devices + 1) if devices % t == 0):
        rest = devices // tp
        for ep in range(rest, 0, -1):
            if rest % ep:
                continue
            for pp in range(1, rest // ep + 1):
                if (rest // ep) % pp:
                    continue
                mesh = Mesh(ep, pp, rest // (ep * pp), tp)
                try:
                    make_plan(cfg, mesh)
                except PlanError:
                    continue
                out.append(mesh)
    return out


def alike_ranks(plan: ShardPlan, batch: int) -> list[tuple[int, int]]:
    """(lowest rank, count) of each class of ranks that hold and move the same bytes for a `batch`-row batch: a
    rank's figures depend only on its stage, the length of its expert slice, its replica's row count, whether it
    broadcasts the new tokens and (tp > 1) whether it is of the token source's tensor-parallel group (it gathers its
    logits there), and with the all-to-all at tp > 1 its t (its share of its row group's slots). At most 2 (row
    counts: even_slices) x 8 (slice lengths x broadcasting x gathering) classes a stage (x tp with that share),
    whatever the mesh's size: pricing every rank took minutes for 1024 devices."""
    mesh = plan.mesh
    sources = {mesh.coords(r)[2] for r in plan.token_sources(0)}  # the same shards in every replica
    gathers = {g for g in range(mesh.group) if mesh.tp > 1 and any(g // mesh.tp == x // mesh.tp for x in sources)}
    # with the all-to-all and tp > 1 a rank's t also sets its share of its row group's slots (slot_share)
    share = (lambda g: g % mesh.tp) if plan.dispatch == "all_to_all" and mesh.tp > 1 else (lambda g: 0)
    shards: dict[tuple, list[int]] = {}  # (slice length, broadcasts, gathers, share) -> [first, count]
    for e, (a, b) in enumerate(plan.slices):
        shards.setdefault((b - a, e in sources, e in gathers, share(e)), [e, 0])[1] += 1
    return [(mesh.rank(d, s, e), replicas * n) for _, d, replicas in slice_runs(batch, mesh.dp)
            for s in range(mesh.pp) for e, n in shards.values()]


def evaluate(cfg: K3Config, sizes: Sizes, mesh: Mesh, batch: int, context: int, dtype: str,
             device_memory: int, device: Device = DEFAULT_DEVICE, micro_batches: int = 1,
             dispatch: str = "all_reduce") -> dict:
    """One mesh's row of `k3compile plan` with `dispatch` (the all-to-all: ranks hold their row group's rows, so its
    state and reads are theirs): the fullest device's memory by kind (its lowest rank), whether it fits, and the
    bytes per decode token by collective summed over the mesh (with the all-reduce dispatch, the all-to-all
    alternative's, latent and full width), and the longest context the devices hold at this batch (`max_context`:
    the KDA state is fixed per row, the MLA cache grows per token; at most the model's max_position_embeddings).
    `batch` is the whole batch, split over dp replicas. Each class of alike ranks is priced once (`alike_ranks`).

    `predicted`: the decode step's time on `device` (memory-bound: each rank's read bytes over the bandwidth, plus
    its collectives over the link, in sequence as a decode step runs them layer by layer), the slowest rank of each
    stage, the stages one after the other, the replicas side by side. With `micro_batches` M (`run --micro-batches`,
    at pp > 1; at most a replica's rows) each stage runs M micro-batches of ceil(rows / M) rows, stage s on m while
    s + 1 runs m - 1, and a micro-batch's next step starts as soon as its tokens are back (Rank.decode_micro): in
    the steady state a step is the longer of the slowest stage's M micro-batches and one micro-batch's way through
    every stage. A micro-batch reads its stage's dense weights again, so where those reads dominate (memory-bound
    decode) M up to pp fills the stages' idle time for little more than one batch's reads, and M past pp predicts a
    slower step; where compute does (rank_flops over Device.flops), micro-batches pay up to pp.
    `stage_s`: each stage's time for one micro-batch (the whole batch at M = 1)."""
    return _evaluate(cfg, sizes, mesh, batch, context, dtype, device_memory, device, [micro_batches], dispatch)[0]


def fastest_micro_batches(cfg: K3Config, sizes: Sizes, mesh: Mesh, batch: int, context: int, dtype: str,
                          device_memory: int, device: Device = DEFAULT_DEVICE, dispatch: str = "all_reduce") -> dict:
    """`plan --micro-batches auto`: evaluate's row for the micro-batch count M that predicts the fastest step, of 1,
    the powers of two below a replica's rows and those rows (micro_parts' bound); the fewest of equal times. A mesh
    with pp = 1 has only M = 1. The mesh is priced once; only the timing is computed per M."""
    top = micro_parts(mesh, batch, batch)
    counts = sorted({1, top, *(2 ** k for k in range(1, top.bit_length()) if 2 ** k < top)})
    rows = _evaluate(cfg, sizes, mesh, batch, context, dtype, device_memory, device, counts, dispatch)
    return min(rows, key=lambda row: row["predicted"]["step_s"])  # min keeps the first (fewest) of equal times


def _evaluate(cfg: K3Config, sizes: Sizes, mesh: Mesh, batch: int, context: int, dtype: str, device_memory: int,
              device: Device, counts: list[int], dispatch: str) -> list[dict]:
    """evaluate's row for each micro-batch count of `counts`: the memory and bytes once, the timing per count."""
    plan = make_plan(cfg, mesh, dispatch)
    w = DTYPE_BYTES[dtype]
    group_rows = plan.rank_rows(batch, 0)[2]  # all-to-all: a group's rows
    counts = [min(micro_parts(mesh, batch, m), group_rows) for m in counts]
    worst: dict | None = None
    total = dict.fromkeys(COLLECTIVES, 0)
    longest = None  # the longest context every rank holds at this batch: only the MLA cache grows per token
    # per count, (replica, stage) -> its slowest rank's predicted seconds a step
    stages: list[dict[tuple[int, int], float]] = [{} for _ in counts]
    for r, count in alike_ranks(plan, batch):
        p, b = plan.rank(r), plan.rank_rows(batch, r)[2]
        mem = {**rank_weights(cfg, sizes, p, w), **rank_state(cfg, p, b, context, w),
               "activations": rank_activations(cfg, p, b, w)}
        row = {"rank": r, "bytes": mem, "total": sum(mem.values())}
        if worst is None or (row["total"], -r) > (worst["total"], -worst["rank"]):
            worst = row
        per_token = rank_state(cfg, p, b, 1, w)["mla_cache"]
        if per_token:
            fixed = row["total"] - mem["mla_cache"]
            holds = max(0, (device_memory - fixed) // per_token)
            longest = holds if longest is None else min(longest, holds)
        moved = step_bytes(cfg, plan, r, batch, w, tp_key=True)
        for k in total:
            total[k] += count * moved[k]
        for parts, times in zip(counts, stages):
            part = -(-b // parts)  # the largest micro-batch's rows; its collectives carry that share of the bytes
            routed = part * (mesh.ep if plan.dispatch == "all_to_all" else 1)  # the rows whose picks reach this rank
            seconds = max(rank_read_bytes(cfg, sizes, p, part, context, w) / device.bandwidth,
                          rank_flops(cfg, sizes, p, part, routed, context) / device.flops) + link_seconds(
                {k: v * part / b for k, v in moved.items()}, mesh, device)
            times[(p.replica, p.stage)] = max(times.get((p.replica, p.stage), 0.0), seconds)
    a2a = {"latent": 0.0, "full_width": 0.0}
    if mesh.ep > 1 and dispatch == "all_reduce":  # the other dispatch on the same mesh, latent and hidden width
        other = make_plan(cfg, mesh, "all_to_all")
        latent = full = 0
        for r, count in alike_ranks(other, batch):
            latent += count * step_bytes(cfg, other, r, batch, w)["all_to_all"]
            full += count * step_bytes(cfg, other, r, batch, w, cfg.hidden_size)["all_to_all"]
        a2a = {"latent": latent / batch, "full_width": full / batch}
    assert worst is not None
    rows = []
    for parts, times in zip(counts, stages):
        per_stage = [[times[(d, st)] for st in range(mesh.pp)] for d in range(mesh.dp) if (d, 0) in times]
        step = max(max(parts * max(t), sum(t)) for t in per_stage)  # the slowest stage's M, or one micro-batch's
        rows.append({                                                   # way through every stage
            "mesh": str(mesh), "dispatch": dispatch, "tp": mesh.tp, "ep": mesh.ep, "pp": mesh.pp, "dp": mesh.dp,
            "cuts": list(plan.cuts),
            "fullest_rank": worst["rank"], "device_bytes": worst["bytes"], "device_total": worst["total"],
            "fits": worst["total"] <= device_memory,
            "max_context": min(longest, cfg.max_position_embeddings) if longest is not None
            else cfg.max_position_embeddings,
            "bytes_per_token": {k: v / batch for k, v in total.items()}, "all_to_all_per_token": a2a,
            "predicted": {"step_s": step, "tokens_per_s": batch / step,
                          "stage_s": [max(times[(d, st)] for d in range(mesh.dp) if (d, st) in times)
                                      for st in range(mesh.pp)], "micro_batches": parts,
                          "device_bandwidth": device.bandwidth, "link_bandwidth": device.link,
                          "device_flops": device.flops}})
    return rows


def does_not_fit(row: dict, device_memory: int) -> str:
    """The sentence naming what does not fit on the fullest device of a row."""
    parts = ", ".join(f"{k} {v / 2**30:,.1f}" for k, v in row["device_bytes"].items() if v)
    return (f"mesh {row['mesh']}: rank {row['fullest_rank']} needs {row['device_total'] / 2**30:,.1f} GiB ({parts} "
            f"GiB), more than the {device_memory / 2**30:,.1f} GiB of a device")
