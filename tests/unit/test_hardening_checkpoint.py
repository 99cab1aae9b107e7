"""Bad checkpoints (wrong dtypes, non-finite values, NaN scale bytes, truncated or garbled files) are named errors;
a save never leaves an older checkpoint's index or shards to be loaded in place of the new weights."""

from __future__ import annotations

import json

import pytest
import torch
from builders import tiny_model
from hardening import examples, ok_or_one_line_error, one_line_error, run
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file, save_file

from k3compile.checkpoint import INDEX, SINGLE, CheckpointError, load_checkpoint, save_checkpoint

PACKED = "language_model.model.layers.1.block_sparse_moe.experts.0.w1.weight_packed"
SCALE = "language_model.model.layers.1.block_sparse_moe.experts.0.w1.weight_scale"
DENSE = "language_model.model.layers.0.mlp.gate_proj.weight"


class Saved(tuple):
    def __repr__(self):  # Hypothesis prints fixtures of a failing example: not the whole state dict
        return f"Saved({self[0]})"


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    folder = tmp_path_factory.mktemp("ckpt")
    save_checkpoint(tiny_model(), folder)
    return Saved((folder, load_file(str(folder / SINGLE))))


def replace(tmp_path, saved, name, tensor):
    folder, tensors = saved
    tensors = dict(tensors)
    tensors[name] = tensor
    out = tmp_path / "bad"
    out.mkdir(exist_ok=True)
    (out / "config.json").write_text((folder / "config.json").read_text())
    save_file(tensors, str(out / SINGLE))
    return out


def test_nan_weight_is_named(tmp_path, saved):
    t = saved[1][DENSE].clone()
    t[3, 4] = float("nan")
    folder = replace(tmp_path, saved, DENSE, t)
    with pytest.raises(CheckpointError, match=f"{DENSE}: 1 non-finite value"):
        load_checkpoint(folder)
    # and through the CLI: one line, not tokens 0,0,0 with exit 0
    one_line_error(run("generate", folder), "non-finite")


def test_inf_weight_is_named(tmp_path, saved):
    t = saved[1][DENSE].clone()
    t[0, 0] = float("-inf")
    with pytest.raises(CheckpointError, match="non-finite"):
        load_checkpoint(replace(tmp_path, saved, DENSE, t))


def test_nan_e8m0_scale_byte_is_named(tmp_path, saved):
    t = saved[1][SCALE].clone()
    t[0, 0] = 0xFF
    with pytest.raises(CheckpointError, match=f"{SCALE}: 1 E8M0 scale byte"):
        load_checkpoint(replace(tmp_path, saved, SCALE, t))


@pytest.mark.parametrize("name,dtype,want", [
    (DENSE, torch.int32, "F16 or BF16 or F32 or F64"),  # was: cast to zeros and used
    (PACKED, torch.float32, "U8"),                       # was: a traceback later
    (PACKED, torch.int8, "U8"),
    (SCALE, torch.float32, "U8 or F8_E8M0"),
])
def test_wrong_dtype_is_named_with_the_shapes(tmp_path, saved, name, dtype, want):
    t = saved[1][name]
    bad = t.to(dtype) if dtype.is_floating_point else t.to(torch.int64).clamp(-100, 100).to(dtype)
    with pytest.raises(CheckpointError, match=f"wrong dtype: {name} .* \\(expected {want}\\)"):
        load_checkpoint(replace(tmp_path, saved, name, bad))


def test_scale_as_e8m0_dtype_is_accepted(tmp_path, saved):
    t = saved[1][SCALE].view(torch.float8_e8m0fnu)
    load_checkpoint(replace(tmp_path, saved, SCALE, t))


def test_truncated_file_is_one_error(tmp_path, saved):
    folder = replace(tmp_path, saved, DENSE, saved[1][DENSE])
    data = (folder / SINGLE).read_bytes()
    (folder / SINGLE).write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError):
        load_checkpoint(folder)


def test_save_into_an_older_sharded_checkpoint(tmp_path):
    old, new = tiny_model(seed=1), tiny_model(seed=2)
    save_checkpoint(old, tmp_path, max_shard_bytes=200_000)
    assert (tmp_path / INDEX).is_file()
    (tmp_path / "tokenizer.json").write_text("{}")  # a file the user keeps beside the weights
    with pytest.raises(CheckpointError, match="not empty"):
        save_checkpoint(new, tmp_path)
    save_checkpoint(new, tmp_path, overwrite=True)  # single file now: the old index and shards must be gone
    assert not (tmp_path / INDEX).exists()
    assert not list(tmp_path.glob("model-*-of-*.safetensors"))
    assert (tmp_path / "tokenizer.json").read_text() == "{}"
    back = load_checkpoint(tmp_path)
    for (k, a), b in zip(new.state_dict().items(), back.state_dict().values()):
        assert torch.equal(a, b), k  # the NEW weights, bit for bit


def test_save_refuses_a_file(tmp_path):
    (tmp_path / "f").write_text("x")
    with pytest.raises(CheckpointError, match="not a folder"):
        save_checkpoint(tiny_model(), tmp_path / "f")


# ---- property: a corrupted checkpoint loads (same shapes, finite) or is one error line -----------------------------

@st.composite
def corruptions(draw):
    kind = draw(st.sampled_from(["truncate", "flip", "index", "config", "dtype", "shape", "nonfinite"]))
    if kind in ("dtype", "shape", "nonfinite"):  # one tensor rewritten: another dtype, shape, or a NaN / Inf
        return kind, (draw(st.integers(0, 10_000)), draw(st.sampled_from(
            [torch.int32, torch.int8, torch.float16, torch.uint8, torch.float64, float("nan"), float("inf")])))
    if kind == "truncate":
        return kind, draw(st.floats(0.0, 0.999))
    if kind == "flip":
        return kind, (draw(st.floats(0.0, 0.999)), draw(st.integers(1, 255)))
    if kind == "index":
        return kind, draw(st.sampled_from(['{"weight_map": 3}', "[]", "{", '{"weight_map": {"x": "../nope"}}']))
    return kind, draw(st.sampled_from(['{"model_type": "kimi_k3"}', "null", '{"text_config": []}']))


@settings(max_examples=examples(40), deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(c=corruptions())
def test_corrupted_checkpoint_loads_or_is_one_error(tmp_path_factory, saved, c):
    folder = tmp_path_factory.mktemp("c")
    (folder / "config.json").write_text((saved[0] / "config.json").read_text())
    data = (saved[0] / SINGLE).read_bytes()
    kind, arg = c
    if kind == "truncate":
        data = data[: int(len(data) * arg)]
    elif kind == "flip":
        pos = int(len(data) * arg[0])
        data = data[:pos] + bytes([data[pos] ^ arg[1]]) + data[pos + 1:]
    elif kind == "index":
        (folder / INDEX).write_text(arg)
    elif kind == "config":
        (folder / "config.json").write_text(arg)
    else:
        tensors = dict(saved[1])
        name = sorted(tensors)[arg[0] % len(tensors)]
        t = tensors[name]
        if kind == "dtype" and isinstance(arg[1], torch.dtype):
            t = t.to(arg[1])
        elif kind == "shape":
            t = t.reshape(-1)[: max(1, t.numel() - 1)].clone()
        elif t.is_floating_point():
            t = t.clone()
            t.view(-1)[arg[0] % t.numel()] = arg[1] if isinstance(arg[1], float) else float("nan")
        tensors[name] = t
        save_file(tensors, str(folder / SINGLE))
        data = (folder / SINGLE).read_bytes()
    (folder / SINGLE).write_bytes(data)
    before = sorted(p.name for p in folder.iterdir())
    r = run("generate", folder, "--max-new-tokens", "2", "--json", "--quiet")
    if ok_or_one_line_error(r):
        assert len(json.loads(r.output)["tokens"][0]) == 2
    assert sorted(p.name for p in folder.iterdir()) == before  # nothing deleted, nothing left behind


def test_a_folder_without_weights_is_an_error_not_random_weights(tmp_path, saved):
    (tmp_path / "config.json").write_text((saved[0] / "config.json").read_text())  # the weights were not copied
    one_line_error(run("generate", tmp_path), "no *.safetensors weights found")
    # the config.json itself, named as a file, is a request for seeded random weights
    assert run("generate", tmp_path / "config.json", "--max-new-tokens", "1").exit_code == 0
