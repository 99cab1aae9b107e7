"""Loading a subset of a checkpoint (what one rank of an expert- or pipeline-parallel mesh needs): only the selected
tensors are read, and they are the full model's tensors, feeding the same computations."""

from __future__ import annotations

import pytest
import torch
from builders import tiny_model

import k3compile.checkpoint as checkpoint
from k3compile.checkpoint import CheckpointError, load_state, save_checkpoint
from k3compile.model.state_dict_adapter import Selection
from k3compile.ops.latent_moe_dispatch import latent_moe_dispatch


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    folder = tmp_path_factory.mktemp("ckpt")
    model = tiny_model()
    save_checkpoint(model, folder, max_shard_bytes=150_000)  # sharded: the reader must pick files by name
    return model, folder


@pytest.fixture
def reads(monkeypatch):
    """The names of the tensors read from the safetensors files."""
    names: list[str] = []
    real = checkpoint.safe_open

    class Recording:
        def __init__(self, *a, **k):
            self.h = real(*a, **k)

        def __enter__(self):
            self.inner = self.h.__enter__()
            return self

        def __exit__(self, *exc):
            return self.h.__exit__(*exc)

        def get_tensor(self, name):
            names.append(name)
            return self.inner.get_tensor(name)

        def __getattr__(self, attr):  # keys, get_slice (the header scan) pass through unrecorded
            return getattr(self.inner, attr)

    monkeypatch.setattr(checkpoint, "safe_open", Recording)
    return names


def test_expert_slice_reads_only_its_experts_and_gives_the_same_partial_sums(saved, reads):
    model, folder = saved
    cfg = model.config
    lo, hi = 2, 6
    _, state, _ = load_state(folder, select=Selection(experts=(lo, hi)))
    experts_read = {int(n.split(".experts.")[1].split(".")[0]) for n in reads if ".experts." in n}
    assert experts_read == set(range(lo, hi))
    n_moe = cfg.num_hidden_layers - cfg.first_k_dense_replace
    # 3 tensors (w1, w2, w3) x 2 parts (packed, scale) per expert per MoE layer
    assert sum(".experts." in n for n in reads) == n_moe * (hi - lo) * 3 * 2
    full = dict(model.state_dict())
    z = torch.randn(9, cfg.latent_size)
    idx = torch.stack([torch.randperm(cfg.num_experts)[: cfg.num_experts_per_token] for _ in range(9)])
    w = torch.rand(9, cfg.num_experts_per_token)
    args = (cfg.hidden_act, cfg.activation_situ_beta, cfg.activation_situ_linear_beta, "none")
    for layer in range(cfg.first_k_dense_replace, cfg.num_hidden_layers):
        base = f"model.layers.{layer}.block_sparse_moe.experts."
        part = [state[base + k] for k in ("w13_packed", "w2_packed", "w13_scale", "w2_scale")]
        whole = [full[base + k] for k in ("w13_packed", "w2_packed", "w13_scale", "w2_scale")]
        for a, b in zip(part, whole):
            assert torch.equal(a, b[lo:hi])  # the full model's experts lo..hi-1, stacked in order
        got = latent_moe_dispatch(z, idx, w, part[0], part[1], part[2], part[3], lo, *args)
        want = latent_moe_dispatch(z, idx, w, *(t[lo:hi] for t in whole), lo, *args)
        assert torch.equal(got, want)
        # and the slices partition the whole op: fp32 sums of the same terms in another order
        rest = [latent_moe_dispatch(z, idx, w, *(t[a:b] for t in whole), a, *args) for a, b in ((0, lo), (hi, 8))]
        total = latent_moe_dispatch(z, idx, w, *whole, 0, *args)
        torch.testing.assert_close(got + rest[0] + rest[1], total, rtol=1e-6, atol=1e-6)


def test_layer_range_reads_only_its_layers(saved, reads):
    model, folder = saved
    _, state, _ = load_state(folder, select=Selection(layers=(2, 5)))
    layers = {int(n.split(".layers.")[1].split(".")[0]) for n in reads if ".layers." in n}
    assert layers == {2, 3, 4}
    assert not any("embed_tokens" in n or "lm_head" in n or n.endswith("model.norm.weight") for n in reads)
    full = model.state_dict()
    want = {k for k in full if k.startswith(tuple(f"model.layers.{i}." for i in (2, 3, 4)))}
    assert set(state) == want
    assert all(torch.equal(state[k], full[k]) for k in want)


def test_first_and_last_stage_take_the_embedding_and_the_head(saved):
    model, folder = saved
    n = model.config.num_hidden_layers
    first = load_state(folder, select=Selection(layers=(0, 2)))[1]
    last = load_state(folder, select=Selection(layers=(2, n)))[1]
    assert "model.embed_tokens.weight" in first and "lm_head.weight" not in first
    assert "lm_head.weight" in last and "model.norm.weight" in last and "model.embed_tokens.weight" not in last


@pytest.mark.parametrize("select", [Selection(layers=(3, 2)), Selection(experts=(0, 9)), Selection(layers=(0, 8))])
def test_bad_selection_is_named(saved, select):
    with pytest.raises(CheckpointError, match="expected a range"):
        load_state(saved[1], select=select)
