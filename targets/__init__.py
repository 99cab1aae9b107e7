"""Target families of k3compile (shipped as `k3compile.targets`): one module per family, saying how to build,
schedule and export for it. Filled by the compile issues."""
