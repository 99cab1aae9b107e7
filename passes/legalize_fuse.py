"""Phase 5: the standard Relax ops become TIR PrimFuncs, fused (docs/architecture.md, "The compile path").

The target's library dispatch (top-k as a sort kernel), then LegalizeOps, AnnotateTIROpPattern, FoldConstant,
FuseOps and FuseTIR: an elementwise chain, or a matmul and its elementwise epilogue, becomes one PrimFunc with one
block per op, which phase 6 schedules. The k3 kernels of phase 1 are opaque to fusion and stay as they are. On CPU
targets a square by a scalar weight holding 2 becomes a product first (passes/exact_powers.py), the module gets
`main_inplace`, main with MLA's caches kept in place (passes/inplace_caches.py), and
MLA's attention einsums are legalized to k3compile's own kernels (passes/lower_attention.py).
"""

from __future__ import annotations


def legalize_fuse(target):
    """The pass for `target` (a k3compile.targets.Target)."""
    import tvm
    from k3compile.passes.exact_powers import exact_powers
    from k3compile.passes.inplace_caches import inplace_caches
    from k3compile.passes.lower_attention import lower_attention
    from tvm import relax

    tvm_target = target.tvm()
    if tvm_target.kind.name == "metal":  # its matmul rule imports TVM's tensor intrinsics: slow unless helped
        from k3compile.targets.gpu import import_tensor_intrinsics

        import_tensor_intrinsics()
    passes = [*relax.pipeline.library_dispatch_passes(tvm_target), *relax.pipeline.legalize_passes(tvm_target)]

    @tvm.transform.module_pass(opt_level=0, name="K3LegalizeFuse")
    def run(mod, ctx):
        with tvm_target:
            return tvm.transform.Sequential([exact_powers(target), inplace_caches(target), lower_attention(target),
                                            *passes])(mod)

    return run
