"""Executors: a GPU artifact's launch plan run on a device driver, with no TVM (docs/architecture.md, "GPU artifacts
and their executors"). `plan.Program` evaluates the plan (sizes, buffers, launches) on any driver; `opencl` is the
pyopencl driver. backends/executor.py puts the step protocol over them.
"""
