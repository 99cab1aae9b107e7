"""The whole model against transformers' KimiLinearForCausalLM (tier 2): a random tiny model built and saved by
transformers, loaded by k3compile from its folder, gives the same logits (prefill and cached decode) and the same
greedy tokens, for several configs."""

from __future__ import annotations

import pytest
import torch

from k3compile.checkpoint import load_checkpoint
from k3compile.generate import EagerBackend, generate

# fp32 on both sides; the bound. Observed differences are ~1e-7 (summation order only).
ATOL = 1e-4

CONFIGS = {
    "no-q-lora": dict(q_lora_rank=None, heads=2, kda_heads=2, head_dim=16),
    "q-lora": dict(q_lora_rank=24, heads=4, kda_heads=3, head_dim=8),
    "wide-heads": dict(q_lora_rank=None, heads=1, kda_heads=1, head_dim=32),
}


def build_hf(tmp_path, q_lora_rank, heads, kda_heads, head_dim, seed=0):
    from transformers import KimiLinearConfig, KimiLinearForCausalLM

    cfg = KimiLinearConfig(
        vocab_size=97, hidden_size=48, intermediate_size=64, moe_intermediate_size=24, num_hidden_layers=5,
        num_attention_heads=heads, num_key_value_heads=heads, kv_lora_rank=20, q_lora_rank=q_lora_rank,
        qk_rope_head_dim=8, qk_nope_head_dim=12, v_head_dim=10, num_local_experts=6, num_experts_per_tok=2,
        n_shared_experts=1, routed_scaling_factor=2.446, first_k_dense_replace=1, initializer_range=0.15,
        linear_attn_config={"kda_layers": [1, 2, 3, 5], "full_attn_layers": [4], "num_heads": kda_heads,
                            "head_dim": head_dim, "short_conv_kernel_size": 4},
        pad_token_id=0, bos_token_id=1, eos_token_id=2,
    )
    torch.manual_seed(seed)
    model = KimiLinearForCausalLM(cfg).eval()
    with torch.no_grad():  # exercise the routing bias (init leaves it zero)
        for layer in model.model.layers:
            if hasattr(layer.mlp, "gate"):
                layer.mlp.gate.e_score_correction_bias.copy_(torch.randn(cfg.num_local_experts) * 0.05)
    model.save_pretrained(tmp_path)
    return model


def hf_greedy(model, ids, steps):
    """Greedy decode with transformers' own cache; returns (tokens [B, steps], per-step logits)."""
    out = model(ids, use_cache=True)
    cache, logits = out.cache, [out.logits]
    toks = []
    nxt = out.logits[:, -1].argmax(-1, keepdim=True)
    for _ in range(steps):
        toks.append(nxt)
        out = model(nxt, cache=cache, use_cache=True)
        cache = out.cache
        logits.append(out.logits)
        nxt = out.logits[:, -1].argmax(-1, keepdim=True)
    return torch.cat(toks, 1), logits


@pytest.mark.parametrize("name", list(CONFIGS))
@torch.no_grad()
def test_logits_and_greedy_tokens_match_transformers(tmp_path, name):
    hf = build_hf(tmp_path, **CONFIGS[name])
    ours = load_checkpoint(tmp_path)
    assert ours.config.full_attn_layers == (3,)
    ids = torch.randint(3, 97, (3, 7), generator=torch.Generator().manual_seed(5))
    steps = 6
    hf_toks, hf_logits = hf_greedy(hf, ids, steps)
    # prefill
    logits, past = ours(ids)
    assert (logits - hf_logits[0]).abs().max().item() <= ATOL
    # cached decode, fed the same tokens
    for i in range(steps):
        logits, past = ours(hf_toks[:, i:i + 1], past=past)
        assert (logits - hf_logits[i + 1]).abs().max().item() <= ATOL
    # the generation loop end to end: identical greedy tokens
    gen = generate(EagerBackend(ours), ids.tolist(), max_new_tokens=steps)
    assert torch.equal(torch.tensor(gen.tokens), hf_toks)
