"""Export a preset, compile it for this CPU and compare every output with eager PyTorch, as a script.

    python examples/export_compile_compare.py [PRESET] [OUT]      (default: k3-tiny, ./out/example-llvm)
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

from k3compile.compile import compile_export
from k3compile.pipeline import export_checked
from k3compile.source import load_model, record
from k3compile.testing import assert_matches_eager
from k3compile.verify import worst


def main(preset: str = "k3-tiny", out: str = "out/example-llvm") -> None:
    model = load_model(preset, seed=0)
    with tempfile.TemporaryDirectory() as scratch:
        export = Path(scratch) / "export"
        doc = export_checked(model, export, source=record(preset, 0, "auto"), progress=print)
        print(f"onnxruntime vs eager: worst {worst(doc['parity'])['max_abs']:.2e}")
        compile_export(export, out, overwrite=True, progress=print)
    rows = assert_matches_eager(out, atol=1e-4)
    w = worst(rows)
    print(f"TVM vs eager: {len(rows)} outputs within 1e-4, worst {w['max_abs']:.2e} ({w['output']}, {w['phase']})")


if __name__ == "__main__":
    main(*sys.argv[1:3])
