"""Export tier for Kimi-Linear configs: a random tiny model built and saved by transformers, exported from its
checkpoint folder (float experts, SiLU, low-rank KDA gate, no AttnRes, no latent MoE)."""

from __future__ import annotations

import pytest
from builders import build_hf

from k3compile.backends.eager import EagerBackend
from k3compile.backends.onnx import OnnxBackend
from k3compile.backends.tvm import TvmBackend
from k3compile.checkpoint import load_checkpoint
from k3compile.generate import generate
from k3compile.modes import Forms
from k3compile.pipeline import export_checked
from k3compile.verify import compare

ATOL = 1e-4  # fp32, summation order only (see test_export.py)


@pytest.mark.parametrize("name,kw", [
    ("no-q-lora", dict(q_lora_rank=None, heads=2, kda_heads=2, head_dim=16)),
    ("q-lora", dict(q_lora_rank=24, heads=4, kda_heads=3, head_dim=8)),
])
def test_kimi_linear_export_matches_eager(tmp_path, name, kw):
    build_hf(tmp_path / "ckpt", **kw)
    model = load_checkpoint(tmp_path / "ckpt")
    doc = export_checked(model, tmp_path / "out", source={"source": str(tmp_path / "ckpt")})
    assert doc["k3_nodes"] == {"KDARecurrence": 4, "LatentMoEDispatch": 4}  # float experts: the float body
    rows = compare(EagerBackend(model, Forms.exported()), OnnxBackend(tmp_path / "out"), decode_steps=3,
                   prompts=[[5, 6, 7, 8, 9], [40], [90, 91, 92]])
    assert all(r["max_abs"] <= ATOL for r in rows)  # all(): a NaN row fails (max() would skip it)
    prompts = [[5, 6, 7, 8, 9], [40], [90, 91, 92]]
    eager_tokens = generate(EagerBackend(model), prompts, 32).tokens
    assert generate(OnnxBackend(tmp_path / "out"), prompts, 32).tokens == eager_tokens
    # and compiled by TVM (KDA on its TIR kernel; these float experts, 24 wide, no multiple of the kernel's 32-wide
    # blocks, on the op's reference path): the same outputs
    tvm = TvmBackend(tmp_path / "out")
    rows = compare(EagerBackend(model, Forms.exported()), tvm, decode_steps=3, prompts=prompts)
    assert all(r["max_abs"] <= ATOL for r in rows), [r for r in rows if not r["max_abs"] <= ATOL][:3]
    assert generate(tvm, prompts, 32).tokens == eager_tokens
