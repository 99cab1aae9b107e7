"""The decode library (k3compile/tune.py): every CPU artifact holds decode.so, the batch-1 decode step with static
shapes, which the backend runs decode at batch 1 through, equal to eager; `compile --tune N` tunes it with
meta_schedule and keeps the database; a tampered tuning file is refused. One tuned compile of k3-tiny per session
(~3 minutes: meta_schedule's builder workers start slowly)."""

from __future__ import annotations

import json

import pytest
from hardening import one_line_error, run

from k3compile.backends.eager import EagerBackend
from k3compile.backends.tvm import TvmBackend
from k3compile.modes import Forms
from k3compile.verify import compare

pytest.importorskip("tvm")

TRIALS = 4
ATOL = 1e-4  # fp32 end to end, as tests/export/test_tvm.py (tuned schedules only sum in another order)


@pytest.fixture(scope="session")
def tuned_artifact(tiny_export, tmp_path_factory):
    """k3-tiny compiled with --tune; every tuned schedule that computes the same is kept whatever its time (on
    k3-tiny's small functions the hand ones are faster), so that decode.so really runs tuned code."""
    out = tmp_path_factory.mktemp("artifacts") / "k3-tiny-tuned"
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr("k3compile.tune.keep_tuned", lambda hand_s, tuned_s: True)
        r = run("compile", str(tiny_export[1]), "-o", str(out), "--tune", str(TRIALS))
    assert r.exit_code == 0, r.output
    return out, r.output


def test_tuned_artifact_holds_the_decode_library_and_the_database(tuned_artifact):
    from k3compile.manifest import read_manifest
    from k3compile.tune import DECODE_LIBRARY, RECORDS, WORKLOADS

    out, printed = tuned_artifact
    manifest = read_manifest(out)
    tuning = manifest["tuning"]
    assert tuning["trials"] == TRIALS and tuning["library"] == DECODE_LIBRARY and tuning["batch"] == 1
    assert {DECODE_LIBRARY, WORKLOADS, RECORDS} <= set(manifest["files"])
    records = [json.loads(line) for line in (out / RECORDS).read_text().splitlines() if line.strip()]
    assert len(records) == TRIALS  # every trial is in the database the artifact keeps
    rows = tuning["functions"]
    assert rows and all(r["hand_us"] > 0 and r["chosen"].split()[0] in ("hand", "tuned") for r in rows)
    assert any(r["chosen"] == "tuned" for r in rows)  # the fixture keeps every valid tuned schedule
    assert all(f"decode {r['function']}" in printed for r in rows)  # the CLI shows the table


def test_tuned_decode_equals_eager(tiny_export, tuned_artifact):
    _decode_library_equals_eager(tiny_export, tuned_artifact[0])


def test_the_default_artifact_decodes_on_its_untuned_decode_library(tiny_export, tvm_artifact):
    """A plain `compile` on a CPU target builds decode.so (no tuning, no database) and the backend, loaded from the
    written artifact, runs batch-1 decode on it, equal to eager."""
    from k3compile.tune import DECODE_LIBRARY, RECORDS, WORKLOADS

    manifest, folder = tvm_artifact
    assert manifest["tuning"] == {"trials": 0, "library": DECODE_LIBRARY, "batch": 1, "seq": 1, "functions": []}
    assert (folder / DECODE_LIBRARY).is_file() and DECODE_LIBRARY in manifest["files"]
    assert not (folder / WORKLOADS).exists() and not (folder / RECORDS).exists()
    _decode_library_equals_eager(tiny_export, folder)


def _decode_library_equals_eager(tiny_export, folder):
    backend = TvmBackend(folder)
    assert backend._decode_vm is not None
    used = []
    backend._decode_vm = _Spy(backend._decode_vm, used)
    rows = compare(EagerBackend(tiny_export[0], Forms.exported()), backend, decode_steps=3, prompts=[[5, 17, 200, 3]])
    assert all(r["max_abs"] <= ATOL for r in rows), [r for r in rows if not r["max_abs"] <= ATOL][:3]
    assert len(used) == 3  # the three decode steps ran on decode.so, the prefill did not


class _Spy:
    """A VM stand-in that records each call of its "main" and passes it on."""

    def __init__(self, vm, used):
        self._vm, self._used = vm, used

    def __getitem__(self, name):
        fn = self._vm[name]

        def call(*args):
            self._used.append(name)
            return fn(*args)

        return call


def test_a_tampered_tuning_file_is_refused(tuned_artifact, tmp_path):
    import shutil

    from k3compile.tune import RECORDS

    bad = tmp_path / "bad"
    shutil.copytree(tuned_artifact[0], bad)
    (bad / RECORDS).write_text((bad / RECORDS).read_text() + "\n")
    one_line_error(run("generate", str(bad), "--backend", "tvm", "--max-new-tokens", "1"), RECORDS)


def test_tune_takes_a_count_and_the_decode_library():
    one_line_error(run("compile", "nowhere", "-o", "x", "--tune", "-1"), "--tune")
    one_line_error(run("compile", "nowhere", "-o", "x", "--tune", "4", "--no-decode-library"), "--no-decode-library")
