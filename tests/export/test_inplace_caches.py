"""MLA's decode caches kept in place (passes/inplace_caches.py, backends/tvm.py; docs/architecture.md, "In-place
decode caches"): the artifact's `main_inplace` against its functional `main`, step by step, on the written k3-tiny
artifact; and the phase on hand-built modules (which caches it takes, which it leaves)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import tvm
from k3compile.passes.inplace_caches import INPLACE_FUNC, inplace_caches
from k3compile.targets import resolve
from tvm import relax

import k3compile.backends.tvm as tvm_backend
from k3compile.backends.eager import EagerBackend
from k3compile.backends.tvm import TvmBackend
from k3compile.generate import left_pad
from k3compile.interface import flatten
from k3compile.modes import Forms

PROMPTS = [[5, 17, 200, 3, 9, 9, 41], [1, 2], [250, 251, 252, 253]]


def _pair(artifact):
    inplace, functional = TvmBackend(artifact), TvmBackend(artifact)
    assert inplace.inplace  # the artifact has main_inplace
    functional.inplace = False  # the same library's main: concatenated caches
    return inplace, functional


def _same(a, b) -> None:
    """Both functions run the same kernels on the same rows: equal bit for bit."""
    for x, y in zip(flatten(a) if isinstance(a, list) else [a], flatten(b) if isinstance(b, list) else [b]):
        assert x.shape == y.shape and torch.equal(x, y)


def test_200_decode_steps_in_place_equal_the_functional_path(tvm_artifact, monkeypatch):
    """A left-padded batch of three, 200 greedy steps: every step's logits and every layer's state equal `main`'s;
    the buffers start at 16 rows and double four times (16 -> 256) with the rows kept; between doublings a step
    writes into the same memory (nothing copied) and returns views of it."""
    monkeypatch.setattr(tvm_backend, "MIN_CAPACITY", 16)
    inplace, functional = _pair(tvm_artifact[1])
    cfg = inplace.config
    mla = [i for i in range(cfg.num_hidden_layers) if cfg.is_mla(i)]
    ids, mask = left_pad(PROMPTS, 0)
    past_i, past_f = inplace.init_past(3), functional.init_past(3)
    capacities, moved = [], 0
    for step in range(201):
        before = past_i[mla[0]][0].data_ptr()
        logits_i, past_i = inplace.step(ids, mask, past_i)
        logits_f, past_f = functional.step(ids, mask, past_f)
        _same(logits_i, logits_f)
        _same(past_i, past_f)
        capacities.append(inplace._caches[-1].capacity)
        if step and past_i[mla[0]][0].data_ptr() != before:
            moved += 1
        for i in mla:  # the present handed out is a view of the buffer main_inplace wrote
            assert past_i[i][0].data_ptr() == inplace._caches[-1].full[i][0].data_ptr()
        ids = logits_f[:, -1].argmax(-1, keepdim=True)
        mask = torch.cat([mask, torch.ones_like(ids)], dim=-1)
    assert past_i[mla[0]][0].shape[1] == len(PROMPTS[0]) + 200
    assert sorted(set(capacities)) == [16, 32, 64, 128, 256] and moved == 4  # grown by doubling, only then moved


def test_a_branch_or_a_foreign_state_is_copied_never_overwritten(tiny_export, tvm_artifact):
    """Two steps from the same state (a branch) each equal the functional path, and neither changes the state
    they started from or the other's result; eager's state fed to the compiled model is taken as given."""
    inplace, functional = _pair(tvm_artifact[1])
    ids, mask = left_pad(PROMPTS, 0)
    _, start = inplace.step(ids, mask, inplace.init_past(3))
    kept = [t.clone() for t in flatten(start)]
    mask = torch.cat([mask, torch.ones(3, 1, dtype=torch.long)], dim=-1)
    a_ids, b_ids = torch.tensor([[7], [8], [9]]), torch.tensor([[100], [101], [102]])
    logits_a, after_a = inplace.step(a_ids, mask, start)
    a_kept = [t.clone() for t in flatten(after_a)]
    logits_b, after_b = inplace.step(b_ids, mask, start)  # the same state again: a branch
    for t, k in zip(flatten(start), kept):
        assert torch.equal(t, k)
    for t, k in zip(flatten(after_a), a_kept):
        assert torch.equal(t, k)
    want_b, state_b = functional.step(b_ids, mask, start)
    _same(logits_b, want_b)
    _same(after_b, state_b)
    # a state from elsewhere: eager's prefill, continued by the compiled model
    eager = EagerBackend(tiny_export[0], Forms.exported())
    ids, mask0 = left_pad(PROMPTS, 0)
    _, past = eager.step(ids, mask0, eager.init_past(3))
    got, state = inplace.step(a_ids, mask, past)
    want, state_f = functional.step(a_ids, mask, past)
    _same(got, want)
    _same(state, state_f)


def test_a_returned_state_goes_back_uncopied_and_edits_to_it_count(tvm_artifact, monkeypatch):
    """The KDA states a step returned go back to the next step as the TVM tensors they view (only the ids and the
    mask are converted); a returned state edited in place (a server clearing a row) is fed as edited, and its
    clone (not returned by the backend) through a copy: all three equal the functional path."""
    inplace, functional = _pair(tvm_artifact[1])
    cfg = inplace.config
    kda = [i for i in range(cfg.num_hidden_layers) if not cfg.is_mla(i)]
    ids, mask = left_pad(PROMPTS, 0)
    _, start = inplace.step(ids, mask, inplace.init_past(3))
    mask = torch.cat([mask, torch.ones(3, 1, dtype=torch.long)], dim=-1)
    step_ids = torch.tensor([[7], [8], [9]])
    converted = []
    real_input = inplace._input
    monkeypatch.setattr(inplace, "_input", lambda x: converted.append(x.shape) or real_input(x))
    got, state = inplace.step(step_ids, mask, start)
    assert len(converted) == 2  # the ids and the mask; no state copied
    want, state_f = functional.step(step_ids, mask, start)
    _same(got, want)
    _same(state, state_f)
    start[kda[0]][1][1].mul_(0.5)  # edited in place: row 1's recurrent state of the first KDA layer
    got, state = inplace.step(step_ids, mask, start)
    want, state_f = functional.step(step_ids, mask, start)
    _same(got, want)
    _same(state, state_f)
    clone = [tuple(t.clone() for t in pair) for pair in start]
    converted.clear()
    got, _ = inplace.step(step_ids, mask, clone)
    assert len(converted) == 2 + 2 * len(kda)  # not the backend's: every KDA state converted
    _same(got, want)


def test_last_position_logits_equal_the_full_ones_and_generate_uses_them(tvm_artifact):
    """`step_last` (main_inplace_last: the LM head on the last position only) gives the last row of `step`'s logits,
    bit for bit (the same row-wise kernel), at prefill and decode; generate, which runs it, gives main's tokens."""
    from k3compile.generate import generate, step_last_of

    inplace, functional = _pair(tvm_artifact[1])
    assert inplace._last and step_last_of(inplace) == inplace.step_last
    ids, mask = left_pad(PROMPTS, 0)
    last, past_l = inplace.step_last(ids, mask, inplace.init_past(3))
    full, past_f = functional.step(ids, mask, functional.init_past(3))
    assert last.shape == (3, 1, full.shape[2])
    _same(last, full[:, -1:])
    _same(past_l, past_f)
    nxt = full[:, -1].argmax(-1, keepdim=True)
    mask = torch.cat([mask, torch.ones_like(nxt)], dim=-1)
    last, _ = inplace.step_last(nxt, mask, past_l)
    full, _ = functional.step(nxt, mask, past_f)
    _same(last, full[:, -1:])
    assert generate(inplace, PROMPTS, 12).tokens == generate(functional, PROMPTS, 12).tokens


def _module(extra_use: bool):
    """main(x [n, t, 2, 16], mask [n, p + t], past [n, p, 16], new [n, t, 16]) -> (the attention output, the cache)
    in MLA's exported form; with `extra_use` the concatenated cache also feeds a sum (no main_inplace then)."""
    bb = relax.BlockBuilder()
    n, t, p = (tvm.tirx.Var(v, "int64") for v in ("batch", "seq", "past"))
    q = relax.Var("q", relax.TensorType([n, t, 2, 16], "float32"))
    mask = relax.Var("attention_mask", relax.TensorType([n, p + t], "int64"))
    past = relax.Var("past_0_latent", relax.TensorType([n, p, 16], "float32"))
    new = relax.Var("new", relax.TensorType([n, t, 16], "float32"))
    with bb.function("main", [q, mask, past, new]):
        with bb.dataflow():
            cache = bb.emit(relax.op.concat([past, new], axis=1))
            scores = bb.emit(relax.op.einsum([q, cache], "bthc,bsc->bhts"))
            weights = bb.emit(relax.op.nn.softmax(scores, axis=-1))
            out = bb.emit(relax.op.einsum([weights, cache], "bhts,bsc->bthc"))
            results = [out, cache]
            if extra_use:
                results.append(bb.emit(relax.op.sum(cache, axis=[1])))
            gv = bb.emit_output(relax.Tuple(results))
        bb.emit_func_output(gv)
    return bb.get()


def test_the_phase_keeps_only_caches_of_the_exported_form():
    tgt = resolve()
    mod = inplace_caches(tgt)(_module(False))
    assert INPLACE_FUNC in [gv.name_hint for gv in mod.get_global_vars()]
    assert "call_tir_inplace" in str(mod[INPLACE_FUNC]) and "R.einsum" not in str(mod[INPLACE_FUNC])
    assert "call_tir_inplace" not in str(mod["main"])  # main is kept as it was
    assert "main_inplace_last" not in [gv.name_hint for gv in mod.get_global_vars()]  # its result is no LM head
    for other in (inplace_caches(tgt)(_module(True)), inplace_caches(resolve("opencl"))(_module(False))):
        assert INPLACE_FUNC not in [gv.name_hint for gv in other.get_global_vars()]
    # built, the in-place function equals main on a buffer of 8 rows holding 3 past rows
    from k3compile.passes.legalize_fuse import legalize_fuse
    from k3compile.passes.schedule import schedule

    with tgt.compiling():
        ex = tvm.compile(schedule(tgt)(legalize_fuse(tgt)(_module(False))), target=tgt.tvm(),
                         relax_pipeline=tvm.transform.Sequential(tgt.finish_passes()))
    vm = relax.VirtualMachine(ex, tvm.cpu())
    rng = np.random.default_rng(0)
    q, past, new = (rng.standard_normal(s, dtype=np.float32) for s in ((2, 2, 2, 16), (2, 3, 16), (2, 2, 16)))
    mask = np.ones((2, 5), np.int64)
    want = vm["main"](*map(tvm.runtime.tensor, (q, mask, past, new)))
    buf = np.full((2, 8, 16), np.nan, np.float32)
    buf[:, :3] = past
    tbuf = tvm.runtime.tensor(buf)
    got = vm[INPLACE_FUNC](tvm.runtime.tensor(q), tvm.runtime.tensor(mask), tbuf, tvm.runtime.tensor(new),
                           tvm.runtime.ShapeTuple([3]))
    np.testing.assert_array_equal(got[0].numpy(), want[0].numpy())
    np.testing.assert_array_equal(tbuf.numpy()[:, :5], want[1].numpy())  # the new rows written in place
    assert np.isnan(tbuf.numpy()[:, 5:]).all()  # and nothing past them
    with pytest.raises(Exception, match="do not fit its capacity"):  # 7 past rows + 2 new in 8
        vm[INPLACE_FUNC](tvm.runtime.tensor(q), tvm.runtime.tensor(np.ones((2, 9), np.int64)), tbuf,
                         tvm.runtime.tensor(new), tvm.runtime.ShapeTuple([7]))
