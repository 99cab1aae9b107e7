"""The build cache's key is the same in every process (docs/architecture.md, "Build cache"): string hashing is
seeded per process, so anything iterated from a set must be ordered first, or a cached build is never found again."""

from __future__ import annotations

import os
import subprocess
import sys


def test_the_code_digest_is_the_same_in_every_process():
    code = "from k3compile.cache import _code_digest; print(_code_digest())"
    digests = set()
    for seed in ("1", "2", "3"):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
        digests.add(res.stdout.strip())
    assert len(digests) == 1, digests


def test_the_code_digest_covers_the_c_kernel_a_library_links():
    """A changed targets/bf16_gemm.c is another cached build (it was missed when only Python files were hashed)."""
    from k3compile.cache import code_files

    names = {f.relative_to(root).as_posix() for root, f in code_files()}
    assert "bf16_gemm.c" in names and "llvm.py" in names and "cache.py" in names
