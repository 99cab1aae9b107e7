"""Run an exported folder: onnxruntime (CPU) or onnx.reference, behind the same step interface as the eager model.

`step(input_ids, attention_mask, past) -> (logits, present)` feeds the graph interface's names; `present` comes
back in the layout `past` takes, so decode feeds it straight back. Opening a folder checks it first: its export.json
record, its config.json against the record's hash and interface, and model.onnx's inputs and outputs against that
interface, so that an edited config or an unrelated model.onnx is one error instead of a crash or wrong tokens.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from k3compile.interface import (
    MODEL_FILE,
    ExportError,
    GraphInterface,
    Past,
    check_step,
    init_past,
    numpy_inputs,
    open_export,
    unflatten,
)
from k3compile.threads import capped, default_threads


class OnnxBackend:
    def __init__(self, folder: str | Path, reference: bool = False, threads: int | None = None,
                 spinning: bool = True) -> None:
        folder = Path(folder)
        self.record, self.config = open_export(folder, graph=True)
        self.interface = GraphInterface.of(self.config)
        self.name = "onnx.reference" if reference else "onnx"
        path = folder / MODEL_FILE
        if reference:
            import onnx
            from onnx.reference import ReferenceEvaluator

            from k3compile.ops import register_schemas

            register_schemas()
            try:
                ref = ReferenceEvaluator(onnx.load(str(path)))
            except Exception as e:  # protobuf DecodeError, missing external data, unknown ops
                raise ExportError(f"{path}: onnx.reference cannot load it ({str(e).splitlines()[0][:200]})") from None

            def run(feeds):
                with np.errstate(over="ignore"):  # numpy's Sigmoid overflows to exactly 0/1, as it should
                    return ref.run(None, feeds)

            self._run = run
        else:
            import onnxruntime as ort

            opts = ort.SessionOptions()
            opts.log_severity_level = 3
            opts.intra_op_num_threads = capped(threads) if threads else default_threads(self.config)
            opts.inter_op_num_threads = 1
            if not spinning:  # idle threads sleep at once instead of spinning (the benchmark runs backends in turn)
                opts.add_session_config_entry("session.intra_op.allow_spinning", "0")
            try:
                sess = ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"])
            except Exception as e:  # onnxruntime raises its own exception types for bad files
                raise ExportError(f"{path}: onnxruntime cannot load it ({str(e).splitlines()[0][:200]})") from None
            self._run = lambda feeds: sess.run(None, feeds)

    def init_past(self, batch: int) -> Past:
        return init_past(self.config, batch)

    @torch.no_grad()
    def step(self, input_ids, attention_mask, past: Past):
        check_step(self.config, input_ids, attention_mask, past)
        feeds = dict(zip(self.interface.inputs, numpy_inputs(input_ids, attention_mask, past)))
        outs = [torch.from_numpy(np.asarray(o)) for o in self._run(feeds)]
        return outs[0], unflatten(outs[1:])
