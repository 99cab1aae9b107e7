"""The mesh, the shard plan and its cost (k3compile/sharding/), the sliced model, the sharded manifest's reader and
`k3compile plan`: no TVM build here (tests/export/test_sharded.py runs the builds)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from k3compile.interface import ExportError, sha256_file
from k3compile.presets import preset
from k3compile.sharding import Mesh, PlanError, ShardPlan, carry_names, make_plan
from k3compile.sharding.cost import Sizes, evaluate, rank_flops, rank_weights, step_bytes
from k3compile.sharding.plan import even_slices, stage_cuts


def test_mesh_parse():
    assert Mesh.parse("ep=4,pp=2") == Mesh(4, 2, 1) and Mesh.parse(" pp=3 ") == Mesh(1, 3, 1)
    assert Mesh.parse("dp=2,ep=2").size == 4 and str(Mesh.parse("pp=2,ep=2")) == "ep=2,pp=2"
    assert Mesh.parse("ep=2,tp=2") == Mesh(2, 1, 1, 2) and str(Mesh(2, 2, 1, 2)) == "tp=2,ep=2,pp=2"
    for bad in ("ep=0", "ep=2,ep=3", "tp=0", "tp=2,tp=2", "xp=2", "ep=two", "ep"):
        with pytest.raises(PlanError):
            Mesh.parse(bad)


def test_ranks_are_numbered_replica_stage_shard():
    mesh = Mesh(ep=3, pp=2, dp=2)
    assert [mesh.coords(r) for r in (0, 2, 3, 7, 11)] == [(0, 0, 0), (0, 0, 2), (0, 1, 0), (1, 0, 1), (1, 1, 2)]
    assert all(mesh.rank(*mesh.coords(r)) == r for r in range(mesh.size))


@given(tp=st.integers(1, 4), ep=st.integers(1, 5), pp=st.integers(1, 3), dp=st.integers(1, 3),
       dispatch=st.sampled_from(["all_reduce", "all_to_all"]))
def test_each_group_is_the_ranks_its_coordinates_name(tp, ep, pp, dp, dispatch):
    """The plan's groups (built as runs of rank numbers, for `plan`'s walks over thousands of ranks) against the
    definition by coordinates: a stage group shares (replica, stage), a tp group also its shard's row group, a
    replica its replica; a token source is the first shard of a last-stage row group."""
    mesh = Mesh(ep, pp, dp, tp)
    plan = ShardPlan(mesh, (0,) * (pp + 1), ((0, 0),) * mesh.group, (), dispatch)
    every = [(x, *mesh.coords(x)) for x in range(mesh.size)]
    for r, d, s, g in every:
        assert plan.ep_group(r) == [x for x, d2, s2, _ in every if (d2, s2) == (d, s)]
        assert plan.tp_group(r) == [x for x, d2, s2, g2 in every if (d2, s2, g2 // tp) == (d, s, g // tp)]
    for d in range(dp):
        assert plan.replica_group(d) == [x for x, d2, _, _ in every if d2 == d]
        groups = ep if dispatch == "all_to_all" else 1
        assert plan.token_sources(d) == [x for x, d2, s2, g2 in every
                                         if (d2, s2) == (d, pp - 1) and g2 % tp == 0 and g2 // tp < groups]


def test_expert_slices_are_contiguous_and_as_even_as_possible():
    assert even_slices(8, 3) == [(0, 3), (3, 6), (6, 8)]
    assert even_slices(896, 64) == [(14 * i, 14 * i + 14) for i in range(64)]


def test_stage_cuts_sit_on_attnres_block_edges():
    k3 = preset("k3")  # 93 layers, blocks of 12
    assert stage_cuts(k3, 8) == [0, 12, 24, 36, 48, 60, 72, 84, 93]
    assert stage_cuts(preset("k3-tiny"), 2) == [0, 4, 7]  # 3.5 -> the edge 4 (blocks of 2)
    assert stage_cuts(preset("k3-tiny").replace(attn_res_block_size=None), 3) == [0, 2, 5, 7]  # balanced
    cuts = stage_cuts(k3, 64)  # more stages than blocks: balanced, every stage non-empty
    assert len(cuts) == 65 and all(b > a for a, b in zip(cuts, cuts[1:])) and cuts[-1] == 93


def test_the_carry_holds_the_closed_blocks():
    tiny = preset("k3-tiny")  # blocks of 2: layers 0, 2, 4, 6 close a block on entry
    assert carry_names(tiny, 0) == ["hidden"]
    assert carry_names(tiny, 4) == ["hidden", "bank.0", "bank.1"]
    assert carry_names(tiny, 5) == ["hidden", "bank.0", "bank.1", "bank.2"]
    assert carry_names(tiny.replace(attn_res_block_size=None), 4) == ["hidden"]


def test_schedule_of_a_rank():
    cfg = preset("k3-tiny")
    plan = make_plan(cfg, Mesh(2, 2))
    steps = plan.schedule(1, cfg)  # stage 0, shard 1
    assert [s["op"] for s in steps] == ["run", "send", "broadcast"]
    assert [c["tag"] for c in steps[0]["collectives"]] == [1, 2, 3] and steps[0]["collectives"][0]["group"] == [0, 1]
    assert steps[1] == {"op": "send", "to": 3, "tensors": ["hidden", "bank.0", "bank.1"]}
    assert steps[2]["from"] == 2 and steps[2]["group"] == [0, 1, 2, 3]
    last = plan.schedule(3, cfg)
    assert [s["op"] for s in last] == ["recv", "run", "broadcast"] and last[0]["from"] == 1
    assert make_plan(cfg, Mesh(1, 2)).schedule(0, cfg)[0]["collectives"] == []  # no ep: no all-reduce


def test_all_to_all_splits_the_rows_and_every_last_shard_broadcasts():
    cfg = preset("k3-tiny")
    plan = make_plan(cfg, Mesh(3, 1, 2), "all_to_all")
    assert [plan.rank_rows(7, r) for r in range(6)] == [(0, 2, 2), (2, 3, 2), (3, 4, 2), (4, 5, 1), (5, 6, 1),
                                                        (6, 7, 1)]  # replicas of 4 and 3 rows, padded per group
    steps = plan.schedule(4, cfg)
    calls = steps[0]["collectives"]
    assert [(c["op"], c["tag"], c["part"], c["tensor"]) for c in calls[:3]] == [
        ("all_to_all", 1, 0, "dispatch"), ("all_to_all", 1, 1, "outputs"), ("all_to_all", 2, 0, "dispatch")]
    assert [s["from"] for s in steps if s["op"] == "broadcast"] == [3, 4, 5]
    assert make_plan(cfg, Mesh(3, 1, 2)).rank_rows(7, 4) == (4, 7, 3)  # all-reduce: the replica's rows
    with pytest.raises(PlanError, match="needs ep > 1"):
        make_plan(cfg, Mesh(1, 2), "all_to_all")
    with pytest.raises(PlanError, match="not one of"):
        make_plan(cfg, Mesh(2), "broadcast")


def test_all_to_all_exchange_equals_the_whole_moe():
    """Two ranks (threads) exchanging through an in-process all-to-all, each with its own rows: their routed sums
    together are the whole layer's."""
    import threading

    from builders import in_threads

    from k3compile.checkpoint import assemble
    from k3compile.partition import RankSource, rank_model

    src = RankSource("k3-tiny", 0, "auto")
    cfg = src.rank_config()
    plan = make_plan(cfg, Mesh(2), "all_to_all")
    whole = assemble(cfg, src.state(cfg, plan.rank(0), make_plan(cfg, Mesh(1)))).model.layers[3].block_sparse_moe
    x = torch.randn(6, cfg.hidden_size)
    idx, w = whole.gate(x)
    want = whole.routed_partial(x, idx, w)
    moes = [rank_model(cfg, src.state(cfg, p, plan), p, True, plan).model.layers[3].block_sparse_moe
            for p in plan.ranks()]
    local, barrier, slots, got = threading.local(), threading.Barrier(2), {}, {}

    def exchange(op, t, out, tag, part):
        assert op == "all_to_all" and tag == 3
        slots[local.rank] = t.clone()
        barrier.wait()
        out.copy_(torch.stack([slots[r][local.rank] for r in range(2)]))
        barrier.wait()

    def rank(r):
        local.rank = r
        rows = slice(3 * r, 3 * r + 3)
        got[r] = moes[r].routed_partial(x[rows], idx[rows], w[rows])

    in_threads(exchange, rank, 2)
    torch.testing.assert_close(torch.cat([got[0], got[1]]), want, rtol=0, atol=1e-6)  # fp32: slot sums reordered


def test_meshes_that_cannot_split_are_refused():
    cfg = preset("k3-tiny")
    for mesh, words in ((Mesh(9), "8 experts"), (Mesh(1, 8), "7 layers"), (Mesh(0), "integer >= 1")):
        with pytest.raises(PlanError, match=words):
            make_plan(cfg, mesh)
    with pytest.raises(PlanError, match="no MoE layer"):
        make_plan(cfg.replace(num_experts=0, first_k_dense_replace=7), Mesh(2))


def test_plan_record_round_trip_and_tamper():
    cfg = preset("k3-tiny")
    plan = make_plan(cfg, Mesh(3, 2))
    assert ShardPlan.from_record(json.loads(json.dumps(plan.as_record())), cfg) == plan
    doc = plan.as_record()
    doc["cuts"] = [0, 3, 7]
    with pytest.raises(PlanError, match="not the plan"):
        ShardPlan.from_record(doc, cfg)
    with pytest.raises(PlanError, match="malformed"):
        ShardPlan.from_record({"mesh": {"ep": 2, "zz": 1}}, cfg)


def test_expert_slices_sum_to_the_whole_moe():
    """The sliced model (partition.rank_model: a rank's tensors only, indices local to the slice) summed over the
    ranks of ep=3 equals the whole layer's routed sum (before the latent norm, where the runtime all-reduces)."""
    from k3compile.partition import RankSource, rank_model

    src = RankSource("k3-tiny", 0, "auto")
    cfg = src.rank_config()
    plan = make_plan(cfg, Mesh(3))
    full = src.state(cfg, plan.rank(0), make_plan(cfg, Mesh(1)))
    from k3compile.checkpoint import assemble

    whole = assemble(cfg, full).model.layers[2].block_sparse_moe
    x = torch.randn(5, cfg.hidden_size)
    idx, w = whole.gate(x)
    want = whole.routed_partial(x, idx, w)
    parts = []
    for p in plan.ranks():
        moe = rank_model(cfg, src.state(cfg, p, plan), p, sliced=True).model.layers[2].block_sparse_moe
        assert moe.experts.w13_packed.shape[0] == p.experts[1] - p.experts[0]
        parts.append(moe.routed_partial(x, idx, w))
    assert all(p.abs().sum() > 0 for p in parts)  # every slice gets tokens at these sizes
    torch.testing.assert_close(sum(parts), want, rtol=0, atol=1e-6)  # fp32, three partial sums added


def test_weights_per_rank_add_up_to_the_published_size():
    """Stage by stage, the plan's weight bytes (bf16 dense, MXFP4 experts) add up to sizing.py's count of the whole
    model, and one rank's expert bytes are the published expert size times its slice (written out here)."""
    from k3compile.sizing import model_size

    k3 = preset("k3")
    sizes = Sizes.of(k3)
    plan = make_plan(k3, Mesh(1, 4))
    assert sum(sum(rank_weights(k3, sizes, p, 2).values()) for p in plan.ranks()) == model_size(k3).bytes
    p0 = make_plan(k3, Mesh(8, 8)).rank(0)  # layers [0, 12): layer 0 dense, 11 MoE layers; experts [0, 112)
    per_expert = 3 * 3072 * 3584 * 17 // 32  # W13 and W2: 4-bit codes + one E8M0 byte per 32
    assert rank_weights(k3, sizes, p0, 2)["experts_mxfp4"] == 11 * 112 * per_expert


def test_latent_dispatch_moves_half_the_bytes_of_full_width_on_k3():
    k3 = preset("k3")
    row = evaluate(k3, Sizes.of(k3), Mesh(16, 4), batch=4, context=8192, dtype="bf16", device_memory=64 << 30)
    a2a = row["all_to_all_per_token"]
    # each of the 16 ranks of a stage holds one row padded (4 rows over 16), i.e. 16 slots, and 56 of the 896
    # experts: per MoE layer it sends each of the 15 others an int64 count, then under uniform routing 15/16 of its
    # slots go out (bf16 latent vector, fp32 id and weight) and the 15 others' 16 slots each land here with
    # probability 1/16, whose bf16 outputs go back
    per_slot = 3584 * 2 + 4 + 4 + 3584 * 2
    assert a2a["latent"] == 92 * 16 * (15 * 8 + 15 * per_slot) / 4
    assert a2a["full_width"] == 92 * 16 * (15 * 8 + 15 * (7168 * 2 + 4 + 4 + 7168 * 2)) / 4
    assert abs(a2a["latent"] / a2a["full_width"] - 0.5) < 1e-3  # 3584 / 7168, plus the ids and weights


def test_the_all_to_all_moves_a_thirtieth_of_the_full_buffers_at_ep_64():
    """#21: `plan k3 --devices 64 --context 131072 --batch 8` priced the ep=64 all-to-all at 10.6 GB a token when
    its buffers held every slot for every rank; moving only the routed slots it must be at most a thirtieth."""
    k3 = preset("k3")
    row = evaluate(k3, Sizes.of(k3), Mesh(64), batch=8, context=131072, dtype="bf16", device_memory=64 << 30)
    full_buffers = 92 * 64 * 63 * 16 * (3584 * 2 + 8 + 2 + 3584 * 2) / 8  # the record's: one padded row a rank,
    assert 10.6e9 < full_buffers < 10.7e9  # 16 slots in each of 63 blocks (bf16 vectors, int64 id, bf16 weight)
    # 14 experts a rank: a count to each of the 63 others, 63/64 of its 16 slots out (15.75 bf16 latent vectors,
    # fp32 ids and weights), 63 x 16 x 1/64 outputs back
    layer = 63 * 8 + 15.75 * (3584 * 2 + 8) + 63 * 16 / 64 * 3584 * 2
    assert row["all_to_all_per_token"]["latent"] == 92 * 64 * layer / 8
    assert row["all_to_all_per_token"]["latent"] <= full_buffers / 30


def test_the_predicted_decode_step_follows_the_hand_rule_on_k3():
    """Stage 0 of ep=8,pp=8 (layers [0, 12): layer 0 dense, 11 MoE; MLA at 3, 7, 11; 112 experts a rank), batch 8,
    context 131072, bf16, on a 1 TB/s device with 100 GB/s links, written out by hand: the bytes one rank reads
    over the bandwidth plus its collectives over the link."""
    from k3compile.sharding.cost import Device, step_bytes

    k3 = preset("k3")
    sizes = Sizes.of(k3)
    mesh, b, ctx = Mesh(8, 8), 8, 131072
    dev = Device(bandwidth=1e12, link=1e11)
    row = evaluate(k3, sizes, mesh, batch=b, context=ctx, dtype="bf16", device_memory=64 << 30, device=dev)
    p = make_plan(k3, mesh).rank(0)
    per_expert = 3 * 3072 * 3584 * 17 // 32  # MXFP4 W13 + W2 of one expert (codes and scales)
    touched = 1 - (1 - 1 / 896) ** (b * 16)  # uniform routing: an expert of the slice hit by any of 8 x 16 picks
    dense = rank_weights(k3, sizes, p, 2)["dense"] - 163840 * 7168 * 2 + b * 7168 * 2  # one embedding row a token
    mla = 3 * b * (ctx + 1) * (512 + 64) * 2  # three MLA layers' latent + RoPE cache read, one position written
    kda = 2 * 9 * b * (3 * 96 * 128 * 3 * 2 + 96 * 128 * 128 * 4)  # nine KDA layers' conv + recurrent state, r + w
    read = dense + round(11 * 112 * per_expert * touched) + mla + kda
    moved = step_bytes(k3, make_plan(k3, mesh), 0, b, 2)
    assert moved["all_reduce"] == 11 * b * 3584 * 2  # each MoE layer's latent partial sums
    link = (moved["all_reduce"] * 2 * 7 / 8 + moved["send"]) / 1e11  # a ring all-reduce sends 2(n-1)/n of it
    assert row["predicted"]["stage_s"][0] == pytest.approx(read / 1e12 + link, rel=1e-9)
    assert row["predicted"]["step_s"] == pytest.approx(sum(row["predicted"]["stage_s"]), rel=1e-12)
    assert row["predicted"]["tokens_per_s"] == pytest.approx(b / row["predicted"]["step_s"])
    faster = evaluate(k3, sizes, mesh, batch=b, context=ctx, dtype="bf16", device_memory=64 << 30,
                      device=Device(bandwidth=2e12, link=1e11))
    assert faster["predicted"]["step_s"] < row["predicted"]["step_s"]

    # 4 micro-batches of 2 rows (run --micro-batches 4): a stage reads its dense weights for each, its experts as
    # 2 x 16 picks touch them, its states and caches for 2 rows, its collectives carry 2/8 of the step's bytes; the
    # step is the longer of the slowest stage's 4 micro-batches and one micro-batch's way through the 8 stages
    mb = evaluate(k3, sizes, mesh, batch=b, context=ctx, dtype="bf16", device_memory=64 << 30, device=dev,
                  micro_batches=4)
    touched = 1 - (1 - 1 / 896) ** (2 * 16)
    read = (rank_weights(k3, sizes, p, 2)["dense"] - 163840 * 7168 * 2 + 2 * 7168 * 2 + round(
        11 * 112 * per_expert * touched) + 3 * 2 * (ctx + 1) * (512 + 64) * 2
        + 2 * 9 * 2 * (3 * 96 * 128 * 3 * 2 + 96 * 128 * 128 * 4))
    stages = mb["predicted"]["stage_s"]
    assert mb["predicted"]["micro_batches"] == 4
    assert stages[0] == pytest.approx(read / 1e12 + link * 2 / 8, rel=1e-9)
    assert mb["predicted"]["step_s"] == pytest.approx(max(4 * max(stages), sum(stages)), rel=1e-12)
    # memory-bound: a micro-batch reads nearly a whole batch's bytes, but 4 of them fill 8 stages' idle time
    assert mb["predicted"]["step_s"] == pytest.approx(sum(stages), rel=1e-12)
    assert mb["predicted"]["step_s"] < row["predicted"]["step_s"]
    more = evaluate(k3, sizes, mesh, batch=b, context=ctx, dtype="bf16", device_memory=64 << 30, device=dev,
                    micro_batches=8)  # 8 of one row: as many as stages, each reading the weights once more
    assert more["predicted"]["step_s"] == pytest.approx(8 * max(more["predicted"]["stage_s"]), rel=1e-12)
    one_stage = evaluate(k3, sizes, Mesh(64), batch=b, context=ctx, dtype="bf16", device_memory=64 << 30,
                         device=dev, micro_batches=4)
    assert one_stage["predicted"]["micro_batches"] == 1  # nothing to overlap at pp = 1
    # the stage's compute (rank_flops over the default 312 TFLOP/s) is below its reads here: the rule above is whole
    assert rank_flops(k3, sizes, p, b, b, ctx) / dev.flops < read / 1e12


def test_the_compute_term_follows_the_hand_rule_and_bounds_a_compute_bound_stage():
    """rank_flops for stage 0 of ep=8,pp=8 on K3 written out by hand (2 per dense element and row but the
    embedding's; 2 per element of each expert picked on the rank; MLA's absorbed attention over the context; KDA's
    state work), and a device slow enough to compute that the stage takes its compute time, not its reads."""
    from k3compile.sharding.cost import Device

    k3 = preset("k3")
    sizes = Sizes.of(k3)
    mesh, b, ctx = Mesh(8, 8), 8, 131072
    p = make_plan(k3, mesh).rank(0)
    dense = rank_weights(k3, sizes, p, 1)["dense"] - 163840 * 7168  # elements, the embedding left out
    per_expert = 3 * 3072 * 3584  # W13 + W2 of one expert
    experts = 2 * b * 16 * (112 / 896) * 11 * 896 * per_expert / 896  # 11 MoE layers, 112 of 896 experts here
    attention = 3 * 2 * ctx * 96 * (2 * 512 + 64) + 9 * 8 * 96 * 128 * 128  # 3 MLA layers, 9 KDA; 96 heads each
    want = 2 * b * dense + experts + b * attention
    assert rank_flops(k3, sizes, p, b, b, ctx) == pytest.approx(want, rel=1e-12)  # float sums of exact integers
    slow = Device(bandwidth=1e12, link=1e11, flops=1e12)
    row = evaluate(k3, sizes, mesh, batch=b, context=ctx, dtype="bf16", device_memory=64 << 30, device=slow)
    link = row["predicted"]["stage_s"][0] - rank_flops(k3, sizes, p, b, b, ctx) / 1e12
    moved = step_bytes(k3, make_plan(k3, mesh), 0, b, 2)
    assert link == pytest.approx((moved["all_reduce"] * 2 * 7 / 8 + moved["send"]) / 1e11, rel=1e-6)


def test_micro_batches_auto_takes_the_fastest_count():
    """`plan --micro-batches auto` (fastest_micro_batches): each mesh's row is evaluate's at the count of 1, 2, 4,
    ..., a replica's rows that predicts the fastest step; at K3's 131072-token context a stage's time is mostly its
    rows' MLA caches, so with stages to overlap it takes M > 1, and at pp = 1 it stays 1."""
    from k3compile.sharding.cost import fastest_micro_batches

    k3 = preset("k3")
    sizes = Sizes.of(k3)
    for mesh in (Mesh(1, 2, 2, 16), Mesh(8, 8), Mesh(64)):
        best = fastest_micro_batches(k3, sizes, mesh, 8, 131072, "bf16", 64 << 30)
        each = {m: evaluate(k3, sizes, mesh, 8, 131072, "bf16", 64 << 30, micro_batches=m)["predicted"]["step_s"]
                for m in (1, 2, 4, 8)}
        assert best["predicted"]["step_s"] == min(each.values())
        assert best["predicted"]["micro_batches"] == min(m for m, t in each.items() if t == min(each.values())) \
            or mesh.pp == 1
    assert fastest_micro_batches(k3, sizes, Mesh(1, 2, 2, 16), 8, 131072, "bf16", 64 << 30)[
        "predicted"]["micro_batches"] > 1
    assert fastest_micro_batches(k3, sizes, Mesh(64), 8, 131072, "bf16", 64 << 30)["predicted"]["micro_batches"] == 1
    res = _plan("k3", "--devices", "64", "--context", "131072", "--batch", "8", "--micro-batches", "auto", "--json")
    assert res.returncode == 0, res.stderr
    doc = json.loads(res.stdout)
    assert doc["micro_batches"] == "auto" and any(r["predicted"]["micro_batches"] > 1 for r in doc["meshes"])
    res = _plan("k3", "--devices", "64", "--micro-batches", "most")
    assert res.returncode == 2 and "neither a count" in res.stderr and "Traceback" not in res.stderr


def _plan(*args):
    return subprocess.run([sys.executable, "-m", "k3compile.cli", "plan", *args], capture_output=True, text=True)


def test_plan_cli_table_json_and_refusal():
    res = _plan("k3", "--devices", "64", "--batch", "4", "--json")
    assert res.returncode == 0, res.stderr
    doc = json.loads(res.stdout)
    assert {r["mesh"] for r in doc["meshes"]} >= {"ep=64", "ep=8,pp=8", "pp=64"}
    # latent = half the full width, but for what both move alike: ids, weights, and a count to each other rank
    # (63 x 8 bytes a layer at ep=64 beside ~16 x 7,168 of vectors: < 1 %)
    assert all(abs(r["all_to_all_per_token"]["latent"] * 2 / r["all_to_all_per_token"]["full_width"] - 1) < 1e-2
               for r in doc["meshes"] if r["ep"] > 1 and r["tp"] == 1)  # tp > 1: no all-to-all yet
    assert any(r["fits"] for r in doc["meshes"]) and not all(r["fits"] for r in doc["meshes"])
    res = _plan("k3", "--devices", "64", "--batch", "4", "--micro-batches", "2", "--json")
    assert res.returncode == 0, res.stderr
    assert {(r["pp"] > 1) + 1 for r in json.loads(res.stdout)["meshes"]} == \
        {r["predicted"]["micro_batches"] for r in json.loads(res.stdout)["meshes"]} == {1, 2}
    for args, why in ((["--mesh", "ep=64", "--micro-batches", "2"], "no stages to overlap (pp=1)"),
                      (["--mesh", "ep=8,pp=8", "--micro-batches", "5"], "above the 4 rows a replica")):
        res = _plan("k3", "--devices", "64", "--batch", "4", *args)
        assert res.returncode == 1 and res.stderr.count("Error:") == 1 and why in res.stderr, res.stderr
    res = _plan("k3", "--devices", "8", "--mesh", "ep=8")
    assert res.returncode == 1 and res.stdout == "" and res.stderr.count("Error:") == 1
    assert "rank 0 needs" in res.stderr and "experts_mxfp4" in res.stderr and "64.0 GiB" in res.stderr
    res = _plan("k3", "--devices", "6", "--mesh", "ep=4")
    assert res.returncode == 1 and "does not divide 6 devices" in res.stderr
    table = _plan("k3-tiny", "--devices", "4")
    assert table.returncode == 0 and "ep=4" in table.stdout and "pp=4" in table.stdout
    res = _plan("k3", "--devices", "64", "--device-memory", "64", "--context", "131072", "--batch", "8",
                "--device-bandwidth", "1600", "--link-bandwidth", "100", "--json")
    doc = json.loads(res.stdout)
    assert doc["device_bandwidth"] == 1.6e12 and doc["link_bandwidth"] == 1e11
    keys = [(not r["fits"], r["predicted"]["step_s"]) for r in doc["meshes"]]
    assert keys == sorted(keys) and not keys[0][0]  # the meshes that fit first, fastest first
    assert all(r["predicted"]["tokens_per_s"] == pytest.approx(8 / r["predicted"]["step_s"]) for r in doc["meshes"])
    res = _plan("k3", "--devices", "64", "--link-bandwidth", "0")
    assert res.returncode == 2 and "Traceback" not in res.stderr


# ---- the sharded manifest's reader, fuzzed -------------------------------------------------------------------------

def _fake_sharded(folder):
    """A sharded folder whose files are placeholders but whose manifest is what export_sharded writes."""
    from k3compile.manifest import MANIFEST, rank_dir, rank_io
    from k3compile.manifest import SHARDED_KIND as KIND

    cfg = preset("k3-tiny")
    plan = make_plan(cfg, Mesh(2, 2))
    cfg.save(folder / "config.json")
    ranks = []
    for p in plan.ranks():
        (folder / rank_dir(p.rank)).mkdir()
        for name in ("model.so", "weights.safetensors"):
            (folder / rank_dir(p.rank) / name).write_bytes(f"{p.rank}{name}".encode())
        inputs, outputs = rank_io(cfg, p, True)
        ranks.append({"rank": p.rank, "layers": list(p.layers), "experts": list(p.experts), "inputs": inputs,
                      "outputs": outputs, "params": ["w"], "library": f"{rank_dir(p.rank)}/model.so",
                      "weights": f"{rank_dir(p.rank)}/weights.safetensors", "schedule": plan.schedule(p.rank, cfg)})
    files = {f.relative_to(folder).as_posix(): sha256_file(f) for f in sorted(folder.rglob("*")) if f.is_file()}
    doc = {"k3compile": "x", "kind": KIND, "plan": plan.as_record(), "ranks": ranks, "files": files}
    (folder / MANIFEST).write_text(json.dumps(doc))
    return doc


def test_the_fake_sharded_folder_reads(tmp_path):
    from k3compile.manifest import read_sharded

    doc = _fake_sharded(tmp_path)
    assert read_sharded(tmp_path)[0] == doc and read_sharded(tmp_path, rank=1)[2].mesh == Mesh(2, 2)


def _mutations():
    leaf = st.one_of(st.none(), st.booleans(), st.integers(-3, 10), st.text(max_size=8),
                     st.lists(st.integers(0, 8), max_size=3))
    return st.lists(st.tuples(st.lists(st.sampled_from(["plan", "ranks", "files", "mesh", "cuts", "expert_slices",
                                                        0, 1, 3, "layers", "experts", "schedule", "inputs",
                                                        "library", "rank", "kind", "ep", "pp"]),
                                       min_size=1, max_size=4), leaf), min_size=1, max_size=3)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(_mutations())
def test_read_sharded_refuses_edited_manifests_with_one_error(tmp_path_factory, edits):
    from k3compile.manifest import MANIFEST, read_sharded

    folder = tmp_path_factory.mktemp("fuzz")
    doc = _fake_sharded(folder)
    changed = json.loads(json.dumps(doc))
    for path, value in edits:
        node = changed
        for key in path[:-1]:
            node = node.get(key) if isinstance(node, dict) else node[key] if isinstance(node, list) and \
                isinstance(key, int) and key < len(node) else None
            if node is None:
                break
        last = path[-1]
        if isinstance(node, dict) and last in node:  # an edit of what is there (unknown keys are ignored)
            node[last] = value
        elif isinstance(node, list) and isinstance(last, int) and last < len(node):
            node[last] = value
    (folder / MANIFEST).write_text(json.dumps(changed))
    try:
        read_sharded(folder)
    except ExportError:
        return
    assert changed == doc  # only an unchanged manifest may read


class _WalkRank:
    """A one-stage stand-in for runtime.worker.Rank (its own token source) whose model maps each row's last token t
    to 3t + 1 mod 11: from 1, 2, 4 or 7 the walk reaches token 0 (EOS here) within four steps; from 3 or 5 never."""

    VOCAB = 11
    p = type("P", (), {"rank": 0, "last": True})()

    def __init__(self) -> None:
        self.stats = type("S", (), {"counting": None, "add": staticmethod(lambda *a: None)})()
        self.calls: list[int] = []  # each forward's rows

    sources = [0]

    def forward(self, ids, mask, past):
        assert ids.shape[0] == mask.shape[0] == past[0].shape[0]
        self.calls.append(ids.shape[0])
        nxt = torch.nn.functional.one_hot((ids[:, -1] * 3 + 1) % self.VOCAB, self.VOCAB).float()
        return [nxt[:, None].expand(-1, ids.shape[1], -1), *past], 1

    def picked(self, last, pick, pick_across=None):
        return pick(last)

    def broadcast_async(self, t, src):
        return type("Done", (), {"wait": staticmethod(lambda: True)})()

    def _talk(self, what, peers, fn, *args, **kw):
        return fn(*args, **kw)


@pytest.mark.parametrize("prompts,padded,new", [
    ([[5, 1], [3], [2, 7], [4]], 4, 9),  # rows end at different steps, two never
    ([[1], [7], [4, 2], [2]], 5, 12),    # every row ends before max-new-tokens (one padding row): the loop stops
    ([[3], [5], [1]], 3, 0),             # no step at all
])
@pytest.mark.parametrize("micro_batches", [2, 3])
def test_micro_batched_decode_keeps_decode_loops_tokens(prompts, padded, new, micro_batches):
    """Rank.decode_micro (run --micro-batches: each micro-batch's tokens broadcast as soon as it ran, taken when the
    next step reaches it) against decoding.decode_loop on the same model: the same tokens per row, EOS kept and
    nothing after it; every step runs M micro-batches of the rank's padded rows; when every row has ended, at most
    one step more than decode_loop's."""
    import numpy as np

    from k3compile.decoding import decode_loop
    from k3compile.runtime.worker import Rank

    pad, eos, n = 0, 0, len(prompts)
    want = decode_loop(lambda ids, mask, i: (ids[:, -1] * 3 + 1) % _WalkRank.VOCAB, prompts, new, pad, eos)
    rank = _WalkRank()
    got, states = Rank.decode_micro(rank, prompts, new, pad, eos, [torch.zeros(padded, 1)], (0, n, padded),
                                    [(0, n, padded)], micro_batches, lambda logits, i: logits.argmax(-1))
    assert got.tokens == want.tokens and any(t[-1:] == [eos] for t in want.tokens) == (new > 0)
    assert len(states) == micro_batches and sum(s[0].shape[0] for s in states) == padded
    parts = [b - a for a, b in even_slices(padded, micro_batches)]
    steps = len(rank.calls) // micro_batches
    assert rank.calls == parts * steps
    assert steps == (0 if new == 0 else 1 + want.decode_steps + (want.decode_steps + 1 < new))
    assert np.isfinite(got.decode_s)


def test_run_micro_batches_auto_is_the_stage_count_within_the_smallest_replica():
    """`run --micro-batches auto` (its default): pp micro-batches, at most the rows of the smallest replica (batch //
    dp), 1 without stages: the hand rule on meshes where each bound decides."""
    from k3compile.sharding.plan import auto_micro_batches

    assert auto_micro_batches(Mesh(ep=2), 8) == 1  # pp = 1: nothing to overlap
    assert auto_micro_batches(Mesh(ep=2, pp=2), 3) == 2  # pp
    assert auto_micro_batches(Mesh(pp=4), 3) == 3  # the rows
    assert auto_micro_batches(Mesh(pp=2, dp=2), 3) == 1  # replicas of 2 and 1 rows: the smaller
    assert auto_micro_batches(Mesh(pp=8, dp=2, tp=2), 64) == 8
    assert auto_micro_batches(Mesh(pp=2), 1) == 1
