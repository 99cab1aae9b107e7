"""Writing an artifact folder (an export, later a compiled executable) without ever losing a user's files.

The rules (docs/architecture.md, "Writing OUT"):
- OUT is built in a work folder `.k3export-XXXX` beside it, holding a `lock` file that this process keeps
  flock-ed while it works. The finished folder is renamed into place at the end, so a failed or interrupted run
  leaves no OUT and no half-written artifact.
- `--overwrite` replaces only a folder that is itself a k3compile artifact (it has a record file naming
  k3compile) and that holds nothing but what that record lists (`foreign_entries`): a file or folder of the user's
  inside it (notes, another artifact compiled into a subfolder) is refused, named, and kept. Never the current
  folder, an ancestor of it, the SOURCE or a folder that contains the SOURCE. The old OUT is moved into the work
  folder first, the new one renamed in, and only then is the old one deleted.
- The swap runs with SIGINT / SIGTERM held back and under an flock on the parent folder, and it checks that OUT is
  still what it was at the start: of two runs writing the same OUT at once, the second fails cleanly.
- SIGTERM raises `Terminated` (like SIGINT's KeyboardInterrupt), so the work folder is removed on `timeout` or a CI
  cancel too. A work folder whose lock no process holds (its owner died, e.g. by SIGKILL) is swept by the next run
  in the same parent; if that owner died between moving the old OUT aside and renaming the new one in, the sweep
  puts the old OUT back first.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import signal
import tempfile
import threading
from pathlib import Path

from k3compile.errors import UserError

try:
    import fcntl
except ImportError:  # pragma: no cover - not POSIX: no locks, the rename checks still hold
    fcntl = None

log = logging.getLogger(__name__)

WORK_PREFIX = ".k3export-"
LOCK_FILE = "lock"
TARGET_FILE = "target"  # OUT's name, so that a sweep can put a moved-aside old OUT back
NEW_DIR = "new"
OLD_DIR = "old"
RECORD_FILES = ("export.json", "manifest.json")  # a folder holding one of these (naming k3compile) is ours
# what an export wrote before its record listed its files (export.json's "files"), and so may be replaced
LEGACY_EXPORT_FILES = ("model.onnx", "model.onnx.data", "config.json", "export.json")


class ArtifactError(UserError):
    """OUT cannot be written as asked (it is protected, not ours, not writable, or changed under us)."""


class Terminated(BaseException):
    """SIGTERM arrived; raised like KeyboardInterrupt so that `finally` blocks clean up."""


def _raise_terminated(signum, frame):
    raise Terminated("terminated by SIGTERM")


@contextlib.contextmanager
def sigterm_raises():
    """Within the block, SIGTERM raises Terminated (main thread only, and only over the default handler)."""
    if threading.current_thread() is not threading.main_thread() or signal.getsignal(signal.SIGTERM) not in (
            signal.SIG_DFL, None):
        yield
        return
    signal.signal(signal.SIGTERM, _raise_terminated)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)


@contextlib.contextmanager
def _signals_held():
    """Hold SIGINT and SIGTERM back for a short critical section; they are delivered when it ends."""
    sigs = {signal.SIGINT, signal.SIGTERM}
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    old = signal.pthread_sigmask(signal.SIG_BLOCK, sigs)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


@contextlib.contextmanager
def _flocked(path: Path):
    """An exclusive flock on a folder, for the few syscalls of the final swap."""
    if fcntl is None:
        yield
        return
    fd = os.open(path, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def is_artifact(folder: Path) -> bool:
    """True when `folder` holds a record file written by k3compile (export.json / manifest.json)."""
    for name in RECORD_FILES:
        p = folder / name
        if p.is_file() and not p.is_symlink():
            try:
                doc = json.loads(p.read_text())
            except (OSError, ValueError):
                continue
            if isinstance(doc, dict) and "k3compile" in doc:
                return True
    return False


def _record(folder: Path, name: str) -> dict | None:
    p = folder / name
    if not p.is_file() or p.is_symlink():
        return None
    try:
        doc = json.loads(p.read_text())
    except (OSError, ValueError, RecursionError):
        return None
    return doc if isinstance(doc, dict) and "k3compile" in doc else None


def listed_files(folder: Path) -> set[str]:
    """The files (relative POSIX paths) that the records in `folder` say a k3compile run wrote there: a manifest's
    `files` and an export record's `files` (an older export record: the export's fixed names), the records too."""
    owned: set[str] = set()
    manifest = _record(folder, "manifest.json")
    if manifest is not None:
        owned.add("manifest.json")
        files = manifest.get("files")
        if isinstance(files, dict):
            owned |= {k for k in files if isinstance(k, str)}
    export = _record(folder, "export.json")
    if export is not None:
        files = export.get("files")
        owned |= ({f for f in files if isinstance(f, str)} if isinstance(files, list) else set(LEGACY_EXPORT_FILES))
        owned.add("export.json")
    return owned


def foreign_entries(folder: Path) -> list[str]:
    """What in `folder` no k3compile record there lists: files, links and folders a user put there (a folder that
    only holds listed files is ours). Sorted, as relative POSIX paths."""
    owned = listed_files(folder)
    parents = {p.as_posix() for name in owned for p in Path(name).parents if p != Path(".")}
    foreign = []
    for root, dirs, files in os.walk(folder):
        rel = Path(root).relative_to(folder)
        for name in sorted(dirs):
            path = (rel / name).as_posix()
            if (Path(root) / name).is_symlink() or path not in parents:
                foreign.append(path + "/")
        dirs[:] = [d for d in dirs if (rel / d).as_posix() in parents and not (Path(root) / d).is_symlink()]
        for name in sorted(files):
            path = (rel / name).as_posix()
            if path not in owned or (Path(root) / name).is_symlink():
                foreign.append(path)
    return sorted(foreign)


def _check_replaceable(out: Path, target: Path) -> None:
    foreign = foreign_entries(target)
    if foreign:
        more = f" (and {len(foreign) - 1} more)" if len(foreign) > 1 else ""
        raise ArtifactError(f"{out} holds {foreign[0]}{more}, which no earlier k3compile run wrote there; "
                            "--overwrite replaces only the files an artifact's record lists, so nothing was changed "
                            "(move it out, or write to another folder)")


def _identity(path: Path):
    try:
        st = os.stat(path, follow_symlinks=False)
    except FileNotFoundError:
        return None
    return st.st_dev, st.st_ino


def _is_empty_dir(path: Path) -> bool:
    try:
        with os.scandir(path) as it:
            return next(it, None) is None
    except (NotADirectoryError, FileNotFoundError):
        return False


def check_out(out: str | Path, overwrite: bool, protect: tuple[Path, ...] = ()) -> Path:
    """Every check that can run before any work, creating nothing. Returns OUT's parent (absolute).

    `protect`: paths the run reads from (its SOURCE); OUT may be neither one of them nor a folder holding one."""
    if str(out).strip() == "":
        raise ArtifactError("the output folder must not be empty (pass -o FOLDER)")
    out = Path(out)
    if out.is_symlink():
        raise ArtifactError(f"{out}: is a symbolic link; give the folder itself")
    target = out.resolve()
    cwd = Path.cwd().resolve()
    if target == cwd or target in cwd.parents:
        raise ArtifactError(f"{out}: is the current folder or contains it; refusing to write there")
    for p in protect:
        p = Path(p).resolve()
        if target == p or target in p.parents:
            raise ArtifactError(f"{out}: is the source ({p}) or contains it; refusing to write there")
    if target.exists():
        if not target.is_dir():
            raise ArtifactError(f"{out}: exists and is not a folder")
        if not _is_empty_dir(target):
            if not overwrite:
                raise ArtifactError(f"{out} exists and is not empty (pass --overwrite to replace an earlier export)")
            if not is_artifact(target):
                raise ArtifactError(f"{out} is not a k3compile artifact (no {' or '.join(RECORD_FILES)}); "
                                    "--overwrite replaces only an earlier k3compile output")
            _check_replaceable(out, target)
    parent = target.parent
    for p in (parent, *parent.parents):
        if p.exists():
            if not p.is_dir():
                raise ArtifactError(f"{out}: {p} is not a folder")
            if not os.access(p, os.W_OK | os.X_OK):
                raise ArtifactError(f"{out}: cannot write into {p}")
            break
    return parent


def sweep(parent: Path) -> list[Path]:
    """Remove work folders in `parent` whose owner is provably dead (its lock is free); returns them."""
    removed = []
    if fcntl is None or not parent.is_dir():
        return removed
    for work in parent.glob(WORK_PREFIX + "*"):
        if work.is_symlink() or not work.is_dir() or not (work / LOCK_FILE).is_file():
            continue
        try:
            fd = os.open(work / LOCK_FILE, os.O_RDWR)
        except OSError:
            continue
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                continue  # its owner is alive
            _restore_old(work, parent)
            shutil.rmtree(work, ignore_errors=True)
            removed.append(work)
            log.info("removed %s, left by an export that died", work)
        finally:
            os.close(fd)
    return removed


def _restore_old(work: Path, parent: Path) -> None:
    """A dead run that had moved the old OUT aside but not renamed the new one in: put the old one back."""
    old = work / OLD_DIR
    try:
        name = (work / TARGET_FILE).read_text().strip()
    except OSError:
        return
    if old.is_dir() and name and "/" not in name and not (parent / name).exists():
        os.rename(old, parent / name)
        log.warning("restored %s, moved aside by an export that died", parent / name)


class ArtifactWriter:
    """Build OUT in a locked work folder and rename it into place on `commit()`; see the module docstring.

    with ArtifactWriter(out, overwrite, protect) as w:
        write files into w.path
        w.commit()
    """

    def __init__(self, out: str | Path, overwrite: bool = False, protect: tuple[Path, ...] = ()) -> None:
        self.out = Path(out)
        self.overwrite = overwrite
        self.protect = tuple(protect)
        self.work: Path | None = None
        self._lock_fd: int | None = None
        self._stack = contextlib.ExitStack()

    @property
    def path(self) -> Path:
        assert self.work is not None
        return self.work / NEW_DIR

    def __enter__(self) -> ArtifactWriter:
        parent = check_out(self.out, self.overwrite, self.protect)
        self.target = parent / self.out.resolve().name
        self._start = _identity(self.target) if not _is_empty_dir(self.target) else None
        self._stack.enter_context(sigterm_raises())
        try:
            try:
                parent.mkdir(parents=True, exist_ok=True)
            except OSError as e:
                raise ArtifactError(f"{self.out}: cannot create {parent} ({e.strerror or e})") from None
            try:
                sweep(parent)
                with _signals_held():
                    self.work = Path(tempfile.mkdtemp(prefix=WORK_PREFIX, dir=parent))
                    self._lock_fd = os.open(self.work / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o600)
                    if fcntl is not None:
                        fcntl.flock(self._lock_fd, fcntl.LOCK_EX)
                (self.work / TARGET_FILE).write_text(self.target.name + "\n")
                self.path.mkdir()
            except OSError as e:
                raise ArtifactError(f"{self.out}: cannot write into {parent} ({e.strerror or e})") from None
        except BaseException:
            self._cleanup()
            raise
        return self

    def commit(self) -> None:
        """Rename the finished folder into place (replacing an earlier artifact only after it is complete)."""
        _default_permissions(self.path)
        parent = self.target.parent
        with _signals_held(), _flocked(parent):
            now = _identity(self.target) if not _is_empty_dir(self.target) else None
            if now != self._start:
                what = "appeared" if self._start is None else "changed"
                raise ArtifactError(f"{self.out}: {what} while this run was working (another export to the same "
                                    "folder?); nothing was written")
            if now is not None:
                _check_replaceable(self.out, self.target)  # again: a file may have been added meanwhile
            try:
                if now is not None:
                    os.rename(self.target, self.work / OLD_DIR)
                os.rename(self.path, self.target)
            except OSError as e:
                if now is not None and not self.target.exists() and (self.work / OLD_DIR).is_dir():
                    os.rename(self.work / OLD_DIR, self.target)
                raise ArtifactError(f"{self.out}: cannot rename the finished folder into place "
                                    f"({e.strerror or e}); nothing was written") from None

    def __exit__(self, *exc) -> None:
        self._cleanup()

    def _cleanup(self) -> None:
        try:
            with _signals_held():
                if self.work is not None:
                    shutil.rmtree(self.work, ignore_errors=True)
                if self._lock_fd is not None:
                    os.close(self._lock_fd)
                self.work, self._lock_fd = None, None
        finally:
            self._stack.close()


def _default_permissions(folder: Path) -> None:
    """mkdtemp makes a 0700 folder and onnx writes external data 0600: give OUT the usual umask permissions."""
    umask = os.umask(0)
    os.umask(umask)
    folder.chmod(0o777 & ~umask)
    for f in folder.iterdir():
        if f.is_file():
            f.chmod(0o666 & ~umask)


@contextlib.contextmanager
def writing(out: str | Path, error: type[UserError], overwrite: bool = False, protect: tuple[Path, ...] = ()):
    """`with ArtifactWriter(...) as w`, where a refused OUT or a failed write (a full disk, a folder removed under
    us) is one `error` line saying that nothing was written."""
    try:
        with ArtifactWriter(out, overwrite, protect) as w:
            yield w
    except ArtifactError as e:
        raise error(str(e)) from None
    except OSError as e:
        raise error(f"{out}: writing failed ({e.strerror or e}); nothing was written") from None
    except Exception as e:  # a full disk seen by a tool of ours (TVM's linker, safetensors) that raises its own type
        why = _disk_full(e)
        if why is None:
            raise
        raise error(f"{out}: writing failed ({why}); nothing was written") from None


_FULL = ("No space left on device", "Disk quota exceeded")  # strerror(ENOSPC), strerror(EDQUOT)


def _disk_full(e: BaseException) -> str | None:
    """The reason, when an exception of another library's type says the disk (or the quota) is full."""
    text = str(e)
    return next((why for why in _FULL if why in text), None)
