"""llama.cpp, the CPU peer, measured by its own tools beside k3compile's repetitions (`k3compile bench --llama-bench
PATH --gguf FILE`; docs/toolchain.md, "Benchmarks").

llama.cpp runs Kimi K3 independently of this project (its `kimi-k3` model, MXFP4 experts). `LlamaBench` runs its
`llama-bench` (batch-1 decode after the same 16-token prompt, `-d 16 -n steps`; prefill `-p T -n 0`) and, for a
decode batch above 1, `llama-batched-bench` found beside it (`-npp 16 -ntg steps -npl B`), one repetition per call
(`-r 1`), so that k3compile's bench can interleave them with its own backends: each call is a fresh process that
loads the GGUF (memory-mapped, from the page cache after the first) and warms up before it measures, and its
threads end with it. Thread counts are set for both sides alike (`-t`, `-tb`): llama.cpp's OpenMP threads spin at
barriers, which is why the bench checks that the machine is quiet (`check_quiet`) before and after it measures.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path

from k3compile.errors import UserError

TIMEOUT_S = 900  # one llama.cpp run (a repetition of one figure); far above any of the bench's sizes here
QUIET_BOUND = 0.25  # cores that other processes may keep busy while the bench measures (docs/toolchain.md)
QUIET_PROBE_S = 2.0


class PeerError(UserError):
    """llama.cpp's tools missing, failing, or printing what they should not."""


class LlamaBench:
    """llama.cpp's benchmark tools on one GGUF with one thread count."""

    def __init__(self, binary: str | Path, gguf: str | Path, threads: int) -> None:
        self.binary, self.gguf, self.threads = Path(binary), Path(gguf), int(threads)
        if not (self.binary.is_file() and os.access(self.binary, os.X_OK)):
            raise PeerError(f"--llama-bench {binary}: not an executable file (llama.cpp's build/bin/llama-bench)")
        if not self.gguf.is_file():
            raise PeerError(f"--gguf {gguf}: no such file")
        batched = self.binary.with_name("llama-batched-bench")
        self.batched = batched if batched.is_file() and os.access(batched, os.X_OK) else None
        self._check_tool()

    def describe(self) -> str:
        return f"llama.cpp llama-bench ({self.gguf.name}, {self.threads} threads)"

    def _check_tool(self) -> None:
        """The binary runs and is a llama-bench that can decode after a prompt (`-d`, llama.cpp from 2025 on)."""
        try:
            r = subprocess.run([str(self.binary), "--help"], capture_output=True, text=True, timeout=60)
        except (OSError, subprocess.TimeoutExpired) as e:
            raise PeerError(f"--llama-bench {self.binary}: does not run ({e})") from None
        if "n-depth" not in r.stdout + r.stderr:
            raise PeerError(f"--llama-bench {self.binary}: not a llama-bench that takes -d (--n-depth)")

    def _run(self, args: list[str]) -> str:
        cmd = [str(args[0]), "-m", str(self.gguf), *args[1:]]
        try:
            r = subprocess.run(cmd, capture_output=True, text=True, timeout=TIMEOUT_S)
        except subprocess.TimeoutExpired:
            raise PeerError(f"{' '.join(cmd)}: no result in {TIMEOUT_S} s") from None
        if r.returncode != 0:
            tail = (r.stderr.strip().splitlines() or r.stdout.strip().splitlines() or ["no output"])[-1]
            raise PeerError(f"{' '.join(cmd)} failed (exit {r.returncode}): {tail[:300]}")
        return r.stdout + "\n" + r.stderr

    def _bench(self, prompt: int, gen: int, depth: int = 0) -> float:
        out = self._run([str(self.binary), "-t", str(self.threads), "-p", str(prompt), "-n", str(gen),
                         "-d", str(depth), "-r", "1", "-o", "json"])
        start = out.find("[")
        try:
            rows = json.loads(out[start:out.rindex("]") + 1])
            return float(rows[0]["avg_ts"])
        except (ValueError, KeyError, IndexError, TypeError):
            raise PeerError(f"{self.binary}: no JSON result in its output") from None

    def decode(self, batch: int, steps: int, prompt: int) -> float | None:
        """Tokens/s of `steps` decode steps of `batch` sequences after a `prompt`-token prompt (None: batch > 1
        and no llama-batched-bench beside llama-bench)."""
        if batch == 1:
            return self._bench(0, steps, depth=prompt)
        if self.batched is None:
            return None
        out = self._run([str(self.batched), "-t", str(self.threads), "-tb", str(self.threads), "-c",
                         str(batch * (prompt + steps) + 64), "-npp", str(prompt), "-ntg", str(steps), "-npl",
                         str(batch), "--output-format", "jsonl"])
        for line in out.splitlines():
            if line.startswith("{") and "speed_tg" in line:
                return float(json.loads(line)["speed_tg"])
        raise PeerError(f"{self.batched}: no JSON line in its output")

    def prefill(self, length: int) -> float:
        """Tokens/s of one prompt of `length` tokens."""
        return self._bench(length, 0)


def busy_cores(seconds: float = QUIET_PROBE_S) -> float:
    """Cores kept busy by every process on the machine over `seconds` (from /proc/stat), while this one sleeps."""
    def sample() -> tuple[int, int]:
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
        idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
        return sum(fields[:8]) - idle, sum(fields[:8])

    busy0, total0 = sample()
    time.sleep(seconds)
    busy1, total1 = sample()
    cores = os.cpu_count() or 1
    return cores * (busy1 - busy0) / max(total1 - total0, 1)


def check_quiet(when: str, bound: float = QUIET_BOUND) -> float:
    """Raise PeerError when other processes keep more than `bound` cores busy (a benchmark on a busy machine
    measures the other job: llama.cpp's spinning threads collapse, every figure halves); returns the busy cores.
    Off Linux (no /proc/stat) it cannot tell, and returns 0."""
    try:
        busy = busy_cores()
    except OSError:
        return 0.0
    if busy > bound:
        raise PeerError(f"the machine is not quiet {when}: other processes kept {busy:.2f} cores busy (bound "
                        f"{bound}); benchmark figures would measure them. Stop them and run again (--allow-busy "
                        "records the figures anyway, marked)")
    return busy
