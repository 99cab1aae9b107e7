"""A user's pytest file: build the k3-tiny preset for this CPU once, then check the compiled artifact against the
eager PyTorch model with k3compile.testing. Run it with `pytest examples/test_my_artifact.py` (about a minute: one
export, one compile)."""

from __future__ import annotations

import pytest

from k3compile.testing import assert_matches_eager


@pytest.fixture(scope="module")
def artifact(tmp_path_factory):
    from click.testing import CliRunner

    from k3compile.cli import main

    out = tmp_path_factory.mktemp("build") / "k3-tiny-llvm"
    result = CliRunner().invoke(main, ["export", "k3-tiny", "--target", "llvm", "-o", str(out), "--quiet"])
    assert result.exit_code == 0, result.output
    return out


def test_compiled_model_matches_eager(artifact):
    # fp32 on both sides; kernels sum in other orders than torch, so allow 1e-4 (observed ~1e-6)
    assert_matches_eager(artifact, prompts=[[5, 17, 200, 3], [1, 2]], atol=1e-4, decode_steps=3, new_tokens=16)


def test_single_prompt_long_decode(artifact):
    assert_matches_eager(artifact, prompts=[[9, 8, 7, 6, 5, 4, 3]], atol=1e-4, decode_steps=8, new_tokens=32)
