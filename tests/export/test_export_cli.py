"""`k3compile export / verify / generate --backend onnx` from the command line, and bad input: one error line,
nonzero exit, no half-written OUT."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from builders import tiny_model
from click.testing import CliRunner

from k3compile.checkpoint import save_checkpoint
from k3compile.cli import main


def run(*args):
    return CliRunner().invoke(main, list(args))


def _no_leftovers(parent, name):
    names = [p.name for p in parent.iterdir()]
    assert name not in names
    assert not [n for n in names if n.startswith(".k3export-")]


def one_line_error(r, msg):
    assert r.exit_code == 1, r.output
    assert "Traceback" not in r.output
    errors = [line for line in r.output.splitlines() if line.startswith("Error:")]
    assert len(errors) == 1 and msg in errors[0], r.output


def test_verify_and_generate_on_an_export(tiny_export):
    model, folder, _ = tiny_export
    r = run("verify", str(folder), "--json", "--decode-steps", "1")
    assert r.exit_code == 0, r.output
    doc = json.loads(r.output)
    assert doc["ok"] and {row["phase"] for row in doc["rows"]} == {"prefill", "decode 1"}
    assert {row["output"] for row in doc["rows"]} >= {"logits", "present.0.recurrent_state", "present.6.k_rope"}
    # an impossible tolerance fails, with exit 1 and one line
    one_line_error(run("verify", str(folder), "--tolerance", "0", "--decode-steps", "0", "--quiet"),
                   "past tolerance 0")
    r = run("generate", str(folder), "--backend", "onnx", "--prompt-ids", "4,5,6", "--prompt-ids", "9",
            "--max-new-tokens", "8", "--json")
    assert r.exit_code == 0, r.output
    r_eager = run("generate", "k3-tiny", "--prompt-ids", "4,5,6", "--prompt-ids", "9", "--max-new-tokens", "8",
                  "--json")
    assert json.loads(r.output)["tokens"] == json.loads(r_eager.output)["tokens"]
    # the default backend (auto) runs an export folder in onnxruntime
    r = run("generate", str(folder), "--prompt-ids", "4,5,6", "--prompt-ids", "9", "--max-new-tokens", "8", "--json")
    assert r.exit_code == 0 and json.loads(r.output)["backend"] == "onnx", r.output
    assert json.loads(r.output)["tokens"] == json.loads(r_eager.output)["tokens"]
    # an export folder is not a checkpoint: the eager backend says so instead of inventing random weights
    one_line_error(run("generate", str(folder), "--backend", "eager"), "is an export folder")


def test_export_json_records(tiny_export):
    _, folder, doc = tiny_export
    on_disk = json.loads((folder / "export.json").read_text())
    assert on_disk == json.loads(json.dumps(doc))
    for key in ("versions", "opset", "inputs", "outputs", "op_counts", "k3_nodes", "weight_bytes", "parity"):
        assert key in on_disk
    assert {"torch", "onnx", "onnxruntime", "onnxscript"} <= set(on_disk["versions"])
    assert (folder / "config.json").is_file()


def test_unknown_preset(tmp_path):
    one_line_error(run("export", "k4", "-o", str(tmp_path / "out")), "unknown preset 'k4'")
    _no_leftovers(tmp_path, "out")


def test_checkpoint_not_matching_its_config(tmp_path):
    save_checkpoint(tiny_model(), tmp_path / "ckpt")
    cfg = json.loads((tmp_path / "ckpt" / "config.json").read_text())
    cfg["text_config"]["num_experts"] = 4
    (tmp_path / "ckpt" / "config.json").write_text(json.dumps(cfg))
    one_line_error(run("export", str(tmp_path / "ckpt"), "-o", str(tmp_path / "out")),
                   "checkpoint does not match its config")
    _no_leftovers(tmp_path, "out")


def test_unwritable_output_folder(tmp_path):
    (tmp_path / "a_file").write_text("x")
    one_line_error(run("export", "-o", str(tmp_path / "a_file" / "out")), "is not a folder")
    one_line_error(run("export", "-o", "/proc/k3compile-test/out"), "cannot create /proc/k3compile-test")


def test_opset_below_what_the_graph_needs(tmp_path):
    one_line_error(run("export", "-o", str(tmp_path / "out"), "--opset", "23"), "below 27")
    _no_leftovers(tmp_path, "out")


def test_existing_output_needs_overwrite(tmp_path):
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "keep.txt").write_text("mine")
    one_line_error(run("export", "-o", str(tmp_path / "out")), "pass --overwrite")
    assert (tmp_path / "out" / "keep.txt").read_text() == "mine"


def test_failure_midway_leaves_nothing(tmp_path, monkeypatch, tiny_export):
    import onnx

    import k3compile.export as export_mod
    import k3compile.verify as verify
    from k3compile.pipeline import export_checked

    model, folder, _ = tiny_export
    traced = onnx.load(str(folder / "model.onnx"))
    monkeypatch.setattr(export_mod, "trace_to_onnx", lambda *a, **k: traced)  # skip the 30 s trace

    def boom(*a, **k):
        raise RuntimeError("simulated failure after model.onnx was written")

    monkeypatch.setattr(verify, "compare", boom)
    with pytest.raises(RuntimeError, match="simulated"):
        export_checked(model, tmp_path / "out")
    _no_leftovers(tmp_path, "out")


def test_corrupt_model_file(tmp_path, tiny_export):
    import shutil

    _, folder, _ = tiny_export
    shutil.copytree(folder, tmp_path / "bad")
    (tmp_path / "bad" / "model.onnx").write_bytes(b"\x08\x07garbage")
    for backend in ("onnx", "onnx-reference"):
        one_line_error(run("generate", str(tmp_path / "bad"), "--backend", backend), "cannot load it")


def test_verify_rejects_non_export_folder(tmp_path):
    one_line_error(run("verify", str(tmp_path)), "not an export folder")
    p = subprocess.run([sys.executable, "-m", "k3compile.cli", "generate", str(tmp_path), "--backend", "onnx"],
                       capture_output=True, text=True)
    assert p.returncode == 1 and p.stderr.strip().startswith("Error:") and "Traceback" not in p.stderr
