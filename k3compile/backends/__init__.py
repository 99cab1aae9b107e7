"""Step backends: anything that runs the graph interface one call at a time (docs/architecture.md, "Backends").

`base.Backend` is the protocol `generate` and `verify.compare` use; `eager` wraps the PyTorch model, `onnx` runs an
export folder in onnxruntime or onnx.reference, `tvm` a CPU artifact in TVM's VM, `executor` a GPU artifact on its
device from its launch plan. Import the module you need: `backends.onnx` never imports the model.
`choose.open_backend` is the one place that picks a backend for a SOURCE (a preset, config, checkpoint, export or
artifact).
"""
