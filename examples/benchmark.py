"""Eager / onnxruntime / TVM side by side on a preset, from Python (the same as `k3compile bench`).

    python examples/benchmark.py [PRESET] [THREADS]     (default: k3-small, every core)

Builds into the cache (~/.cache/k3compile) on first use. Run it on a quiet machine.
"""

from __future__ import annotations

import json
import sys

from k3compile.bench import run_bench
from k3compile.cli.bench import table


def main(preset: str = "k3-small", threads: str | None = None) -> None:
    result = run_bench(preset, threads=int(threads) if threads else None, repeats=3, decode_batches=(1,),
                       prefill=(512,), progress=print)
    print(table(result))
    print(json.dumps(result["roofline"], indent=2))


if __name__ == "__main__":
    main(*sys.argv[1:3])
