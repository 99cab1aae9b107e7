"""Router, SiTU, latent MoE: routing weights and the PRE-norm latent sum checked directly (the latent RMSNorm is
scale-invariant and would hide weight-scale bugs), expert slices, MXFP4 experts (tier 1)."""

from __future__ import annotations

import torch

from k3compile.model.moe import MoE
from k3compile.model.norms import RMSNorm
from k3compile.ops.activations import situ
from k3compile.ops.latent_moe_dispatch import latent_moe_dispatch
from k3compile.presets import preset
from k3compile.quant.mx import dequantize_mxfp4

TOL = dict(atol=1e-5, rtol=1e-5)  # fp32, different accumulation order only


def test_situ_hand_checked():
    g = torch.tensor([0.0, 1.0, -2.0, 100.0, -100.0])
    u = torch.tensor([1.0, 2.0, 3.0, 1000.0, 1000.0])
    want = []
    for gi, ui in zip(g.tolist(), u.tolist()):
        import math
        gate = 4 * math.tanh(gi / 4) / (1 + math.exp(-gi))
        want.append(gate * 25 * math.tanh(ui / 25))
    torch.testing.assert_close(situ(g, u), torch.tensor(want), atol=1e-5, rtol=1e-6)
    assert situ(g, u)[1].item() != torch.nn.functional.silu(g[1]).item() * 2.0  # not plain SwiGLU
    big = situ(torch.full((1,), 50.0), torch.full((1,), 1e4))
    assert 99.0 < big.item() <= 100.0  # |out| < 4 * 25 in exact arithmetic; fp32 rounds tanh(12.5) to 1
    gate_min = situ(torch.linspace(-10, 0, 10001), torch.full((10001,), 1e4)).min() / 25
    assert -0.2699 < gate_min.item() < -0.2697  # gate factor's minimum -0.2698 (docs/model.md, "SiTU")


def _moe(**changes):
    cfg = preset("k3-tiny").replace(**changes)
    moe = MoE(cfg).eval()
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in moe.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
        moe.gate.e_score_correction_bias.copy_(torch.randn(cfg.num_experts, generator=gen) * 0.1)
    return cfg, moe


def test_router_weights_by_hand():
    cfg, moe = _moe(routed_scaling_factor=2.5, expert_format="float")
    x = torch.randn(5, cfg.hidden_size)
    idx, w = moe.gate(x)
    for n in range(5):
        s = torch.sigmoid(x[n] @ moe.gate.weight.t())
        biased = s + moe.gate.e_score_correction_bias
        top = sorted(range(cfg.num_experts), key=lambda e: -biased[e].item())[: cfg.num_experts_per_token]
        assert sorted(idx[n].tolist()) == sorted(top)
        raw = s[idx[n]]  # UNBIASED scores
        torch.testing.assert_close(w[n], raw / raw.sum() * 2.5, **TOL)


def test_latent_sum_per_token_by_hand():
    cfg, moe = _moe(expert_format="float")
    x = torch.randn(4, cfg.hidden_size)
    idx, w = moe.gate(x)
    got = moe.routed_partial(x, idx, w)  # pre-norm latent sum
    z = x @ moe.routed_expert_down_proj.weight.t()
    i = cfg.moe_intermediate_size
    for n in range(4):
        acc = torch.zeros(cfg.latent_size)
        for j in range(cfg.num_experts_per_token):
            e = idx[n, j].item()
            w1, w3 = moe.experts.w13[e][:i], moe.experts.w13[e][i:]
            h = situ(z[n] @ w1.t(), z[n] @ w3.t())
            acc += w[n, j] * (h @ moe.experts.w2[e].t())
        torch.testing.assert_close(got[n], acc, **TOL)
    # the block output: up(RMSNorm(sum)) + shared(x)
    y = moe(x)
    norm = moe.routed_expert_norm
    lat = got * torch.rsqrt(got.pow(2).mean(-1, keepdim=True) + norm.eps) * norm.weight
    sh = moe.shared_experts
    shared = sh.down_proj(situ(sh.gate_proj(x), sh.up_proj(x)))
    torch.testing.assert_close(y, lat @ moe.routed_expert_up_proj.weight.t() + shared, **TOL)


def test_latent_norm_hides_scale_but_partial_sum_does_not():
    cfg, moe = _moe(expert_format="float")
    x = torch.randn(3, cfg.hidden_size)
    idx, w = moe.gate(x)
    base = moe.routed_partial(x, idx, w)
    doubled = moe.routed_partial(x, idx, w * 2)
    torch.testing.assert_close(doubled, base * 2, **TOL)
    norm = RMSNorm(cfg.latent_size, 1e-12)
    # the trap of docs/model.md, "Router and latent MoE"
    torch.testing.assert_close(norm(doubled), norm(base), atol=1e-4, rtol=1e-4)


def test_expert_slices_sum_to_the_whole():
    for fmt in ("float", "mxfp4"):
        cfg, moe = _moe(expert_format=fmt)
        x = torch.randn(9, cfg.latent_size)
        idx, w = moe.gate(torch.randn(9, cfg.hidden_size))
        w13, w2, s13, s2 = moe.experts.weights()
        args = (cfg.hidden_act, cfg.activation_situ_beta, cfg.activation_situ_linear_beta)
        whole = latent_moe_dispatch(x, idx, w, w13, w2, s13, s2, 0, *args)
        for bounds in ([0, 3, 8], [0, 1, 2, 5, 8], [0, 8]):
            parts = torch.zeros_like(whole)
            for lo, hi in zip(bounds[:-1], bounds[1:]):
                s13_sl, s2_sl = (None, None) if s13 is None else (s13[lo:hi], s2[lo:hi])
                parts += latent_moe_dispatch(x, idx, w, w13[lo:hi], w2[lo:hi], s13_sl, s2_sl, lo, *args)
            torch.testing.assert_close(parts, whole, **TOL)


def test_mxfp4_experts_equal_their_dequantized_float():
    cfg, moe = _moe(expert_format="mxfp4")
    from k3compile.quant.mx import quantize_mxfp4

    gen = torch.Generator().manual_seed(1)
    e = moe.experts
    for wname in ("w13", "w2"):
        shape = (*getattr(e, f"{wname}_packed").shape[:-1], getattr(e, f"{wname}_packed").shape[-1] * 2)
        pk, sc = quantize_mxfp4(torch.randn(shape, generator=gen) * 0.3)
        getattr(e, f"{wname}_packed").copy_(pk)
        getattr(e, f"{wname}_scale").copy_(sc)
    x = torch.randn(6, cfg.latent_size)
    idx, w = moe.gate(torch.randn(6, cfg.hidden_size))
    args = (0, cfg.hidden_act, cfg.activation_situ_beta, cfg.activation_situ_linear_beta)
    packed = latent_moe_dispatch(x, idx, w, e.w13_packed, e.w2_packed, e.w13_scale, e.w2_scale, *args)
    f13, f2 = dequantize_mxfp4(e.w13_packed, e.w13_scale), dequantize_mxfp4(e.w2_packed, e.w2_scale)
    floats = latent_moe_dispatch(x, idx, w, f13, f2, None, None, *args)
    torch.testing.assert_close(packed, floats, **TOL)
    # MXFP8 activations change the result by a few percent, not more
    q8 = latent_moe_dispatch(x, idx, w, e.w13_packed, e.w2_packed, e.w13_scale, e.w2_scale, *args, "e4m3")
    rel = ((q8 - packed).norm() / packed.norm()).item()
    assert 0 < rel < 0.1


def test_plain_moe_runs_at_full_width():
    cfg, moe = _moe(routed_expert_hidden_size=None, latent_moe_use_norm=False, expert_format="float")
    assert not hasattr(moe, "routed_expert_down_proj")
    assert moe.experts.w13.shape[-1] == cfg.hidden_size
