"""The whole K3-mode model (k3-tiny: every feature on): cached decode equals the full forward, a left-padded batch
equals each sequence alone, and torch.export traces it with the k3 ops as single nodes (tier 1)."""

from __future__ import annotations

import torch
from builders import tiny_model

from k3compile.backends.eager import EagerBackend
from k3compile.generate import generate

# fp32; chunked prefill vs token-by-token recurrence and absorbed vs naive MLA reassociate sums: ~1e-6 observed.
TOL = dict(atol=1e-4, rtol=1e-4)


def test_tiny_preset_exercises_every_feature():
    m = tiny_model()
    cfg = m.config
    layers = m.model.layers
    assert hasattr(layers[0], "mlp") and all(hasattr(layer, "block_sparse_moe") for layer in layers[1:])
    assert cfg.is_mla(cfg.num_hidden_layers - 1) and cfg.is_mla(cfg.num_hidden_layers - 2)
    assert any(not cfg.is_mla(i) for i in range(cfg.num_hidden_layers))
    assert -(-cfg.num_hidden_layers // cfg.attn_res_block_size) >= 3  # >= 3 AttnRes blocks
    moe = layers[1].block_sparse_moe
    assert moe.experts.mxfp4 and cfg.num_shared_experts >= 1 and cfg.latent_moe_use_norm
    assert cfg.gate_lower_bound == -5.0 and cfg.use_full_rank_gate and cfg.mla_use_output_gate
    assert cfg.hidden_act == "situ" and cfg.q_lora_rank


@torch.no_grad()
def test_cached_decode_equals_full_forward():
    m = tiny_model()
    ids = torch.randint(0, m.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(1))
    full, _ = m(ids)
    logits, past = m(ids[:, :7])
    steps = [logits]
    for i in range(7, 12):
        logits, past = m(ids[:, i:i + 1], past=past)
        steps.append(logits)
    torch.testing.assert_close(torch.cat(steps, 1), full, **TOL)
    # a multi-token continuation (chunked again, on a non-empty state) too
    logits_a, past_a = m(ids[:, :5])
    logits_b, _ = m(ids[:, 5:], past=past_a)
    torch.testing.assert_close(torch.cat([logits_a, logits_b], 1), full, **TOL)


@torch.no_grad()
def test_left_padded_batch_equals_each_sequence_alone():
    m = tiny_model()
    prompts = [[5, 9, 33, 4, 100, 7, 8], [17, 3], [250, 1, 66, 90]]
    batch = generate(EagerBackend(m), prompts, max_new_tokens=6, keep_logits=True)
    for i, p in enumerate(prompts):
        alone = generate(EagerBackend(m), [p], max_new_tokens=6, keep_logits=True)
        assert alone.tokens[0] == batch.tokens[i]
        for step_b, step_a in zip(batch.logits, alone.logits):
            torch.testing.assert_close(step_b[i], step_a[0], **TOL)


@torch.no_grad()
def test_padding_changes_no_state():
    m = tiny_model()
    ids = torch.tensor([[0, 0, 0, 11, 12, 13]])
    mask = torch.tensor([[0, 0, 0, 1, 1, 1]])
    _, past_pad = m(ids[:, :3], mask[:, :3])  # only padding
    for i, st in enumerate(past_pad):
        if not m.config.is_mla(i):
            assert all(torch.count_nonzero(t) == 0 for t in st)  # KDA conv and recurrent state stay zero


def test_torch_export_keeps_k3_ops_as_single_nodes():
    m = tiny_model()
    ids = torch.randint(0, m.config.vocab_size, (2, 5))
    ep = torch.export.export(m, (ids,), strict=False)
    targets = [str(n.target) for n in ep.graph.nodes if n.op == "call_function"]
    n_kda = sum(1 for t in targets if "k3.kda_recurrence" in t)
    n_moe = sum(1 for t in targets if "k3.latent_moe_dispatch" in t)
    cfg = m.config
    assert n_kda == len(cfg.kda_layers)
    assert n_moe == cfg.num_hidden_layers - cfg.first_k_dense_replace
    out, _ = ep.module()(ids)
    torch.testing.assert_close(out, m(ids)[0], **TOL)


def test_attention_mask_must_span_past_and_new_tokens():
    import pytest

    m = tiny_model()
    ids = torch.tensor([[5, 6, 7, 8]])
    with torch.no_grad():
        _, past = m(ids[:, :3])
        with pytest.raises(ValueError, match=r"attention_mask must be \[B, past \+ new\] = \[1, 4\]"):
            m(ids[:, 3:], torch.ones(1, 1, dtype=torch.long), past)
