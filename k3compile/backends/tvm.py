"""An export folder compiled by TVM behind the step protocol (docs/architecture.md, "The compile path").

`TvmBackend(folder, target="llvm")` checks the folder like every reader (interface.open_export, check_graph),
imports model.onnx into Relax (frontend.to_relax), runs the passes' phases (passes.PHASES: the KDA recurrence and
the MXFP4 MoE dispatch become TIR kernels), compiles for the target and runs it in the Relax VM. k3 calls no kernel
covers yet (float experts, MXFP8 activations) stay calls of their extern symbols, served by the ops' reference
implementations (the eager ops, registered by ops.register_tvm_references). No model code is imported.
"""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import torch

from k3compile.interface import MODEL_FILE, ExportError, Past, check_graph, flatten, init_past, open_export, unflatten


class TvmBackend:
    def __init__(self, folder: str | Path, target: str = "llvm") -> None:
        import onnx
        import tvm
        from tvm import relax

        from k3compile.frontend import to_relax
        from k3compile.ops import register_tvm_references
        from k3compile.passes import run_phases

        folder = Path(folder)
        if not (folder / MODEL_FILE).is_file():
            raise ExportError(f"{folder}: not an export folder (no {MODEL_FILE}; run `k3compile export` first)")
        self.record, self.config = open_export(folder)
        check_graph(folder / MODEL_FILE, self.config)
        if target != "llvm":
            raise ExportError(f"target {target!r}: only llvm (this CPU) is supported so far")
        self.name = f"tvm-{target}"
        register_tvm_references()
        t0 = time.perf_counter()
        self.mod = run_phases(to_relax(onnx.load(str(folder / MODEL_FILE))))
        self.executable = tvm.compile(self.mod, target=target)
        self.compile_s = time.perf_counter() - t0
        self.device = tvm.cpu()
        self._vm = relax.VirtualMachine(self.executable, self.device)
        self._tensor = tvm.runtime.tensor

    def init_past(self, batch: int) -> Past:
        return init_past(self.config, batch)

    @torch.no_grad()
    def step(self, input_ids, attention_mask, past: Past):
        feeds = [np.asarray(input_ids, dtype=np.int64), np.asarray(attention_mask, dtype=np.int64),
                 *(t.detach().cpu().numpy().astype(np.float32, copy=False) for t in flatten(past))]
        outs = self._vm["main"](*(self._tensor(np.ascontiguousarray(x), self.device) for x in feeds))
        outs = [torch.from_numpy(o.numpy()) for o in outs]
        return outs[0], unflatten(outs[1:])
