"""TIR kernels of the k3 ops, one module per op (kda, moe; docs/architecture.md, "The compile path"). Each module
builds a PrimFunc specialized to a model's static sizes (head counts and widths); batch and sequence stay symbolic."""
