"""`export` never loses a user's file and never leaves a half-written OUT or a temporary folder; `verify` and the
onnx backend refuse a tampered export folder before acting on it.

The 30 s trace is replaced by the session export's graph (the trace is tested in test_export.py); everything after
it (writing, checker, the parity run, the rename) runs for real."""

from __future__ import annotations

import json
import math
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import onnx
import pytest
from builders import tiny_model
from hardening import examples, ok_or_one_line_error, one_line_error, run
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import k3compile.export as export_mod
from k3compile.artifact import WORK_PREFIX, ArtifactError, ArtifactWriter, sweep
from k3compile.checkpoint import SINGLE, save_checkpoint
from k3compile.interface import ExportError, dump_json

HERE = Path(__file__).parent


@pytest.fixture(scope="module")
def traced(tiny_export):
    return onnx.load(str(tiny_export[1] / "model.onnx"))


@pytest.fixture
def fast_trace(monkeypatch, traced):
    monkeypatch.setattr(export_mod, "trace_to_onnx", lambda *a, **k: traced)


def leftovers(parent: Path) -> list[str]:
    return [p.name for p in parent.iterdir() if p.name.startswith(WORK_PREFIX)]


def snapshot(folder: Path) -> dict:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


# ---- what --overwrite may replace --------------------------------------------------------------------------------

def test_overwrite_refuses_the_current_folder(tmp_path, monkeypatch, fast_trace):
    (tmp_path / "notes.txt").write_text("mine")
    monkeypatch.chdir(tmp_path)
    for out in (".", "", str(tmp_path), str(tmp_path.parent)):
        r = run("export", "-o", out, "--overwrite")
        one_line_error(r)
    assert (tmp_path / "notes.txt").read_text() == "mine"
    assert os.listdir(tmp_path) == ["notes.txt"]


def test_overwrite_refuses_the_source(tmp_path, fast_trace):
    ckpt = tmp_path / "ckpt"
    save_checkpoint(tiny_model(), ckpt)
    before = snapshot(ckpt)
    one_line_error(run("export", ckpt, "-o", ckpt, "--overwrite"), "is the source")
    one_line_error(run("export", ckpt, "-o", tmp_path, "--overwrite"), "contains it")  # a folder holding SOURCE
    one_line_error(run("export", ckpt / "config.json", "-o", ckpt, "--overwrite"), "is the source")
    assert snapshot(ckpt) == before
    assert leftovers(tmp_path) == []


def test_overwrite_refuses_a_folder_that_is_not_an_export(tmp_path, fast_trace):
    out = tmp_path / "photos"
    out.mkdir()
    (out / "cat.jpg").write_bytes(b"\xff\xd8")
    (out / "export.json").write_text('{"not": "ours"}')  # a record file must also name k3compile
    one_line_error(run("export", "-o", out, "--overwrite"), "is not a k3compile artifact")
    assert sorted(os.listdir(out)) == ["cat.jpg", "export.json"]


def test_overwrite_replaces_an_earlier_export_only_when_the_new_one_is_complete(tmp_path, fast_trace, monkeypatch):
    out = tmp_path / "out"
    r = run("export", "-o", out, "--quiet")
    assert r.exit_code == 0, r.output
    first = snapshot(out)
    # a failing second export (parity past an impossible tolerance) leaves the first untouched
    one_line_error(run("export", "-o", out, "--overwrite", "--tolerance", "0"), "past the tolerance 0")
    assert snapshot(out) == first and leftovers(tmp_path) == []
    # a successful one replaces it (renamed in whole: a new folder, not files written into the old one)
    inode = out.stat().st_ino
    r = run("export", "-o", out, "--overwrite", "--quiet")
    assert r.exit_code == 0, r.output
    assert out.stat().st_ino != inode and (out / "export.json").is_file()
    assert leftovers(tmp_path) == []


def test_failed_export_creates_no_parent_folders(tmp_path):
    one_line_error(run("export", "k4", "-o", tmp_path / "a" / "b" / "out"), "unknown preset")
    one_line_error(run("export", tmp_path / "missing", "-o", tmp_path / "a" / "out"))
    assert os.listdir(tmp_path) == []


def test_symlinked_out_is_refused(tmp_path):
    (tmp_path / "real").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "real")
    one_line_error(run("export", "-o", tmp_path / "link"), "symbolic link")


# ---- parity is enforced --------------------------------------------------------------------------------------------

def test_parity_past_tolerance_or_nan_fails_and_writes_nothing(tmp_path, fast_trace, monkeypatch):
    one_line_error(run("export", "-o", tmp_path / "out", "--tolerance", "0"), "past the tolerance 0")
    assert os.listdir(tmp_path) == []
    import k3compile.verify as verify

    real = verify.compare

    def one_nan(*a, **k):  # a single NaN among finite rows (max() alone would never pick it)
        rows = real(*a, **k)
        rows[len(rows) // 2] = dict(rows[len(rows) // 2], max_abs=float("nan"))
        return rows

    monkeypatch.setattr(verify, "compare", one_nan)
    one_line_error(run("export", "-o", tmp_path / "out"), "onnxruntime differs from eager by nan")
    assert os.listdir(tmp_path) == []
    assert math.isnan(verify.worst([{"max_abs": 1.0}, {"max_abs": float("nan")}, {"max_abs": 2.0}])["max_abs"])
    r = run("export", "-o", tmp_path / "out", "--no-verify", "--json")  # the check can be skipped
    assert r.exit_code == 0 and "parity" not in json.loads(r.output)


def test_json_records_are_strict():
    with pytest.raises(ExportError, match="non-finite"):
        dump_json({"x": float("nan")})


def test_full_disk_is_one_line(tmp_path, fast_trace, monkeypatch):
    import errno

    def full(*a, **k):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(onnx, "save_model", full)
    one_line_error(run("export", "-o", tmp_path / "out"), "No space left on device")
    assert os.listdir(tmp_path) == []


# ---- two exports to one OUT, dead exports ----------------------------------------------------------------------

def test_second_of_two_concurrent_writers_fails_cleanly(tmp_path):
    out = tmp_path / "out"
    # first OUT does not exist when both check it; then it is an artifact both were allowed to replace
    for overwrite, lost in ((False, "appeared"), (True, "changed")):
        with ArtifactWriter(out, overwrite) as a, ArtifactWriter(out, overwrite) as b:
            (a.path / "export.json").write_text(json.dumps({"k3compile": f"a{overwrite}"}))
            (b.path / "export.json").write_text(json.dumps({"k3compile": f"b{overwrite}"}))
            a.commit()
            with pytest.raises(ArtifactError, match=f"{lost} while this run was working"):
                b.commit()
        assert json.loads((out / "export.json").read_text())["k3compile"] == f"a{overwrite}"
        assert leftovers(tmp_path) == []


def _writer_that_dies(parent: Path, kill: bool) -> subprocess.Popen:
    code = ("import sys, time; from k3compile.artifact import ArtifactWriter\n"
            f"w = ArtifactWriter({str(parent / 'out')!r}).__enter__()\n"
            "print('READY', flush=True); time.sleep(120)\n")
    p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert p.stdout.readline().strip() == "READY"
    if kill:
        p.kill()
        p.wait()
    return p


def test_sweep_removes_only_work_folders_whose_owner_died(tmp_path):
    alive = _writer_that_dies(tmp_path, kill=False)
    dead = _writer_that_dies(tmp_path, kill=True)  # SIGKILL: nothing could clean up
    try:
        assert len(leftovers(tmp_path)) == 2  # the dead one's own start swept nothing: the live lock is held
        removed = sweep(tmp_path)
        assert len(removed) == 1 and len(leftovers(tmp_path)) == 1  # the live one stays
    finally:
        alive.kill()
        alive.wait()
    assert dead.returncode != 0
    sweep(tmp_path)
    assert leftovers(tmp_path) == []


def test_sweep_puts_back_an_old_out_moved_aside_by_a_dead_export(tmp_path):
    work = tmp_path / (WORK_PREFIX + "dead")
    (work / "old").mkdir(parents=True)
    (work / "old" / "export.json").write_text('{"k3compile": "old"}')
    (work / "lock").write_text("")
    (work / "target").write_text("out\n")
    sweep(tmp_path)
    assert json.loads((tmp_path / "out" / "export.json").read_text())["k3compile"] == "old"
    assert leftovers(tmp_path) == []


def test_next_export_sweeps_a_killed_one(tmp_path, fast_trace):
    _writer_that_dies(tmp_path, kill=True)
    assert len(leftovers(tmp_path)) == 1
    r = run("export", "-o", tmp_path / "out", "--no-verify", "--quiet")
    assert r.exit_code == 0, r.output
    assert leftovers(tmp_path) == []


@pytest.mark.parametrize("point", ["load", "trace", "save", "parity"])
def test_sigterm_leaves_no_out_and_no_work_folder(tmp_path, tiny_export, point):
    out = tmp_path / "out"
    p = subprocess.Popen([sys.executable, str(HERE / "pause_export.py"), str(tiny_export[1] / "model.onnx"), point,
                          "-o", str(out)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        line = p.stdout.readline().strip()
        assert line == f"PAUSED {point}", p.stderr.read()
        if point != "load":
            assert len(leftovers(tmp_path)) == 1  # the work folder existed when the signal came
        p.send_signal(signal.SIGTERM)
        _, err = p.communicate(timeout=60)
    finally:
        p.kill()
    assert p.returncode == 143, err
    assert "Traceback" not in err and err.strip().splitlines() == ["Error: terminated by SIGTERM (temporary files "
                                                                     "removed)"]
    assert os.listdir(tmp_path) == []


def test_sigterm_on_an_overwrite_keeps_the_old_export(tmp_path, tiny_export):
    out = tmp_path / "out"
    shutil.copytree(tiny_export[1], out)
    before = snapshot(out)
    p = subprocess.Popen([sys.executable, str(HERE / "pause_export.py"), str(tiny_export[1] / "model.onnx"), "parity",
                          "-o", str(out), "--overwrite"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert p.stdout.readline().strip() == "PAUSED parity"
        p.send_signal(signal.SIGTERM)
        p.communicate(timeout=60)
    finally:
        p.kill()
    assert p.returncode == 143 and snapshot(out) == before and leftovers(tmp_path) == []


# ---- a tampered export folder --------------------------------------------------------------------------------------

@pytest.fixture
def export_copy(tmp_path, tiny_export):
    folder = tmp_path / "exp"
    shutil.copytree(tiny_export[1], folder)
    return folder


def edit_json(path: Path, fn):
    doc = json.loads(path.read_text())
    fn(doc)
    path.write_text(json.dumps(doc))


@pytest.mark.parametrize("field,value", [("vocab_size", 300), ("eos_token_id", 5)])
def test_edited_config_is_refused_by_verify_and_generate(export_copy, field, value):
    edit_json(export_copy / "config.json", lambda d: d["text_config"].__setitem__(field, value))
    one_line_error(run("verify", export_copy), "changed since the export")
    one_line_error(run("generate", export_copy, "--backend", "onnx"), "changed since the export")


def test_edited_record_cannot_make_verify_build_another_model(export_copy):
    edit_json(export_copy / "export.json", lambda d: d["source"].__setitem__("source", "k3"))
    t0 = time.perf_counter()
    one_line_error(run("verify", export_copy), "the source k3 is not the model that was exported")
    assert time.perf_counter() - t0 < 30  # no 2.8T-parameter build was attempted (it would need ~1.5 TB)
    one_line_error(run("verify", export_copy, "--source", "k3-small"), "is not the model that was exported")


@pytest.mark.parametrize("edit,msg", [
    (lambda d: d["source"].__setitem__("seed", "0"), "source.seed"),
    (lambda d: d["source"].__setitem__("seed", 2**64), "source.seed"),
    (lambda d: d["source"].__setitem__("experts", "fp8"), "source.experts"),
    (lambda d: d.__setitem__("activations", 3), "activations"),
    (lambda d: d.__setitem__("interface", "x"), "interface"),
    (lambda d: d.__setitem__("config_sha256", "00"), "config_sha256"),
    (lambda d: d.pop("k3compile"), "not a k3compile export record"),
])
def test_malformed_record_is_one_line(export_copy, edit, msg):
    edit_json(export_copy / "export.json", edit)
    one_line_error(run("verify", export_copy), msg)


def test_unrelated_model_onnx_is_refused(export_copy):
    from onnx import TensorProto, helper

    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [1])
    g = helper.make_graph([helper.make_node("Relu", ["x"], ["y"])], "other", [x], [y])
    onnx.save(helper.make_model(g), str(export_copy / "model.onnx"))
    one_line_error(run("generate", export_copy, "--backend", "onnx"), "not the k3 graph interface")
    one_line_error(run("verify", export_copy), "not the k3 graph interface")


RECORD_KEYS = ["k3compile", "source", "activations", "interface", "config_sha256", "opset"]
SUBKEYS = st.sampled_from(["source", "seed", "experts", "inputs"])
VALUES = st.none() | st.booleans() | st.integers(-2, 2**65) | st.text(max_size=6) \
    | st.lists(st.integers(), max_size=2) | st.dictionaries(SUBKEYS, st.integers() | st.text(max_size=4), max_size=3)


@settings(max_examples=examples(25), deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(key=st.sampled_from(RECORD_KEYS), sub=st.sampled_from([None, "source", "seed", "experts"]), value=VALUES)
def test_any_record_edit_verifies_or_is_one_line(tmp_path_factory, tiny_export, key, sub, value):
    folder = tmp_path_factory.mktemp("rec") / "exp"
    shutil.copytree(tiny_export[1], folder)

    def edit(d):
        if sub and key == "source" and isinstance(d.get("source"), dict):
            d["source"][sub] = value
        else:
            d[key] = value

    edit_json(folder / "export.json", edit)
    before = snapshot(folder)
    r = run("verify", folder, "--decode-steps", "0", "--json", "--quiet")
    if ok_or_one_line_error(r):
        assert json.loads(r.output)["ok"]
    assert snapshot(folder) == before  # verify reads; it never writes or deletes


def test_checkpoint_out_equals_source_keeps_weights(tmp_path, fast_trace):
    ckpt = tmp_path / "ckpt"
    save_checkpoint(tiny_model(), ckpt)
    before = (ckpt / SINGLE).read_bytes()
    one_line_error(run("export", ckpt, "-o", ckpt, "--overwrite"))
    assert (ckpt / SINGLE).read_bytes() == before
