"""k3compile: trace, lower and compile Kimi K3 (and the Kimi-Linear family) for non-CUDA accelerators."""

__version__ = "0.1.0"
