"""The distributed runtime: one process per rank over torch.distributed (docs/architecture.md, "Sharding and the
runtime"). worker.py is a rank; launch.py starts them on one machine and gathers their results."""
