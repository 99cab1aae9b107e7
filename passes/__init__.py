"""Relax/TIR passes of k3compile (shipped as `k3compile.passes`): one pass per file, each saying what it rewrites
into what, applied in the order of `PHASES` (docs/architecture.md, "The compile path")."""

from __future__ import annotations

from k3compile.passes.lower_k3_calls import lower_k3_calls

PHASES = (("lower-k3-calls", lower_k3_calls),)  # (name, factory of the ModulePass)


def run_phases(mod):
    """Every phase in order; returns the lowered module."""
    for _, make in PHASES:
        mod = make()(mod)
    return mod
