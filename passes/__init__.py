"""Relax/TIR passes of k3compile (shipped as `k3compile.passes`): one pass per file, each saying what it rewrites
into what, applied in the order of `PHASES` (docs/architecture.md, "The compile path").

Each phase is (name, factory): the factory takes the target (`k3compile.targets.Target`) and returns a
tvm.transform.Pass, so a target picks its kernels' weight layout and its schedules. `run_phases` can stop after a
named phase and write the IR after each phase to a folder (`k3compile compile --dump-ir DIR`).
"""

from __future__ import annotations

from pathlib import Path

from k3compile.passes.device_legalize import REFUSED, device_legalize
from k3compile.passes.legalize_fuse import legalize_fuse
from k3compile.passes.lift_weight_transforms import lift_weight_transforms
from k3compile.passes.lower_k3_calls import lower_k3_calls
from k3compile.passes.pack_dense_weights import pack_dense_weights
from k3compile.passes.schedule import schedule

from k3compile.interface import ExportError

PHASES = (
    ("lower-k3-calls", lower_k3_calls),                   # 1. k3 extern calls -> TIR kernels (target layout)
    ("pack-dense-weights", pack_dense_weights),           # 2. matmul by a weight -> panel-layout matmul
    ("lift-weight-transforms", lift_weight_transforms),   # 3. weight-only work -> main_transform_params
    ("device-legalize", device_legalize),                 # 4. int64 -> int32, bool as int32, x**2 -> x*x (WGSL)
    ("legalize-fuse", legalize_fuse),                     # 5. standard ops -> TIR, fused
    ("schedule", schedule),                               # 6. each PrimFunc scheduled for the target
)
PHASE_NAMES = tuple(name for name, _ in PHASES)


def run_phases(mod, target=None, upto: str | None = None, dump_dir: str | Path | None = None,
               start: str | None = None):
    """The phases in order (all, or from `start` and up to and including `upto`) for `target` (default: this CPU);
    with `dump_dir`, the IR before the first phase and after each is written there as `NN-<phase>.py` (TVMScript)."""
    from k3compile.targets import resolve

    target = resolve(target) if target is None or isinstance(target, str) else target
    for phase in (upto, start):
        if phase is not None and phase not in PHASE_NAMES:
            raise ValueError(f"unknown phase {phase!r}; phases: {', '.join(PHASE_NAMES)}")
    first = 0 if start is None else PHASE_NAMES.index(start)
    dump = Path(dump_dir) if dump_dir is not None else None
    if dump is not None and first == 0:
        (dump / "00-imported.py").write_text(mod.script())
    for n, (name, make) in enumerate(PHASES, start=1):
        if n <= first:
            continue
        mod = make(target)(mod)
        if mod.attrs is not None and REFUSED in mod.attrs:  # a phase that refuses the module says why
            raise ExportError(str(mod.attrs[REFUSED]))
        if dump is not None:
            (dump / f"{n:02d}-{name}.py").write_text(mod.script())
        if name == upto:
            break
    return mod
