"""The row and shape arithmetic both sides of a sharded server use (runtime/worker.py's serve protocol,
backends/sharded.py): over meshes and batches (Hypothesis), a GET reassembles every row of every layer's state
exactly once, the logits come back for every row exactly once, each rank's rows are what the worker's `own_rows`
gives it, and the shapes the ranks allocate are the graph interface's. And the all-to-all's bf16 wire rows
(`run --wire-dtype bf16`): the ids and weights come back bit for bit, the vectors as torch rounds them to bf16."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from k3compile.interface import init_past
from k3compile.presets import load_config
from k3compile.runtime.worker import holds_rows, host_rows, own_rows, state_shapes, wire_rows
from k3compile.sharding import Mesh, PlanError, make_plan

CFG = load_config("k3-tiny")


@settings(max_examples=200, deadline=None)
@given(ep=st.integers(1, 4), pp=st.integers(1, 3), dp=st.integers(1, 3), a2a=st.booleans(), extra=st.integers(0, 9),
       tp=st.sampled_from([1, 1, 2]))
def test_every_row_of_every_layer_once(ep, pp, dp, a2a, extra, tp):
    """(With tp > 1: every row of every layer once from each tensor-parallel index, its heads' share.)"""
    try:
        plan = make_plan(CFG, Mesh(ep=ep, pp=pp, dp=dp, tp=tp), "all_to_all" if a2a else "all_reduce")
    except PlanError:
        return  # a mesh the model cannot be split over: refused before any rank starts (tested in test_sharding)
    min_rows = plan.mesh.dp * len(plan.token_sources(0))  # ShardedBackend.min_rows
    batch = min_rows + extra
    for layer in range(CFG.num_hidden_layers):
        for t in range(plan.mesh.tp):
            rows = sorted(r for rank in range(plan.mesh.size) if holds_rows(plan, rank)
                          and plan.rank(rank).tensor == t
                          and plan.rank(rank).layers[0] <= layer < plan.rank(rank).layers[1]
                          for r in range(*plan.rank_rows(batch, rank)[:2]))
            assert rows == list(range(batch)), (plan.mesh, plan.dispatch, layer, t)
    logits = sorted(r for d in range(plan.mesh.dp) for rank in plan.token_sources(d)
                    for r in range(*plan.rank_rows(batch, rank)[:2]))
    assert logits == list(range(batch))
    for rank in range(plan.mesh.size):
        lo, hi, padded = plan.rank_rows(batch, rank)
        assert 0 < hi - lo <= padded  # every rank has a row once the batch is padded to min_rows
        x = torch.arange(batch * 2).reshape(batch, 2)
        mine = own_rows(x, lo, hi, padded)
        assert mine.shape == (padded, 2) and torch.equal(mine[:hi - lo], x[lo:hi])
        assert all(torch.equal(row, x[hi - 1]) for row in mine[hi - lo:])


@pytest.mark.parametrize("rows,length", [(1, 0), (3, 5)])
def test_state_shapes_are_the_interfaces(rows, length):
    want = []
    for i, (a, b) in enumerate(init_past(CFG, rows)):
        for t in (a, b):
            shape = list(t.shape)
            if CFG.is_mla(i):
                shape[1] = length
            want.append(tuple(shape))
    assert state_shapes(CFG, (0, CFG.num_hidden_layers), rows, length) == want
    assert state_shapes(CFG, (1, 3), rows, length) == want[2:6]


@settings(max_examples=100, deadline=None)
@given(rows=st.integers(0, 6), width=st.integers(1, 9), dispatch=st.booleans(), seed=st.integers(0, 2**16),
       ids=st.lists(st.integers(-1, 2**24 - 1), min_size=6, max_size=6))
def test_bf16_wire_rows_keep_ids_and_weights_exact(rows, width, dispatch, seed, ids):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, width + 2, generator=g) * 10 ** torch.randint(-30, 30, (rows, 1), generator=g).float()
    if dispatch:  # a dispatch row ends with its expert id (exact in fp32 below 2**24) and weight
        x[:, -2] = torch.tensor(ids[:rows], dtype=torch.float32)
    sent = wire_rows(x, dispatch)
    assert sent.dtype == torch.bfloat16 and sent.shape == (rows, width + 4 if dispatch else width + 2)
    back = host_rows(sent, dispatch)
    assert back.dtype == torch.float32 and back.shape == x.shape
    vectors = slice(0, width) if dispatch else slice(None)
    assert torch.equal(back[:, vectors], x[:, vectors].to(torch.bfloat16).float())
    if dispatch:
        assert torch.equal(back[:, -2:].view(torch.int32), x[:, -2:].view(torch.int32))  # the bits, NaN-proof
