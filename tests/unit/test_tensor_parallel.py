"""Tensor parallelism (k3compile/sharding/tensor.py, the tp degree of sharding/plan.py): the ranks' eager models, run
side by side in threads whose all-reduce sums what the group's threads hand it, decode what the whole model decodes
(k3-tiny, and a Kimi-Linear checkpoint written by transformers); each rank's state is its heads' share of the whole
one; the plan's memory is what a rank's model holds; meshes tp does not divide are refused naming the widths. No TVM
build here: tests/export/test_sharded.py runs the built ranks."""

from __future__ import annotations

import threading

import pytest
import torch
from builders import build_hf, in_threads
from hypothesis import given, settings
from hypothesis import strategies as st

from k3compile.generate import left_pad
from k3compile.partition import RankSource, rank_model
from k3compile.presets import preset
from k3compile.sharding import Mesh, PlanError, make_plan
from k3compile.sharding.cost import Sizes, rank_state, rank_weights, step_bytes
from k3compile.sharding.tensor import rank_config, state_join, state_piece
from k3compile.source import load_model

# Left-padded below; ids in both halves of each vocabulary (98 and 256 ids: tp=2's embedding and head slices)
PROMPTS = {"hf": [[5, 17, 42, 9], [3, 77], [60, 4, 8]], "k3-tiny": [[5, 17, 242, 9], [3, 177], [60, 4, 8]]}
# The ranks' logits and states against the whole model's: a split matmul's partial sums added by the all-reduce
# round in another order than one matmul over the whole width (fp32, values of order 1: observed <= 3e-7); a wrong
# head slice or a missing sum moves them by O(0.1).
ATOL = 1e-5


def threaded(cfg, source: RankSource, plan, fn) -> dict:
    """fn(model, whole, rank) on every rank of plan's single stage, each in a thread; the all-reduces sum the tensors
    the threads of the call's group hand in (part 0: the stage's ep · tp ranks, else the tp group), an all-to-all
    gives each rank the blocks the stage's ranks address to it, and whole(logits) joins the tp group's vocabulary
    slices in t order. {rank: result}."""
    mesh = plan.mesh
    assert mesh.pp == mesh.dp == 1
    local, barrier, handed, out = threading.local(), threading.Barrier(mesh.size), {}, {}
    calls: dict[int, list] = {r: [] for r in range(mesh.size)}

    def collective(op, x, result, tag, part):
        r = local.rank
        calls[r].append((op, tag, part))
        handed[r] = x.clone()
        barrier.wait()
        if op == "all_reduce":
            group = plan.ep_group(r) if part == 0 else plan.tp_group(r)
            result.copy_(sum(handed[g] for g in group))
        else:  # all_to_all over the stage: block s of the result is what its rank s sent this rank
            group = plan.ep_group(r)
            result.copy_(torch.stack([handed[g][group.index(r)] for g in group]))
        barrier.wait()

    def whole(logits):
        r = local.rank
        handed[r] = logits.clone()
        barrier.wait()
        joined = torch.cat([handed[g] for g in plan.tp_group(r)], dim=-1)
        barrier.wait()
        return joined

    def run(r):
        local.rank = r
        p = plan.rank(r)
        try:
            with torch.no_grad():
                out[r] = fn(rank_model(cfg, source.state(cfg, p, plan), p, mesh.group > 1, plan), whole, r)
        except BaseException:
            barrier.abort()  # the other threads stop waiting for this one
            raise

    in_threads(collective, run, mesh.size)
    schedule = {r: [(c["op"], c["tag"], c["part"]) for s in plan.schedule(r, cfg) if s["op"] == "run"
                    for c in s["collectives"]] for r in range(mesh.size)}
    steps = {r: len(calls[r]) // max(1, len(schedule[r])) for r in calls}
    assert all(calls[r] == schedule[r] * steps[r] for r in calls)  # the schedule's calls, in its order, each step
    return out


def decode(prompts, model, whole=lambda x: x, steps: int = 3, rows=None):
    """Prefill the left-padded prompts, then `steps` greedy tokens: (every step's logits, the final state). `whole`:
    the whole vocabulary's logits from the model's (a tp rank's: its slice). `rows`: (first, end, padded) of the
    batch this model decodes (plan.rank_rows: an all-to-all rank's rows, padded by repeating the last)."""
    from k3compile.runtime.worker import own_rows

    ids, mask = left_pad(prompts, 0)
    if rows is not None:
        ids, mask = own_rows(ids, *rows), own_rows(mask, *rows)
    past, logits = model.init_past(ids.shape[0]), []
    for _ in range(steps + 1):
        out, past = model(ids, mask, past)
        out = whole(out)
        logits.append(out)
        ids = out[:, -1:].argmax(-1)
        mask = torch.cat([mask, torch.ones_like(ids)], dim=1)
    return logits, past


@pytest.fixture(scope="module")
def hf_folder(tmp_path_factory):
    """A float-expert Kimi-Linear checkpoint written by transformers, with head counts and a vocabulary tp=2
    divides."""
    folder = tmp_path_factory.mktemp("hf") / "kimi-linear"
    build_hf(folder, q_lora_rank=24, heads=4, kda_heads=2, head_dim=8, vocab=98)
    return str(folder)


@pytest.mark.parametrize("model,mesh,dispatch", [
    ("k3-tiny", "tp=2", "all_reduce"), ("k3-tiny", "tp=2,ep=2", "all_reduce"), ("hf", "tp=2", "all_reduce"),
    ("k3-tiny", "tp=2,ep=2", "all_to_all"), ("hf", "tp=2,ep=2", "all_to_all")])
def test_tp_ranks_decode_what_the_whole_model_decodes(model, mesh, dispatch, hf_folder):
    """A left-padded batch of three, prefill and 3 decode steps: every rank's logits equal the whole model's, and
    each rank's final state is its heads' share (KDA) or the whole cache (MLA) of the whole model's. With the
    all-to-all each tp group decodes its row group's rows (two rows and one padded to two), each of its ranks
    dispatching its share of their slots (K3's latent MoE, and Kimi-Linear's at the hidden width)."""
    name = hf_folder if model == "hf" else model
    whole = load_model(name)
    want_logits, want_past = decode(PROMPTS[model], whole)
    source = RankSource(name, 0, "auto")
    cfg = source.rank_config()
    plan = make_plan(cfg, Mesh.parse(mesh), dispatch)
    rows = {r: plan.rank_rows(len(PROMPTS[model]), r) for r in range(plan.mesh.size)}
    got = threaded(cfg, source, plan, lambda m, joined, r: decode(
        PROMPTS[model], m, joined, rows=rows[r] if dispatch == "all_to_all" else None))
    for r, (logits, past) in got.items():
        p = plan.rank(r)
        lo, hi, _ = rows[r]
        assert len(past) == cfg.num_hidden_layers
        for step, (a, b) in enumerate(zip(logits, want_logits)):
            torch.testing.assert_close(a[:hi - lo], b[lo:hi], rtol=0, atol=ATOL, msg=f"rank {r} step {step}")
        for i, (mine, full) in enumerate(zip(past, want_past)):
            for which in (0, 1):
                expect = state_piece(cfg, i, which, full[which][lo:hi], p.tensor, p.tp)
                assert mine[which][:hi - lo].shape == expect.shape
                torch.testing.assert_close(mine[which][:hi - lo], expect, rtol=0, atol=ATOL, msg=f"rank {r} layer {i}")
        if not cfg.is_mla(1):  # a KDA layer's state is the rank's heads only
            assert past[1][1].shape[1] == cfg.kda_num_heads // plan.mesh.tp


def test_the_plan_prices_what_a_rank_holds_and_moves():
    """A tp=2,ep=2 rank's weight bytes (fp32) are the elements its model holds, its KDA state the shapes its
    config makes, its all-reduce bytes per step the rule: the embedding's lookups [rows, D], per layer an attention
    output [rows, D], a dense MLP's or a MoE layer's output [rows, D] (shared experts and latent up projection), and
    a MoE layer's latent partial sums and its down projection's partial latent [rows, D_e] each (fp32); the token
    source's tp partner gathers its half of the vocabulary's logits there."""
    cfg = preset("k3-tiny")
    source = RankSource("k3-tiny", 0, "auto")
    plan = make_plan(cfg, Mesh.parse("tp=2,ep=2"))
    sizes = Sizes.of(cfg)
    for p in plan.ranks():
        model = rank_model(cfg, source.state(cfg, p, plan), p, True, plan)
        held = sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()]
                   if t.dtype != torch.int32)  # but the slice's offset (a graph input, not a weight)
        assert sum(rank_weights(cfg, sizes, p, 4).values()) == held
        state = sum(t.numel() * 4 for pair in model.init_past(3) for t in pair if t.dim() == 3 and t.shape[1] != 0
                    or t.dim() == 4)
        assert rank_state(cfg, p, 3, 0, 4)["kda_state"] == state
        rows, d, de = 3, cfg.hidden_size, cfg.latent_size
        moe = sum(cfg.is_moe(i) for i in range(cfg.num_hidden_layers))
        rule = rows * 4 * (d + cfg.num_hidden_layers * d + cfg.num_hidden_layers * d + 2 * moe * de)
        moved = step_bytes(cfg, plan, p.rank, rows)
        assert moved["all_reduce"] == rule
        assert moved["gather"] == (rows * cfg.vocab_size // 2 * 4 if p.rank == 1 else 0)  # rank 0 is the source
        greedy = step_bytes(cfg, plan, p.rank, rows, greedy=True)  # a distributed argmax: 3 float64 a row
        assert greedy == {**moved, "gather": rows * 24 if p.rank == 1 else 0}


@settings(max_examples=200, deadline=None)
@given(tp=st.sampled_from([1, 2, 4]), rows=st.integers(1, 4), width=st.integers(1, 6), levels=st.integers(1, 4),
       seed=st.integers(0, 2**16), bad=st.sampled_from([None, float("nan"), float("inf"), float("-inf")]),
       where=st.integers(0, 2**16))
def test_a_distributed_argmax_picks_the_whole_vocabularys_first_greatest_logit(tp, rows, width, levels, seed, bad,
                                                                                 where):
    """Each rank's argmax rows of its vocabulary slice (slice_argmax), joined at the source (join_argmax), give
    torch.argmax over the whole row, ties (few distinct values) included: the first greatest logit; a non-finite
    logit anywhere in any slice is reported, as the whole-vocabulary check reports it."""
    from k3compile.sharding.tensor import join_argmax, slice_argmax

    g = torch.Generator().manual_seed(seed)
    logits = torch.randint(0, levels, (rows, tp * width), generator=g).float() / 4 - 1
    if bad is not None:
        logits.view(-1)[where % logits.numel()] = bad
    pieces = [slice_argmax(piece, t * width) for t, piece in enumerate(logits.split(width, dim=-1))]
    tokens, finite = join_argmax(pieces)
    assert finite == bool(torch.isfinite(logits).all())
    if finite:
        assert torch.equal(tokens, logits.argmax(-1))


@pytest.mark.parametrize("mesh,named", [
    ("tp=3", ["does not divide k3-tiny's 2 KDA heads (kda_num_heads), 2 MLA heads"]),
    ("tp=4,ep=4", ["8 experts cannot be split over ep x tp = 16"]),
])
def test_a_tp_that_does_not_divide_is_refused_naming_the_widths(mesh, named):
    with pytest.raises(PlanError) as e:
        make_plan(preset("k3-tiny"), Mesh.parse(mesh))
    assert all(n in str(e.value) for n in named), e.value


@pytest.mark.parametrize("batch", [3, 4, 5])
def test_the_all_to_all_with_tp_splits_rows_by_group_and_slots_by_rank(batch):
    """tp=2,ep=2 with the all-to-all on k3-tiny (top-2 of 8 experts, two a shard): shards 0, 1 are row group 0 and
    2, 3 row group 1, each group's rows the even split padded to the first's count; the token sources are each
    group's first shard, to which its partner gathers. Per MoE layer the schedule is the down projection's
    all-reduce over tp, the two all-to-alls over the stage's four ranks, the routed sums' all-reduce over tp, then
    the output's. The plan's all-to-all bytes, under uniform routing, by the hand rule: a rank sends one of each of
    its group's rows' two slots (the i-th for i mod 2 = t), of which 6/8 leave it, with 3 int64 counts; its 2/8 of
    the experts get the slots that the other three ranks send, whose outputs go back."""
    from fractions import Fraction

    from k3compile.sharding.plan import AR_ATTENTION, AR_FFN, AR_LATENT_IN, AR_ROUTED, even_slices

    cfg = preset("k3-tiny")
    plan = make_plan(cfg, Mesh.parse("tp=2,ep=2"), "all_to_all")
    assert plan.token_sources(0) == [0, 2]
    groups = even_slices(batch, 2)
    padded = groups[0][1] - groups[0][0]
    for r in range(4):
        assert plan.rank_rows(batch, r) == (*groups[r // 2], padded)
        sched = plan.schedule(r, cfg)
        assert [s["op"] for s in sched] == ["run", "gather", "broadcast", "broadcast"]
        assert sched[1] == {"op": "gather", "to": r - r % 2, "group": [r - r % 2, r - r % 2 + 1],
                            "tensors": ["logits"]}
        tp = plan.tp_group(r)
        want = [("all_reduce", 0, 3, tp)]  # the embedding's lookups
        for i in range(cfg.num_hidden_layers):
            want.append(("all_reduce", i, AR_ATTENTION, tp))
            if cfg.is_moe(i):
                want += [("all_reduce", i, AR_LATENT_IN, tp), ("all_to_all", i, 0, [0, 1, 2, 3]),
                         ("all_to_all", i, 1, [0, 1, 2, 3]), ("all_reduce", i, AR_ROUTED, tp)]
            want.append(("all_reduce", i, AR_FFN, tp))
        assert [(c["op"], c["tag"], c["part"], c["group"]) for c in sched[0]["collectives"]] == want
        k, de, e = cfg.num_experts_per_token, cfg.latent_size, cfg.num_experts
        slots = padded * k
        own = padded * len([i for i in range(k) if i % 2 == r % 2])
        here = Fraction(2, e)
        per_layer = 3 * 8 + round(own * (1 - here) * (de * 4 + 8)) + round((2 * slots - own) * here * de * 4)
        moe = sum(cfg.is_moe(i) for i in range(cfg.num_hidden_layers))
        assert step_bytes(cfg, plan, r, batch)["all_to_all"] == moe * per_layer


@settings(max_examples=50, deadline=None)
@given(tp=st.sampled_from([1, 2, 4]), heads=st.integers(1, 3), k=st.integers(1, 4), rows=st.integers(1, 3),
       past=st.integers(0, 3))
def test_state_pieces_join_back_to_the_whole(tp, heads, k, rows, past):
    """state_join(state_piece(x, t) for every t) == x, and each piece holds exactly its heads' channels."""
    cfg = preset("k3-tiny").replace(kda_num_heads=heads * tp, kda_head_dim=k, num_attention_heads=tp)
    h = heads * tp
    conv = torch.randn(rows, 3 * h * k, 3)
    rec = torch.randn(rows, h, k, k)
    latent = torch.randn(rows, past, 5)
    for layer, which, x in ((0, 0, conv), (0, 1, rec), (3, 0, latent)):  # layer 3 is MLA in k3-tiny
        pieces = [state_piece(cfg, layer, which, x, t, tp) for t in range(tp)]
        assert torch.equal(state_join(cfg, layer, which, pieces), x)
    local = rank_config(cfg, tp)
    for t in range(tp):  # q, k and v channels of heads [t·heads, (t+1)·heads)
        piece = state_piece(cfg, 0, 0, conv, t, tp)
        assert piece.shape == (rows, 3 * local.kda_num_heads * k, 3)
        for part in range(3):
            lo = part * h * k + t * heads * k
            assert torch.equal(piece[:, part * heads * k:(part + 1) * heads * k], conv[:, lo:lo + heads * k])


def test_k3_on_64_devices_fits_with_tp_ep_and_two_stages_at_most():
    """The issue's scale target: `plan k3 --devices 64 --device-memory 64 --context 131072 --batch 8` lists a mesh
    with tp > 1, ep > 1 and pp <= 2 that fits."""
    import json

    from click.testing import CliRunner

    from k3compile.cli import main

    res = CliRunner().invoke(main, ["plan", "k3", "--devices", "64", "--device-memory", "64", "--context", "131072",
                                    "--batch", "8", "--json"])
    assert res.exit_code == 0, res.output
    rows = json.loads(res.output)["meshes"]
    fits = [r for r in rows if r["fits"] and r["tp"] > 1 and r["ep"] > 1 and r["pp"] <= 2]
    assert fits, [r["mesh"] for r in rows if r["fits"]]
    assert all(r["device_total"] <= 64 * 2**30 for r in fits)
    assert not any(r["fits"] for r in rows if r["tp"] == 1 and r["pp"] <= 2)  # what tp adds: ep alone needs 157 GiB


def test_plan_prices_each_meshs_all_to_all_beside_its_all_reduce():
    """`plan --dispatch all-reduce,all-to-all`: every mesh with ep > 1 whose row groups all get a row at this batch
    also as an all-to-all row. There a rank holds its row group's rows (2 of tp=16,ep=4's 8), so its KDA state and
    MLA cache are a quarter of the all-reduce rank's, and its all-to-all bytes are the alternative the all-reduce
    row prices; such meshes rank on their own predicted step. A mesh or batch the all-to-all cannot run is one
    line."""
    import json

    from click.testing import CliRunner

    from k3compile.cli import main

    args = ["plan", "k3", "--devices", "64", "--device-memory", "64", "--context", "131072", "--batch", "8"]
    res = CliRunner().invoke(main, [*args, "--dispatch", "all-reduce,all-to-all", "--json"])
    assert res.exit_code == 0, res.output
    rows = json.loads(res.output)["meshes"]
    by = {(r["mesh"], r["dispatch"]): r for r in rows}
    a2a = [r for r in rows if r["dispatch"] == "all_to_all"]
    assert a2a and all(r["ep"] > 1 and r["ep"] * r["dp"] <= 8 for r in a2a)
    assert {r["mesh"] for r in a2a} == {r["mesh"] for r in rows if r["dispatch"] == "all_reduce" and r["ep"] > 1
                                        and r["ep"] * r["dp"] <= 8}
    mine, other = by[("tp=16,ep=4", "all_to_all")], by[("tp=16,ep=4", "all_reduce")]
    for kind in ("kda_state", "mla_cache"):
        assert mine["device_bytes"][kind] * 4 == other["device_bytes"][kind]
    assert mine["bytes_per_token"]["all_to_all"] == other["all_to_all_per_token"]["latent"] > 0
    fitting = [r["predicted"]["step_s"] for r in rows if r["fits"]]
    assert fitting == sorted(fitting)
    for extra, why in ((["--mesh", "tp=8,pp=4"], "all-to-all dispatch needs ep > 1"),
                       (["--mesh", "tp=4,ep=8", "--batch", "4"], "needs a batch of at least 16")):
        res = CliRunner().invoke(main, [*args[:-2], *extra, *([] if "--batch" in extra else args[-2:]),
                                        "--dispatch", "all-to-all"])
        assert res.exit_code != 0 and why in res.output, res.output


def test_a_tp_ranks_schedule_and_record():
    """tp=2,pp=2 on k3-tiny: ranks 0, 1 the first stage (the embedding's all-reduce first, then per layer the
    attention's, the MoE's down projection's over tp and latent sums over the stage's group, the MLP's or the MoE
    layer's output), ranks 2, 3 the last,
    rank 3 gathering its logits at rank 2 (the token source); the record names tp only when it is > 1, so the
    plans of artifacts built before tp read back unchanged."""
    from k3compile.sharding.plan import AR_ATTENTION, AR_EMBED, AR_FFN, AR_LATENT, AR_LATENT_IN, ShardPlan

    cfg = preset("k3-tiny")
    plan = make_plan(cfg, Mesh.parse("tp=2,pp=2"))
    assert plan.tp_group(1) == [0, 1] and plan.ep_group(3) == [2, 3] and plan.token_sources(0) == [2]
    first = plan.schedule(1, cfg)
    assert [s["op"] for s in first] == ["run", "send", "broadcast"]
    a, b = plan.rank(1).layers
    want = [(0, AR_EMBED, [0, 1])]
    for i in range(a, b):
        want.append((i, AR_ATTENTION, [0, 1]))
        if cfg.is_moe(i):  # the latent down projection's partial latent over tp, then the experts' over the stage
            want += [(i, AR_LATENT_IN, [0, 1]), (i, AR_LATENT, [0, 1])]
        want.append((i, AR_FFN, [0, 1]))  # a MoE layer's: the shared experts' and the latent up projection's
    assert [(c["tag"], c["part"], c["group"]) for c in first[0]["collectives"]] == want
    assert [s["op"] for s in plan.schedule(3, cfg)] == ["recv", "run", "gather", "broadcast"]
    assert plan.schedule(3, cfg)[2] == {"op": "gather", "to": 2, "group": [2, 3], "tensors": ["logits"]}
    assert ShardPlan.from_record(plan.as_record(), cfg) == plan and plan.as_record()["mesh"]["tp"] == 2
    assert "tp" not in make_plan(cfg, Mesh.parse("ep=2")).as_record()["mesh"]
