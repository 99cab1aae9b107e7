"""Phase 4: the standard Relax ops become TIR PrimFuncs, fused (docs/architecture.md, "The compile path").

The target's library dispatch (top-k as a sort kernel), then LegalizeOps, AnnotateTIROpPattern, FoldConstant,
FuseOps and FuseTIR: an elementwise chain, or a matmul and its elementwise epilogue, becomes one PrimFunc with one
block per op, which phase 5 schedules. The k3 kernels of phase 1 are opaque to fusion and stay as they are.
"""

from __future__ import annotations


def legalize_fuse(target):
    """The pass for `target` (a k3compile.targets.Target)."""
    import tvm
    from tvm import relax

    tvm_target = target.tvm()
    passes = [*relax.pipeline.library_dispatch_passes(tvm_target), *relax.pipeline.legalize_passes(tvm_target)]

    @tvm.transform.module_pass(opt_level=0, name="K3LegalizeFuse")
    def run(mod, ctx):
        with tvm_target:
            return tvm.transform.Sequential(passes)(mod)

    return run
