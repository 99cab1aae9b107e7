"""Relax/TIR passes of k3compile (shipped as `k3compile.passes`): one pass per file, each saying what it rewrites
into what. The k3 ops' TVM kernels land here with the compile issues."""
