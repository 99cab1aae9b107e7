"""Phase 6: every PrimFunc gets the target's schedule (docs/toolchain.md, "CPU schedules").

For each PrimFunc of the module not already marked `tirx.is_scheduled` (the k3 kernels, written scheduled), the
target's `schedule_func` returns it scheduled; the result is marked scheduled.
"""

from __future__ import annotations


def schedule(target):
    """The pass for `target` (a k3compile.targets.Target)."""
    import tvm

    @tvm.transform.module_pass(opt_level=0, name="K3Schedule")
    def run(mod, ctx):
        mod = mod.clone()  # a pass leaves its input as it was
        for gv, func in list(mod.functions_items()):
            if isinstance(func, tvm.tirx.PrimFunc):
                mod[gv] = target.schedule_func(func)
        return mod

    return run
