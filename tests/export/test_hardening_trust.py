"""What an artifact may make k3compile do (docs/architecture.md, "What an artifact is"; README, "Trust"): a library
checks the weights it takes, a damaged one is refused before it is mapped, a cache entry is loaded only when this
user's k3compile made it, a changed checkpoint is not mistaken for the one an export came from, a step's ids are
checked, a full disk is one line, and every backend runs on the threads asked for.

Built here: one fresh cache entry (k3-tiny for llvm, two processes asking at once) and a tiny checkpoint's export."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hardening import examples, one_line_error, run
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from k3compile.backends.tvm import TvmBackend
from k3compile.interface import ExportError, StepInputError, sha256_file

PROMPT = ["--prompt-ids", "4,5,6", "--prompt-ids", "9"]


def cli(*args, env=None, timeout=600):
    return subprocess.run([sys.executable, "-m", "k3compile.cli", *map(str, args)], capture_output=True, text=True,
                          env={**os.environ, **(env or {})}, timeout=timeout)


def rehash(folder: Path) -> None:
    """What an attacker (or a careless edit) does after changing a file: record its new sha256 in the manifest."""
    doc = json.loads((folder / "manifest.json").read_text())
    doc["files"] = {name: sha256_file(folder / name) for name in doc["files"]}
    (folder / "manifest.json").write_text(json.dumps(doc))


@pytest.fixture
def artifact_copy(tmp_path, tvm_artifact):
    folder = tmp_path / "art"
    shutil.copytree(tvm_artifact[1], folder)
    return folder


def _same_shape_pair(folder: Path) -> tuple[int, int]:
    from k3compile.library import read_header

    doc = json.loads((folder / "manifest.json").read_text())
    header = read_header(folder / "weights.safetensors")
    seen: dict = {}
    for i, name in enumerate(doc["params"]):
        key = (header[name]["dtype"], tuple(header[name]["shape"]))
        if key in seen:
            return seen[key], i
        seen[key] = i
    raise AssertionError("no two weights of one shape")


def test_swapped_param_names_are_refused(artifact_copy):
    """Two same-shape names swapped in the manifest (no file touched, every sha256 still valid) used to decode other
    tokens with exit 0; the library carries the names it was compiled with."""
    i, j = _same_shape_pair(artifact_copy)
    doc = json.loads((artifact_copy / "manifest.json").read_text())
    doc["params"][i], doc["params"][j] = doc["params"][j], doc["params"][i]
    (artifact_copy / "manifest.json").write_text(json.dumps(doc))
    with pytest.raises(ExportError, match="was compiled to take"):
        TvmBackend(artifact_copy)
    one_line_error(run("generate", artifact_copy, "--backend", "tvm"), "was compiled to take")


def test_weights_of_another_shape_are_refused(artifact_copy):
    """A weights file whose tensor has another shape than the library was compiled for (its hash recorded again)."""
    from safetensors.numpy import load_file, save_file

    path = artifact_copy / "weights.safetensors"
    tensors = load_file(str(path))
    name = json.loads((artifact_copy / "manifest.json").read_text())["params"][0]
    tensors[name] = tensors[name].reshape(-1)
    save_file(tensors, str(path))
    rehash(artifact_copy)
    one_line_error(run("generate", artifact_copy, "--backend", "tvm"), "the library was compiled for")


@pytest.mark.parametrize("cut", [0.5, 0.99])
def test_a_truncated_library_is_refused_not_a_sigbus(artifact_copy, cut):
    lib = artifact_copy / "model.so"
    data = lib.read_bytes()
    lib.write_bytes(data[:int(len(data) * cut)])
    rehash(artifact_copy)
    res = cli("generate", artifact_copy, "--backend", "tvm", "--max-new-tokens", "2")
    assert res.returncode == 1, (res.returncode, res.stderr[-2000:])  # not -SIGBUS
    assert res.stderr.count("Error:") == 1 and "truncated" in res.stderr and "Traceback" not in res.stderr


def test_a_library_without_a_signature_is_refused(artifact_copy, tmp_path):
    """Another shared object in place of model.so (hash recorded): k3compile loaded it, so its code ran (an artifact
    is a program: README, "Trust"), but it is then refused, never run as the model."""
    src = tmp_path / "other.c"
    src.write_text("int answer(void) { return 42; }\n")
    subprocess.run(["gcc", "-shared", "-fPIC", "-o", str(artifact_copy / "model.so"), str(src)], check=True)
    rehash(artifact_copy)
    one_line_error(run("generate", artifact_copy, "--backend", "tvm"))


def test_token_ids_outside_the_vocabulary_are_refused_by_the_library_api(tvm_artifact):
    """TvmBackend.step (library) with an id >= vocab used to return garbage logits, a huge one to segfault."""
    backend = TvmBackend(tvm_artifact[1])
    vocab = backend.config.vocab_size
    past = backend.init_past(1)
    for bad in (vocab, 10**12, -1):
        with pytest.raises(StepInputError, match=f"token id {bad} is outside"):
            backend.step(torch.tensor([[1, bad]]), torch.ones(1, 2, dtype=torch.long), past)
    with pytest.raises(StepInputError, match="attention_mask"):
        backend.step(torch.tensor([[1, 2]]), torch.ones(1, 3, dtype=torch.long), past)
    with pytest.raises(StepInputError, match="input_ids must be integer"):
        backend.step(torch.tensor([[1.0, 2.0]]), torch.ones(1, 2, dtype=torch.long), past)
    logits, present = backend.step(torch.tensor([[1, vocab - 1]]), torch.ones(1, 2, dtype=torch.long), past)
    assert torch.isfinite(logits).all()
    with pytest.raises(StepInputError, match="past."):
        backend.step(torch.tensor([[3]]), torch.ones(1, 3, dtype=torch.long), present[:-1] + [present[0]])


def test_generate_sets_tvm_threads_too(tvm_artifact):
    """`generate --threads N` used to set torch's threads only; TVM's pool ran on its own default."""
    import tvm

    from k3compile.threads import available_cores, capped

    r = run("generate", tvm_artifact[1], "--backend", "tvm", "--threads", "1", "--max-new-tokens", "2", "--quiet")
    assert r.exit_code == 0, r.output
    assert tvm.get_global_func("runtime.NumThreads")() == 1 and torch.get_num_threads() == 1
    assert os.environ["TVM_NUM_THREADS"] == "1"
    r = run("generate", tvm_artifact[1], "--backend", "tvm", "--threads", "1000", "--max-new-tokens", "2", "--quiet")
    assert r.exit_code == 0, r.output
    assert capped(1000) == available_cores() == torch.get_num_threads()
    assert os.environ["TVM_NUM_THREADS"] == str(available_cores())


# ---- the cache --------------------------------------------------------------------------------------------------

def test_two_first_builds_at_once_then_a_planted_library_is_rebuilt(tmp_path):
    """Two first-time `generate --backend tvm` of one key at once both succeed (one builds, the other waits for it),
    with eager's tokens; a third reuses the entry; then the entry's library is replaced by one whose constructor
    writes a file, its hash recorded in the manifest: the next generate finds the entry's tag broken and rebuilds
    it, so that code never runs."""
    env = {"K3COMPILE_CACHE": str(tmp_path / "cache")}
    args = ("generate", "k3-tiny", "--backend", "tvm", "--max-new-tokens", "4", "--json", "--quiet", *PROMPT)
    procs = [subprocess.Popen([sys.executable, "-m", "k3compile.cli", *args], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, env={**os.environ, **env}) for _ in range(2)]
    outs = [p.communicate(timeout=900) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [o[1][-2000:] for o in outs]
    want = json.loads(run("generate", "k3-tiny", "--max-new-tokens", "4", "--json", *PROMPT).output)["tokens"]
    assert [json.loads(o)["tokens"] for o, _ in outs] == [want, want]
    (entry,) = [p for p in (tmp_path / "cache" / "artifacts").iterdir() if p.is_dir()]
    stamp = (entry / "manifest.json").stat().st_mtime_ns
    again = cli(*args, env=env)  # a third ask reuses the entry: not rebuilt
    assert again.returncode == 0 and json.loads(again.stdout)["tokens"] == want
    assert (entry / "manifest.json").stat().st_mtime_ns == stamp
    assert sorted(p.name for p in entry.parent.iterdir()) == [entry.name, entry.name + ".tag"]

    marker = tmp_path / "ran"
    src = tmp_path / "evil.c"
    src.write_text('#include <stdio.h>\n__attribute__((constructor)) static void run(void) '
                   f'{{ FILE *f = fopen("{marker}", "w"); if (f) fclose(f); }}\n')
    subprocess.run(["gcc", "-shared", "-fPIC", "-o", str(entry / "model.so"), str(src)], check=True)
    rehash(entry)
    res = cli(*args, env=env)
    assert res.returncode == 0, res.stderr[-2000:]
    assert json.loads(res.stdout)["tokens"] == want and not marker.exists()


# ---- a checkpoint that changed after its export ---------------------------------------------------------------

def test_a_changed_checkpoint_is_not_taken_for_the_exported_one(tmp_path):
    """`compile EXPORT --mesh` re-traces from the checkpoint the export records: after that checkpoint changed, the
    sharded build would hold other weights than the export it claims to come from. Refused, as is verify."""
    from k3compile.checkpoint import save_checkpoint
    from k3compile.source import load_model

    ckpt = tmp_path / "ckpt"
    save_checkpoint(load_model("k3-tiny"), ckpt)
    res = cli("export", ckpt, "-o", tmp_path / "e", "--no-verify", "--quiet")
    assert res.returncode == 0, res.stderr[-2000:]
    assert len(json.loads((tmp_path / "e" / "export.json").read_text())["source"]["digest"]) == 64
    weights = next(ckpt.glob("*.safetensors"))
    data = bytearray(weights.read_bytes())
    data[-4:] = b"\x00\x00\x80\x3f"  # the last float becomes 1.0: same size, other weights
    st = weights.stat()
    weights.write_bytes(bytes(data))
    os.utime(weights, ns=(st.st_atime_ns, st.st_mtime_ns))  # even with the old mtime
    for cmd in (("compile", tmp_path / "e", "--mesh", "ep=2", "-o", tmp_path / "s"), ("verify", tmp_path / "e")):
        res = cli(*cmd)
        assert res.returncode == 1 and res.stderr.count("Error:") == 1, res.stderr[-2000:]
        assert "files changed since" in res.stderr and "Traceback" not in res.stderr
    assert not (tmp_path / "s").exists()


# ---- a full disk ---------------------------------------------------------------------------------------------------

@pytest.fixture
def full_disk(tmp_path):
    """A 256 KiB tmpfs (root can mount one here; elsewhere the test skips)."""
    where = tmp_path / "small"
    where.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(where)],
                      capture_output=True).returncode:
        pytest.skip("cannot mount a small tmpfs here (not root)")
    yield where
    subprocess.run(["umount", str(where)], check=True)


def test_a_full_disk_during_compile_is_one_line(full_disk, tiny_export):
    """TVM's linker reports a full disk as its own RuntimeError ("Compilation error: ... No space left on device");
    `export --mesh` writes through the same writer (tests/unit/test_hardening_cache.py checks the rule there)."""
    for cmd in (("compile", tiny_export[1], "-o", full_disk / "out"),):
        res = cli(*cmd)
        assert res.returncode == 1 and res.stderr.count("Error:") == 1, res.stderr[-2000:]
        assert "No space left on device" in res.stderr and "nothing was written" in res.stderr
        assert "Traceback" not in res.stderr
        assert list(full_disk.iterdir()) == []  # no OUT, no work folder


# ---- manifests with consistent hashes ------------------------------------------------------------------------------

@settings(max_examples=examples(12), deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_any_params_edit_with_hashes_kept_consistent_is_refused(tmp_path_factory, tvm_artifact, data):
    """Property: the manifest's `params` permuted, renamed, cut or extended (every file's sha256 still valid): the
    artifact loads only when the list is the one compiled, else one ExportError."""
    folder = tmp_path_factory.mktemp("params") / "art"
    shutil.copytree(tvm_artifact[1], folder)
    doc = json.loads((folder / "manifest.json").read_text())
    names = doc["params"]
    edit = data.draw(st.sampled_from(["permute", "rename", "drop", "add"]))
    if edit == "permute":
        new = data.draw(st.permutations(names))
    elif edit == "rename":
        i = data.draw(st.integers(0, len(names) - 1))
        new = [*names[:i], data.draw(st.sampled_from(names) | st.text(max_size=8)), *names[i + 1:]]
    elif edit == "drop":
        i = data.draw(st.integers(0, len(names) - 1))
        new = names[:i] + names[i + 1:]
    else:
        new = [*names, data.draw(st.sampled_from(names))]
    doc["params"] = list(new)
    (folder / "manifest.json").write_text(json.dumps(doc))
    if list(new) == names:
        TvmBackend(folder)
    else:
        with pytest.raises(ExportError):
            TvmBackend(folder)


def test_dump_ir_apart_from_out_is_checked_before_any_work(tmp_path, tiny_export):
    """`--dump-ir` equal to OUT (or inside it, or holding it, or the export) used to be refused only after the IR
    was written."""
    out = tmp_path / "out"
    for dump in (out, out / "ir", tmp_path, tiny_export[1], tiny_export[1] / "ir"):
        one_line_error(run("compile", tiny_export[1], "-o", out, "--dump-ir", dump), "apart from OUT")
    assert list(tmp_path.iterdir()) == []
