"""KDA against independently written code: fla's naive KDA and transformers' KimiLinear / Glm5Next (tier 2)."""

from __future__ import annotations

import pytest
import torch

from k3compile.model.cache import init_past
from k3compile.model.kda import KimiDeltaAttention, l2_normalize
from k3compile.ops.kda_recurrence import kda_chunked, kda_recurrence, kda_recurrent
from k3compile.presets import preset

# fp32; the oracles sum in other orders. Observed ~2e-7; 1e-5 leaves room for platform BLAS differences.
TOL = dict(atol=1e-5, rtol=1e-5)


def raw_inputs(b=2, t=32, h=2, k=16, v=16, seed=0, lower_bound=None):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(b, t, h, k, generator=gen)
    kk = torch.randn(b, t, h, k, generator=gen)
    vv = torch.randn(b, t, h, v, generator=gen)
    a = torch.randn(b, t, h, k, generator=gen)
    g = lower_bound * torch.sigmoid(a) if lower_bound else -torch.nn.functional.softplus(a)
    beta = torch.rand(b, t, h, generator=gen)
    s0 = torch.randn(b, h, k, v, generator=gen) * 0.1
    return q, kk, vv, g, beta, s0


def ours(q, k, v, g, beta, s0, form, chunk=16):
    qn, kn = l2_normalize(q) * q.shape[-1] ** -0.5, l2_normalize(k)
    if form == "recurrent":
        return kda_recurrent(qn, kn, v, g, beta, s0)
    if form == "chunked":
        return kda_chunked(qn, kn, v, g, beta, s0, chunk)
    return kda_recurrence(qn, kn, v, g, beta, s0, chunk)


@pytest.mark.parametrize("form", ["recurrent", "chunked", "op"])
@pytest.mark.parametrize("lower_bound", [None, -5.0])
def test_against_fla_naive(fla_naive, form, lower_bound):
    q, k, v, g, beta, s0 = raw_inputs(lower_bound=lower_bound)
    qn, kn = l2_normalize(q), l2_normalize(k)  # fla's naive form takes normalized q/k and applies the scale
    o_ref, s_ref = fla_naive.naive_recurrent_kda(qn, kn, v, g, beta, initial_state=s0, output_final_state=True)
    o_ch, s_ch = fla_naive.naive_chunk_kda(qn, kn, v, g, beta, initial_state=s0, output_final_state=True,
                                           chunk_size=16)
    torch.testing.assert_close(o_ch, o_ref, **TOL)  # the two oracles agree with each other
    o, s = ours(q, k, v, g, beta, s0, form)
    torch.testing.assert_close(o, o_ref, **TOL)
    torch.testing.assert_close(s, s_ref, **TOL)


@pytest.mark.parametrize("t,chunk", [(32, 16), (29, 8), (29, 64), (1, 64)])
def test_against_transformers_kda(t, chunk):
    from transformers.models.kimi_linear import modeling_kimi_linear as hf

    q, k, v, g, beta, s0 = raw_inputs(t=t)
    o_c, s_c = hf.chunk_kimi_delta_attention(q, k, v, g, beta, chunk_size=chunk, initial_state=s0,
                                             output_final_state=True, use_qk_l2norm_in_kernel=True)
    o_r, s_r = hf.recurrent_kimi_delta_attention(q, k, v, g, beta, initial_state=s0, output_final_state=True,
                                                 use_qk_l2norm_in_kernel=True)
    for form in ("recurrent", "chunked"):
        o, s = ours(q, k, v, g, beta, s0, form, chunk)
        torch.testing.assert_close(o, o_r, **TOL)
        torch.testing.assert_close(s, s_r, **TOL)
        torch.testing.assert_close(o, o_c, **TOL)
        torch.testing.assert_close(s, s_c, **TOL)


def _glm5_layer(cfg):
    from transformers.models.glm5_next import modeling_glm5_next as g5
    from transformers.models.glm5_next.configuration_glm5_next import Glm5NextTextConfig

    hcfg = Glm5NextTextConfig(
        hidden_size=cfg.hidden_size, linear_num_heads=cfg.kda_num_heads, linear_head_dim=cfg.kda_head_dim,
        linear_conv_kernel_dim=cfg.conv_kernel_size, linear_lower_bound=-5.0, rms_norm_eps=cfg.rms_norm_eps,
        hidden_act="silu", num_hidden_layers=1, vocab_size=32,
    )
    hcfg.layer_types = ["linear_attention"]
    return g5.Glm5NextTextLinearAttention(hcfg, 0).eval()


def test_lower_bound_layer_against_glm5_next():
    """Our whole KDA layer with the K3 gate (g = -5 sigmoid(e^A a)) against transformers' Glm5Next KDA layer."""
    cfg = preset("k3-tiny").replace(use_full_rank_gate=False)  # Glm5Next has the low-rank output gate
    ref = _glm5_layer(cfg)
    ours_layer = KimiDeltaAttention(cfg).eval()
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in ref.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.2)
        ref.forget_gate.A_log.copy_(torch.rand(ref.forget_gate.A_log.shape, generator=gen))
        hk = cfg.kda_num_heads * cfg.kda_head_dim
        conv_q, conv_k, conv_v = ref.conv1d.weight.split(hk, dim=0)
        mapping = {
            "q_proj.weight": ref.q_proj.weight, "k_proj.weight": ref.k_proj.weight, "v_proj.weight": ref.v_proj.weight,
            "q_conv1d.weight": conv_q, "k_conv1d.weight": conv_k, "v_conv1d.weight": conv_v,
            "f_a_proj.weight": ref.forget_gate.f_a_proj.weight, "f_b_proj.weight": ref.forget_gate.f_b_proj.weight,
            "dt_bias": ref.forget_gate.dt_bias, "A_log": ref.forget_gate.A_log, "b_proj.weight": ref.b_proj.weight,
            "g_a_proj.weight": ref.g_a_proj.weight, "g_b_proj.weight": ref.g_b_proj.weight,
            "o_norm.weight": ref.o_norm.weight, "o_proj.weight": ref.o_proj.weight,
        }
        ours_layer.load_state_dict(mapping, strict=True)
        x = torch.randn(2, 21, cfg.hidden_size, generator=gen)
        want = ref(x)
        got, _ = ours_layer(x, init_past(cfg, 2)[0])
    torch.testing.assert_close(got, want, **TOL)
