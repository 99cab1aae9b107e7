"""The user's files and the build cache (k3compile/artifact.py, k3compile/cachedir.py, k3compile/cache.py,
source.content_digest): `--overwrite` replaces only what a record lists, the cache folder is the user's own and its
entries authenticated, a checkpoint is known by its content. Fast: no export or compile here (fake builds stand in
for them; tests/export/test_hardening_trust.py runs the real ones)."""

from __future__ import annotations

import json
import os
import stat
import threading
import time
from pathlib import Path

import pytest
from hardening import examples
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from k3compile import cache, cachedir
from k3compile.artifact import ArtifactError, check_out, foreign_entries, writing
from k3compile.interface import ExportError
from k3compile.source import content_digest, record


@pytest.fixture
def private_cache(tmp_path, monkeypatch):
    folder = tmp_path / "cache"
    monkeypatch.setenv("K3COMPILE_CACHE", str(folder))
    return folder


# ---- what --overwrite replaces --------------------------------------------------------------------------------

def _export_like(folder: Path, files=("model.onnx", "config.json"), listed: bool = True) -> Path:
    folder.mkdir(parents=True)
    for f in files:
        (folder / f).write_text(f)
    doc = {"k3compile": "0.1.0"}
    if listed:
        doc["files"] = sorted([*files, "export.json"])
    (folder / "export.json").write_text(json.dumps(doc))
    return folder


def _manifest_like(folder: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_text(text)
    (folder / "manifest.json").write_text(json.dumps({"k3compile": "0.1.0", "files": {n: "0" * 64 for n in files}}))
    return folder


def test_overwrite_refuses_an_artifact_holding_a_users_file_and_keeps_it(tmp_path):
    """The reported case: `compile e -o e/llvm; echo n > e/NOTES.txt; export k3-tiny -o e --overwrite` deleted both."""
    e = _export_like(tmp_path / "e")
    _manifest_like(e / "llvm", {"model.so": "lib", "weights.safetensors": "w"})
    (e / "NOTES.txt").write_text("n")
    with pytest.raises(ArtifactError, match=r"holds NOTES.txt \(and 1 more\).*nothing was changed"):
        check_out(e, overwrite=True)
    assert foreign_entries(e) == ["NOTES.txt", "llvm/"]
    with pytest.raises(ExportError, match="no earlier k3compile run wrote"):
        with writing(e, ExportError, overwrite=True):
            raise AssertionError("never reached")
    assert (e / "NOTES.txt").read_text() == "n" and (e / "llvm" / "model.so").read_text() == "lib"


def test_overwrite_replaces_exactly_what_the_records_list(tmp_path):
    # an export, a compiled artifact (manifest + its copy of the export), a sharded one (rank folders), an export
    # from before records listed their files: each holds only what k3compile wrote, so each may be replaced
    cases = [_export_like(tmp_path / "a", ("model.onnx", "model.onnx.data", "config.json")),
             _manifest_like(tmp_path / "b", {"model.so": "", "export.json": "{}", "config.json": ""}),
             _manifest_like(tmp_path / "c", {"config.json": "", "rank0/model.so": "", "rank1/weights.safetensors": ""}),
             _export_like(tmp_path / "d", ("model.onnx", "config.json"), listed=False)]
    for folder in cases:
        assert foreign_entries(folder) == [], folder
        with writing(folder, ExportError, overwrite=True) as w:
            (w.path / "export.json").write_text(json.dumps({"k3compile": "0.1.0", "files": ["export.json"]}))
            w.commit()
        assert sorted(p.name for p in folder.iterdir()) == ["export.json"]


@pytest.mark.parametrize("plant", ["file", "folder", "in a rank folder", "link", "unlisted by an old export"])
def test_every_kind_of_foreign_entry_is_named_and_kept(tmp_path, plant):
    folder = _manifest_like(tmp_path / "out", {"config.json": "", "rank0/model.so": ""})
    if plant == "file":
        (folder / "mine.txt").write_text("keep")
        want = "mine.txt"
    elif plant == "folder":
        (folder / "data").mkdir()
        want = "data/"
    elif plant == "in a rank folder":
        (folder / "rank0" / "mine.txt").write_text("keep")
        want = "rank0/mine.txt"
    elif plant == "link":
        os.symlink(tmp_path, folder / "config.json.bak")
        want = "config.json.bak"
    else:
        folder = _export_like(tmp_path / "old", listed=False)
        (folder / "tokenizer.json").write_text("keep")
        want = "tokenizer.json"
    before = sorted(str(p) for p in folder.rglob("*"))
    with pytest.raises(ArtifactError, match=f"holds {want}"):
        check_out(folder, overwrite=True)
    assert sorted(str(p) for p in folder.rglob("*")) == before


def test_a_file_added_while_the_run_works_is_kept(tmp_path):
    folder = _export_like(tmp_path / "e")
    with pytest.raises(ExportError, match="holds late.txt"):
        with writing(folder, ExportError, overwrite=True) as w:
            (w.path / "export.json").write_text('{"k3compile": "0.1.0"}')
            (folder / "late.txt").write_text("keep")  # after the checks at the start, before the swap
            w.commit()
    assert (folder / "late.txt").read_text() == "keep" and (folder / "model.onnx").is_file()


LINKER_FULL = RuntimeError("Compilation error:\n/usr/bin/ld: final link failed: No space left on device")
SAFETENSORS_FULL = ValueError('Error while serializing: IoError(Os { code: 28, message: "No space left on device" })')


@pytest.mark.parametrize("error", [LINKER_FULL, SAFETENSORS_FULL])
def test_a_full_disk_in_another_librarys_error_is_one_line(tmp_path, error):
    """TVM's linker and safetensors report a full disk in their own exception types (seen on a 256 KiB tmpfs during
    `compile` and `export --mesh`): one error saying nothing was written, no work folder left."""
    with pytest.raises(ExportError, match=r"writing failed \(No space left on device\); nothing was written"):
        with writing(tmp_path / "out", ExportError):
            raise error
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(KeyError):  # anything else is a bug: not turned into a user's error
        with writing(tmp_path / "out", ExportError):
            raise KeyError("x")


# ---- the cache folder -------------------------------------------------------------------------------------------

def test_the_cache_folder_is_made_private(private_cache):
    assert cachedir.root() == private_cache
    assert stat.S_IMODE(private_cache.stat().st_mode) == 0o700
    k = cachedir.key()
    assert len(k) == 32 and stat.S_IMODE((private_cache / "key").stat().st_mode) == 0o600
    assert cachedir.key() == k  # made once
    private_cache.chmod(0o755)  # ours (only our names inside): made private again
    cachedir.root()
    assert stat.S_IMODE(private_cache.stat().st_mode) == 0o700


def test_a_cache_that_cannot_be_private_is_one_error(tmp_path, monkeypatch):
    home = tmp_path / "home"
    home.mkdir()
    (home / ".bashrc").write_text("x")
    home.chmod(0o755)
    a_file = tmp_path / "file"
    a_file.write_text("x")
    for where, msg in ((home, "which k3compile did not put there"), (a_file, "is not a folder"),
                       (a_file / "sub", "cannot be used"), (Path("/proc/k3compile-cache"), "cannot be used")):
        monkeypatch.setenv("K3COMPILE_CACHE", str(where))
        with pytest.raises(cachedir.CacheError, match=msg):
            cachedir.root()
    assert stat.S_IMODE(home.stat().st_mode) == 0o755 and sorted(p.name for p in home.iterdir()) == [".bashrc"]


def test_a_read_only_cache_is_one_error(private_cache):
    import subprocess

    private_cache.mkdir(mode=0o700)
    if os.geteuid() == 0:  # root writes into a 0500 folder anyway: a read-only mount then
        if subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=64k", "tmpfs", str(private_cache)],
                          capture_output=True).returncode:
            pytest.skip("root, and no read-only mount can be made here")
    else:
        private_cache.chmod(0o500)
    try:
        with pytest.raises(cachedir.CacheError, match="(?i)read-only"):
            cachedir.root()
    finally:
        if os.geteuid() == 0:
            subprocess.run(["umount", str(private_cache)], check=True)


def test_cache_errors_are_one_line_in_the_cli(tmp_path, monkeypatch):
    from hardening import one_line_error, run

    monkeypatch.setenv("K3COMPILE_CACHE", str(Path.home()) if any(Path.home().iterdir()) else "/proc/x")
    one_line_error(run("generate", "k3-tiny", "--backend", "tvm", "--max-new-tokens", "1"), "build cache")


# ---- entries: authenticated, locked, rebuilt when not authentic --------------------------------------------------

def _fake_build(folder: Path, text: str = "built") -> None:
    folder.mkdir()
    (folder / "manifest.json").write_text(text)


def _opener(folder: Path) -> None:
    if (folder / "manifest.json").read_text() not in ("built", "first"):
        raise ExportError("damaged")


def test_an_entry_is_reused_only_while_its_tag_holds(private_cache):
    builds = []

    def build(folder):
        builds.append(1)
        _fake_build(folder)

    entry = cache._cached("artifacts", "k1", _opener, build)
    assert cache._cached("artifacts", "k1", _opener, build) == entry and len(builds) == 1  # reused
    (entry / "manifest.json").write_text("built ")  # edited (opens no more)
    cache._cached("artifacts", "k1", _opener, build)
    assert len(builds) == 2
    (entry / "model.so").write_text("planted")  # a file added: the tag no longer holds, though it would open
    cache._cached("artifacts", "k1", _opener, build)
    assert len(builds) == 3 and not (entry / "model.so").exists()
    (entry.with_name("k1.tag")).unlink()  # an entry whose tag is missing (written by someone else)
    cache._cached("artifacts", "k1", _opener, build)
    assert len(builds) == 4


def test_a_planted_entry_with_a_tag_under_another_key_is_rebuilt(private_cache, tmp_path, monkeypatch):
    entry = cache._cached("artifacts", "k2", _opener, _fake_build)
    tag = entry.with_name("k2.tag").read_text()
    assert cachedir.tag_matches({"entry": "k2", "files": cache._contents(entry)}, tag.strip())
    monkeypatch.setenv("K3COMPILE_CACHE", str(tmp_path / "other"))  # another user's cache: another key
    planted = cachedir.root() / "artifacts" / "k2"
    planted.parent.mkdir()
    _fake_build(planted)
    planted.with_name("k2.tag").write_text(tag)
    built = []
    cache._cached("artifacts", "k2", _opener, lambda f: (built.append(1), _fake_build(f)))
    assert built == [1]


def test_a_stuck_entry_is_rebuilt_not_refused(private_cache):
    """An entry folder without its manifest (or with foreign files) used to be refused by --overwrite forever."""
    stuck = cachedir.root() / "artifacts" / "k3"
    stuck.mkdir(parents=True)
    (stuck / "weights.safetensors").write_text("half")
    entry = cache._cached("artifacts", "k3", _opener, _fake_build)
    assert sorted(p.name for p in entry.iterdir()) == ["manifest.json"]


def test_two_first_builds_of_one_entry_take_turns(private_cache):
    """Two processes (here threads with their own lock files) asking for one new entry: one builds, the other waits
    and reuses it (it used to fail: "appeared while this run was working")."""
    builds, errors = [], []

    def build(folder):
        builds.append(1)
        time.sleep(0.3)
        _fake_build(folder, "first")

    def ask():
        try:
            cache._cached("exports", "k4", _opener, build)
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=ask) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == [] and builds == [1]


def test_a_cache_folder_made_by_another_run_meanwhile_is_used(private_cache, monkeypatch):
    """Two first runs both find the cache folder missing; the second's mkdir then meets the first's folder. It used
    to fail that run ("cannot be used (File exists)", CI of f74c604): here the folder appears between the check and
    the mkdir, deterministically."""
    real_exists = Path.exists

    def exists_but_made_meanwhile(path, *args, **kwargs):
        if path == private_cache:  # this run saw it missing; the other run makes it meanwhile
            if not real_exists(path):
                path.mkdir(parents=True, mode=0o700)
            return False
        return real_exists(path, *args, **kwargs)

    monkeypatch.setattr(Path, "exists", exists_but_made_meanwhile)
    assert cachedir.root() == private_cache and private_cache.is_dir()


@settings(max_examples=examples(40), deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(edit=st.sampled_from(["byte", "append", "truncate", "remove", "add", "tag"]), where=st.integers(0, 10**6),
       value=st.binary(min_size=1, max_size=8))
def test_any_edit_of_an_entry_is_rebuilt_never_opened(private_cache, edit, where, value):
    """Property: whatever is changed in an entry or its tag, the opener never sees it; the entry is built anew."""
    name = f"p{abs(hash((edit, where, value))) % 10**9}"
    entry = cache._cached("artifacts", name, _opener, _fake_build)
    target = entry / "manifest.json"
    data = target.read_bytes()
    if edit == "byte":
        i = where % len(data)
        target.write_bytes(data[:i] + bytes([data[i] ^ (value[0] or 1)]) + data[i + 1:])
    elif edit == "append":
        target.write_bytes(data + value)
    elif edit == "truncate":
        target.write_bytes(data[:where % len(data)])
    elif edit == "remove":
        target.unlink()
    elif edit == "add":
        (entry / f"x{where}").write_bytes(value)
    else:
        tag = entry.with_name(name + ".tag")
        tag.write_text(value.hex())
    seen = []

    def opener(folder):
        seen.append((folder / "manifest.json").read_bytes())

    cache._cached("artifacts", name, opener, _fake_build)
    assert seen == []  # rebuilt, not opened
    assert cache._cached("artifacts", name, opener, _fake_build) == entry and seen == [b"built"]


# ---- checkpoints known by content --------------------------------------------------------------------------------

def test_a_checkpoint_with_the_same_sizes_and_mtimes_is_another_entry(private_cache, tmp_path):
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "config.json").write_text("{}")
    w = ckpt / "model.safetensors"
    w.write_bytes(b"\x00" * 64)
    st0 = w.stat()
    before = record(str(ckpt), 0, "auto")
    w.write_bytes(b"\x01" + b"\x00" * 63)  # same size
    os.utime(w, ns=(st0.st_atime_ns, st0.st_mtime_ns))  # same mtime: only the content (and ctime) differ
    after = record(str(ckpt), 0, "auto")
    assert before["digest"] != after["digest"]
    key = cache.entry_key("artifact", before, {})
    assert key != cache.entry_key("artifact", after, {})


def test_content_digests_are_memoized_by_identity_and_the_memo_authenticated(private_cache, tmp_path, monkeypatch):
    f = tmp_path / "config.json"
    f.write_text('{"a": 1}')
    d = content_digest(f)
    calls = []
    import k3compile.source as source_mod

    real = source_mod.sha256_file
    monkeypatch.setattr(source_mod, "sha256_file", lambda p: calls.append(p) or real(p))
    assert content_digest(f) == d and calls == []  # memoized
    memo = private_cache / "digests.json"
    doc = json.loads(memo.read_text())
    doc["digests"] = {k: "0" * 64 for k in doc["digests"]}  # an edited memo: forgotten, not believed
    memo.write_text(json.dumps(doc))
    assert content_digest(f) == d and len(calls) == 1
