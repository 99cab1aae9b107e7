"""Step backends: anything that runs the graph interface one call at a time (docs/architecture.md, "Backends").

`base.Backend` is the protocol `generate` and `verify.compare` use; `eager` wraps the PyTorch model, `onnx` runs an
export folder in onnxruntime or onnx.reference. Import the module you need: `backends.onnx` never imports the model.
"""
