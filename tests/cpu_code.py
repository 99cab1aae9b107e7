"""What a CPU module TVM built does at run time, read from its LLVM IR (tests/unit/test_passes.py,
test_kernels.py)."""

from __future__ import annotations


def workspace_allocations(lib) -> int:
    """How many allocations a compiled CPU module (tvm.compile's result) makes from TVM's workspace pool: each a call
    at run time whose pointer LLVM must assume may alias the operands. A buffer on the stack is none of them
    (docs/toolchain.md, "Scratch buffers")."""
    return lib.mod.inspect_source("ll").count("load ptr, ptr @__TVMBackendAllocWorkspace")
