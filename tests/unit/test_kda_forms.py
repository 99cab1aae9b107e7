"""The two eager forms of k3::kda_recurrence agree, and padding leaves the state untouched (tier 1)."""

from __future__ import annotations

import pytest
import torch

from k3compile.model.kda import l2_normalize
from k3compile.ops.kda_recurrence import kda_chunked, kda_recurrence, kda_recurrent


def inputs(b=2, t=37, h=3, k=16, v=8, lower_bound=None, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = l2_normalize(torch.randn(b, t, h, k, generator=gen)) * k**-0.5
    kk = l2_normalize(torch.randn(b, t, h, k, generator=gen))
    vv = torch.randn(b, t, h, v, generator=gen)
    a = torch.randn(b, t, h, k, generator=gen)
    g = lower_bound * torch.sigmoid(a) if lower_bound else -torch.nn.functional.softplus(a) * 2.0
    beta = torch.rand(b, t, h, generator=gen)
    s0 = torch.randn(b, h, k, v, generator=gen)
    return q, kk, vv, g, beta, s0


# fp32 with different summation orders (T x chunk products vs a sequential scan): ~1e-6 relative (docs/model.md, "Kimi
# Delta Attention").
TOL = dict(atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("chunk", [4, 8, 16, 37, 64])  # 37 = T (one chunk); 4/8/16 do not divide 37
@pytest.mark.parametrize("lower_bound", [None, -5.0])
def test_chunked_equals_recurrent(chunk, lower_bound):
    q, k, v, g, beta, s0 = inputs(lower_bound=lower_bound)
    o1, s1 = kda_recurrent(q, k, v, g, beta, s0)
    o2, s2 = kda_chunked(q, k, v, g, beta, s0, chunk)
    torch.testing.assert_close(o2, o1, **TOL)
    torch.testing.assert_close(s2, s1, **TOL)


def test_op_splits_like_the_forms():
    q, k, v, g, beta, s0 = inputs(t=9)
    o, s = torch.ops.k3.kda_recurrence(q, k, v, g, beta, s0)
    # prefill 5 then decode 4 one token at a time through the op equals the whole sequence
    o_a, s_a = kda_recurrence(q[:, :5], k[:, :5], v[:, :5], g[:, :5], beta[:, :5], s0)
    outs = [o_a]
    for i in range(5, 9):
        o_i, s_a = kda_recurrence(q[:, i:i + 1], k[:, i:i + 1], v[:, i:i + 1], g[:, i:i + 1], beta[:, i:i + 1], s_a)
        outs.append(o_i)
    torch.testing.assert_close(torch.cat(outs, 1), o, **TOL)
    torch.testing.assert_close(s_a, s, **TOL)


def test_padded_positions_leave_state_exactly_unchanged():
    q, k, v, g, beta, s0 = inputs(t=6)
    g[:, :3] = 0.0
    beta[:, :3] = 0.0
    _, s_pad = kda_recurrent(q[:, :3], k[:, :3], v[:, :3], g[:, :3], beta[:, :3], s0)
    assert torch.equal(s_pad, s0)
    _, s_pad_c = kda_chunked(q, k, v, g, beta, s0, 4)
    _, s_ref = kda_recurrent(q[:, 3:], k[:, 3:], v[:, 3:], g[:, 3:], beta[:, 3:], s0)
    torch.testing.assert_close(s_pad_c, s_ref, **TOL)


def test_recurrence_step_by_hand():
    # One head, K=V=1: S' = S e^g; S'' = S' + β k (v - k S'); o = q S''.
    q, k, v, g, beta, s = (torch.tensor(x).view(1, 1, 1, 1) for x in (0.5, 1.0, 2.0, -0.5, 0.25, 3.0))
    o, s1 = kda_recurrent(q, k, v, g, beta.view(1, 1, 1), s)
    dec = 3.0 * torch.exp(torch.tensor(-0.5))
    want = dec + 0.25 * (2.0 - dec)
    torch.testing.assert_close(s1.flatten(), want.view(1))
    torch.testing.assert_close(o.flatten(), (0.5 * want).view(1))


def test_missing_initial_state_is_zero():
    q, k, v, g, beta, s0 = inputs(t=7)
    o, s = kda_recurrence(q, k, v, g, beta)
    o0, s_0 = kda_recurrent(q, k, v, g, beta, torch.zeros_like(s0))
    torch.testing.assert_close(o, o0, **TOL)
    torch.testing.assert_close(s, s_0, **TOL)
