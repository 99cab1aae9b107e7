"""The whole model against transformers' KimiLinearForCausalLM (tier 2): a random tiny model built and saved by
transformers, loaded by k3compile from its folder, gives the same logits (prefill and cached decode) and the same
greedy tokens, for several configs."""

from __future__ import annotations

import pytest
import torch
from builders import build_hf

from k3compile.backends.eager import EagerBackend
from k3compile.checkpoint import load_checkpoint
from k3compile.generate import generate

# fp32 on both sides; the bound. Observed differences are ~1e-7 (summation order only).
ATOL = 1e-4

CONFIGS = {
    "no-q-lora": dict(q_lora_rank=None, heads=2, kda_heads=2, head_dim=16),
    "q-lora": dict(q_lora_rank=24, heads=4, kda_heads=3, head_dim=8),
    "wide-heads": dict(q_lora_rank=None, heads=1, kda_heads=1, head_dim=32),
}


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
