"""The user's private k3compile folder, `~/.cache/k3compile` (or `$K3COMPILE_CACHE`), and what keeps it private
(docs/architecture.md, "Build cache"; the trust model: README, "Trust").

The build cache (cache.py) keeps compiled libraries there, which are native code that `generate` loads: whoever can
plant an entry runs code as the user. So the folder is the user's alone (created 0700; an existing one must belong
to the user, and its group / other permission bits are taken away), it must be a folder of its own (an empty one, or
one holding only what k3compile puts there: `$K3COMPILE_CACHE=$HOME` is refused, never filled or re-permissioned),
and every entry is authenticated: `key` (0600, 32 random bytes made on first use) keys an HMAC-SHA256 over what an
entry holds, so a planted or edited entry fails its tag and is built again, never loaded.

`locked(name)` is an flock on `locks/<name>.lock`: two processes building the same entry take turns, the second
finding the first's entry. Content digests of sources (source.py) are memoized in `digests.json`, tagged the same
way. A leaf: it imports nothing of k3compile but the errors.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import json
import os
import secrets
import stat
from pathlib import Path

from k3compile.errors import UserError

try:
    import fcntl
except ImportError:  # pragma: no cover - not POSIX
    fcntl = None

ENV = "K3COMPILE_CACHE"
KEY_FILE = "key"
DIGESTS = "digests.json"
LOCKS = "locks"
ENTRY_KINDS = ("exports", "artifacts", "sharded")
OURS = {KEY_FILE, DIGESTS, LOCKS, *ENTRY_KINDS}  # all a cache folder may hold
TEMP = ".k3cache-"  # + a random part: a file being written here, renamed into place


class CacheError(UserError):
    """The cache folder cannot be used as a private cache (a file, not ours, not writable); the message says why."""


def location() -> Path:
    env = os.environ.get(ENV)
    return Path(env).expanduser() if env else Path.home() / ".cache" / "k3compile"


def root() -> Path:
    """The checked cache folder, created 0700 when missing; raises CacheError where it cannot be private."""
    path = location()
    where = f"{ENV}={path}" if os.environ.get(ENV) else str(path)
    try:
        if path.is_symlink() and not path.is_dir():
            raise CacheError(f"the build cache {where} is a broken symbolic link")
        if path.exists() and not path.is_dir():
            raise CacheError(f"the build cache {where} is not a folder; point {ENV} at a folder of its own")
        if not path.exists():
            path.mkdir(parents=True, mode=0o700, exist_ok=True)  # two first runs may both find it missing
        st = path.stat()
        if hasattr(os, "getuid") and st.st_uid != os.getuid():
            raise CacheError(f"the build cache {where} belongs to another user; point {ENV} at a folder of your own")
        foreign = sorted(p.name for p in path.iterdir() if p.name not in OURS and not p.name.startswith(TEMP))
        if foreign:
            raise CacheError(f"the build cache {where} holds {foreign[0]!r}, which k3compile did not put there (is it "
                             f"a folder of other files, such as your home?); point {ENV} at a folder of its own")
        if stat.S_IMODE(st.st_mode) & 0o077:
            path.chmod(0o700)  # only what k3compile keeps there (checked above): the user's alone from now on
        if not os.access(path, os.W_OK | os.X_OK):
            raise CacheError(f"cannot write into the build cache {where} (read-only?); point {ENV} at a writable "
                             "folder")
    except OSError as e:
        raise CacheError(f"the build cache {where} cannot be used ({e.strerror or e})") from None
    return path


def key() -> bytes:
    """The cache's HMAC key, made once (0600, written whole before anyone can read it)."""
    folder = root()
    path = folder / KEY_FILE
    for _ in range(2):
        try:
            data = path.read_bytes()
            if len(data) == 32 and not path.is_symlink():
                return data
            raise CacheError(f"{path}: not a k3compile cache key (remove it; every entry is then built again)")
        except FileNotFoundError:
            pass
        tmp = folder / f"{TEMP}{secrets.token_hex(8)}"
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "wb") as f:
                f.write(secrets.token_bytes(32))
            try:
                os.link(tmp, path)  # fails if another process made it first: then read theirs
            except FileExistsError:
                pass
        except OSError as e:
            raise CacheError(f"cannot write the cache key {path} ({e.strerror or e})") from None
        finally:
            with contextlib.suppress(OSError):
                tmp.unlink()
    raise CacheError(f"{path}: cannot be read back")


def tag(doc) -> str:
    """HMAC-SHA256 of a JSON document under the cache key."""
    return hmac.new(key(), json.dumps(doc, sort_keys=True).encode(), hashlib.sha256).hexdigest()


def tag_matches(doc, value) -> bool:
    return isinstance(value, str) and hmac.compare_digest(tag(doc), value)


@contextlib.contextmanager
def locked(name: str):
    """An exclusive flock on locks/<name>.lock for the block (waits for another holder)."""
    folder = root() / LOCKS
    try:
        folder.mkdir(mode=0o700, exist_ok=True)
        fd = os.open(folder / f"{name}.lock", os.O_RDWR | os.O_CREAT, 0o600)
    except OSError as e:
        raise CacheError(f"cannot lock {folder / name} ({e.strerror or e})") from None
    try:
        if fcntl is not None:
            fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def recall_digest(stamp: list) -> str | None:
    """The content digest memoized for a file or folder whose identity (path, device, inode, size, mtime, ctime of
    each of its files) is `stamp`, if the memo's tag holds."""
    memo = _read_memo()
    entry = memo.get(json.dumps(stamp))
    return entry if isinstance(entry, str) else None


def remember_digest(stamp: list, digest: str) -> None:
    with locked("digests"):
        memo = _read_memo()
        memo[json.dumps(stamp)] = digest
        if len(memo) > 10_000:  # a bound, oldest first out
            memo = dict(list(memo.items())[-10_000:])
        path = root() / DIGESTS
        tmp = path.with_name(f"{TEMP}{secrets.token_hex(8)}")
        try:
            tmp.write_text(json.dumps({"digests": memo, "tag": tag(memo)}))
            os.replace(tmp, path)
        except OSError:  # a memo that cannot be written only costs the next run a hash
            with contextlib.suppress(OSError):
                tmp.unlink()


def _read_memo() -> dict:
    try:
        doc = json.loads((root() / DIGESTS).read_text())
    except (OSError, ValueError):
        return {}
    if not isinstance(doc, dict) or not isinstance(doc.get("digests"), dict) or not tag_matches(doc["digests"],
                                                                                               doc.get("tag")):
        return {}  # edited or planted: forgotten, every digest computed again
    return doc["digests"]
