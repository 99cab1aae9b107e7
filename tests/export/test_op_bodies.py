"""Each k3 op's ONNX function body against its eager op, node by node, in onnxruntime and onnx.reference —
including what the whole-model exports never exercise: expert slices (expert_offset != 0), SiLU in the MXFP4
dispatch, E5M2 activations, and a missing KDA state."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from onnx import TensorProto, helper
from onnx.reference import ReferenceEvaluator

from k3compile.model.kda import l2_normalize
from k3compile.ops import function_bodies, register_schemas
from k3compile.ops.kda_recurrence import kda_recurrence
from k3compile.ops.latent_moe_dispatch import latent_moe_dispatch
from k3compile.ops.mxfp4_matmul import mxfp4_matmul
from k3compile.ops.onnx_body import ACT_QUANT_CODES, ACTIVATION_CODES
from k3compile.quant.mx import quantize_mxfp4

OPSET = 27
# fp32, different summation orders (dense einsum body vs per-expert matmuls, LinearAttention vs chunked form).
TOL = dict(atol=2e-5, rtol=1e-4)
NP = {torch.float32: TensorProto.FLOAT, torch.int64: TensorProto.INT64, torch.uint8: TensorProto.UINT8}


def run_node(op_type, inputs: dict[str, torch.Tensor | None], want: list[torch.Tensor], **attrs):
    """One k3 node with its function bodies; returns (onnxruntime outputs, onnx.reference outputs)."""
    register_schemas()
    names = [n if t is not None else "" for n, t in inputs.items()]
    n_out = len(want)
    node = helper.make_node(op_type, names, [f"out{i}" for i in range(n_out)], domain="k3", **attrs)
    given = {n: t for n, t in inputs.items() if t is not None}
    graph = helper.make_graph(
        [node], "g", [helper.make_tensor_value_info(n, NP[t.dtype], list(t.shape)) for n, t in given.items()],
        [helper.make_tensor_value_info(f"out{i}", TensorProto.FLOAT, list(w.shape)) for i, w in enumerate(want)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET), helper.make_opsetid("k3", 1)],
                              functions=function_bodies(OPSET, {op_type}))
    model.ir_version = 13
    onnx.checker.check_model(model, full_check=True)
    feeds = {n: t.numpy() for n, t in given.items()}
    got_ort = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)
    with np.errstate(over="ignore"):
        got_ref = ReferenceEvaluator(model).run(None, feeds)
    return [torch.from_numpy(np.asarray(x)) for x in got_ort], [torch.from_numpy(np.asarray(x)) for x in got_ref]


@pytest.mark.parametrize("t", [1, 9])
@pytest.mark.parametrize("with_state", [True, False])
def test_kda_body(t, with_state):
    gen = torch.Generator().manual_seed(t)
    b, h, k = 2, 3, 8
    q = l2_normalize(torch.randn(b, t, h, k, generator=gen)) * k**-0.5
    kk = l2_normalize(torch.randn(b, t, h, k, generator=gen))
    v = torch.randn(b, t, h, k, generator=gen)
    g = -torch.rand(b, t, h, k, generator=gen) * 3
    beta = torch.rand(b, t, h, generator=gen)
    state = torch.randn(b, h, k, k, generator=gen) if with_state else None
    want = kda_recurrence(q, kk, v, g, beta, state)
    for got in run_node("KDARecurrence", dict(q=q, k=kk, v=v, g=g, beta=beta, state=state), list(want),
                        num_heads=h):
        for a, w in zip(got, want):
            torch.testing.assert_close(a, w, **TOL)


@pytest.mark.parametrize("act", ["none", "e4m3", "e5m2"])
def test_mxfp4_matmul_body(act):
    gen = torch.Generator().manual_seed(0)
    x, w = torch.randn(2, 5, 64, generator=gen), torch.randn(7, 64, generator=gen)
    packed, scale = quantize_mxfp4(w)
    want = mxfp4_matmul(x, packed, scale, act)
    for (got,) in run_node("MXFP4MatMul", dict(x=x, w_packed=packed, w_scale=scale), [want],
                           act_quant=ACT_QUANT_CODES[act]):
        torch.testing.assert_close(got, want, **TOL)


@pytest.mark.parametrize("mxfp4", [True, False])
@pytest.mark.parametrize("activation,act_quant", [("situ", "none"), ("silu", "e4m3"), ("situ", "e5m2")])
def test_dispatch_body_over_expert_slices(mxfp4, activation, act_quant):
    gen = torch.Generator().manual_seed(1)
    n, d, i, e, topk = 6, 64, 32, 8, 3
    z = torch.randn(n, d, generator=gen)
    idx = torch.stack([torch.randperm(e, generator=gen)[:topk] for _ in range(n)])
    w = torch.rand(n, topk, generator=gen)
    w13, w2 = torch.randn(e, 2 * i, d, generator=gen) * 0.3, torch.randn(e, d, i, generator=gen) * 0.3
    if mxfp4:
        (w13, s13), (w2, s2) = quantize_mxfp4(w13), quantize_mxfp4(w2)
    for lo, hi in [(0, 8), (2, 5), (5, 8)]:  # the whole, and slices that leave tokens' experts outside
        s13_sl, s2_sl = (s13[lo:hi], s2[lo:hi]) if mxfp4 else (None, None)
        want = latent_moe_dispatch(z, idx, w, w13[lo:hi], w2[lo:hi], s13_sl, s2_sl, lo, activation, 4.0, 25.0,
                                   act_quant)
        inputs = dict(z=z, topk_idx=idx, topk_w=w, w13=w13[lo:hi].contiguous(), w2=w2[lo:hi].contiguous())
        if mxfp4:
            inputs.update(w13_scale=s13_sl.contiguous(), w2_scale=s2_sl.contiguous())
        name = "LatentMoEDispatchMXFP4" if mxfp4 else "LatentMoEDispatch"
        for (got,) in run_node(name, inputs, [want], expert_offset=lo, activation=ACTIVATION_CODES[activation],
                               situ_beta=4.0, situ_linear_beta=25.0, act_quant=ACT_QUANT_CODES[act_quant]):
            torch.testing.assert_close(got, want, **TOL)
