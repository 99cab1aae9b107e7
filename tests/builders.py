"""Model builders shared by the tests: the tiny K3 preset, and tiny Kimi-Linear models made by transformers; ranks
run side by side in threads."""

from __future__ import annotations

import threading

import torch

from k3compile.model.k3 import K3ForCausalLM, init_weights
from k3compile.presets import preset


def tiny_model(std: float = 0.1, seed: int = 0, **changes) -> K3ForCausalLM:
    """The k3-tiny preset (every K3 feature) with weights large enough that logits are well separated."""
    cfg = preset("k3-tiny").replace(**changes)
    return init_weights(K3ForCausalLM(cfg), seed=seed, std=std).eval()


def build_hf(tmp_path, q_lora_rank, heads, kda_heads, head_dim, seed=0, vocab=97):
    from transformers import KimiLinearConfig, KimiLinearForCausalLM

    cfg = KimiLinearConfig(
        vocab_size=vocab, hidden_size=48, intermediate_size=64, moe_intermediate_size=24, num_hidden_layers=5,
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


def in_threads(collective, fn, n: int) -> None:
    """fn(r) for r in range(n), each in its own thread, with `collective` installed as ops/collectives.py's hook (the
    ranks' collectives meet there: it keeps each thread's rank in thread-local state of its own); a thread's
    exception is raised here."""
    from k3compile.ops.collectives import set_collective

    errors: list[BaseException] = []

    def run(r):
        try:
            fn(r)
        except BaseException as e:  # noqa: BLE001 - raised below, in the caller's thread
            errors.append(e)

    set_collective(collective)
    try:
        threads = [threading.Thread(target=run, args=(r,)) for r in range(n)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        set_collective(None)
    if errors:
        raise errors[0]
