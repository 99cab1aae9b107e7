"""The CLI: presets, generate (presets and checkpoint folders), and one-line errors with a nonzero exit."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from builders import tiny_model
from click.testing import CliRunner

from k3compile.backends.eager import EagerBackend
from k3compile.checkpoint import save_checkpoint
from k3compile.cli import main
from k3compile.generate import generate


def run(*args):
    return CliRunner().invoke(main, list(args))


def test_presets_json():
    r = run("presets", "--json")
    assert r.exit_code == 0, r.output
    rows = {row["name"]: row for row in json.loads(r.output)}
    assert set(rows) >= {"k3", "kimi-linear-48b", "k3-tiny", "k3-small"}
    assert 2.7e12 < rows["k3"]["params"] < 2.9e12  # "2.8T"
    assert 90e9 < rows["k3"]["active_params"] < 120e9
    assert 47e9 < rows["kimi-linear-48b"]["params"] < 51e9 and 2.5e9 < rows["kimi-linear-48b"]["active_params"] < 4e9
    assert 1e8 < rows["k3-small"]["params"] < 1e9


def test_presets_table():
    r = run("presets")
    assert r.exit_code == 0 and "k3-tiny" in r.output and "2.78T" in r.output


def test_generate_matches_library_and_is_deterministic():
    r = run("generate", "--prompt-ids", "1,2,3", "--prompt-ids", "7,8", "--max-new-tokens", "5", "--json")
    assert r.exit_code == 0, r.output
    doc = json.loads(r.output)
    from k3compile.source import load_model

    want = generate(EagerBackend(load_model("k3-tiny")), [[1, 2, 3], [7, 8]], 5)
    assert doc["tokens"] == want.tokens and doc["source"] == "k3-tiny"
    r2 = run("generate", "k3-tiny", "--prompt-ids", "1,2,3", "--max-new-tokens", "5", "--json",
             "--temperature", "0.8", "--top-p", "0.9", "--seed", "3")
    r3 = run("generate", "k3-tiny", "--prompt-ids", "1,2,3", "--max-new-tokens", "5", "--json",
             "--temperature", "0.8", "--top-p", "0.9", "--seed", "3")
    assert json.loads(r2.output)["tokens"] == json.loads(r3.output)["tokens"]


def test_generate_from_checkpoint_folder(tmp_path):
    m = tiny_model()
    save_checkpoint(m, tmp_path)
    r = run("generate", str(tmp_path), "--prompt-ids", "4,5,6", "--max-new-tokens", "4", "--json")
    assert r.exit_code == 0, r.output
    assert json.loads(r.output)["tokens"] == generate(EagerBackend(m), [[4, 5, 6]], 4).tokens


@pytest.mark.parametrize("args,msg", [
    (["generate", "k4"], "unknown preset 'k4'"),
    (["generate", "--prompt-ids", "1,256"], "token id 256 is outside the vocabulary 0..255"),
    (["generate", "--prompt-ids", "1,x"], "expected comma-separated integers"),
    (["generate", "--top-p", "0"], "top-p"),
])
def test_bad_input_is_one_line(args, msg):
    r = run(*args)
    assert r.exit_code != 0
    assert msg in r.output
    # one error line (click's usage errors add the usage hint above it), never a traceback
    assert "Traceback" not in r.output
    assert sum(line.startswith("Error:") for line in r.output.splitlines()) == 1


def test_corrupt_checkpoint_via_console_script(tmp_path):
    save_checkpoint(tiny_model(), tmp_path)
    (tmp_path / "model.safetensors").write_bytes(b"garbage")
    p = subprocess.run([sys.executable, "-m", "k3compile.cli", "generate", str(tmp_path)], capture_output=True,
                       text=True)
    assert p.returncode == 1
    assert p.stderr.strip().startswith("Error:") and len(p.stderr.strip().splitlines()) == 1
    assert "Traceback" not in p.stderr
