"""An export folder compiled by TVM, or a compiled artifact, behind the step protocol (docs/architecture.md, "The
compile path").

`TvmBackend(artifact)` loads `k3compile compile`'s OUT after checking its manifest (manifest.read_manifest: every
file's sha256) and passes the weights as parameters. `TvmBackend(export_folder, target="llvm")` checks the folder
like every reader (interface.open_export, check_graph),
imports model.onnx into Relax (frontend.to_relax), runs the passes' phases (passes.PHASES: every k3 call becomes a
TIR kernel, or the build is refused naming the op and why; weight layouts move to compile time, the standard ops are
fused and scheduled for the target), compiles for the target and runs it in the Relax VM. An artifact built for
another CPU (other vector features) is refused rather than run into an illegal instruction. It still registers the
ops' reference implementations (ops.register_tvm_references), which no module k3compile builds calls (modules built
by hand from one k3 node do: the converter tests). No model code is imported.

MLA's caches stay in place when the library has `main_inplace` (passes/inplace_caches.py; docs/architecture.md,
"In-place decode caches"): the backend keeps each cache in a buffer of some capacity (at least MIN_CAPACITY rows,
doubled when a step needs more), a step writes only its new rows there, and the `present` it returns for an MLA
layer is a view of the buffer's filled rows. A `past` that is the last `present` of this backend goes back as its
buffers, nothing copied; any other past (one built elsewhere, or an older state stepped again: a branch) is copied
into new buffers first, so a state once returned never changes. The buffers of the last CACHE_SETS batches are
kept, so a server that alternates its running batch's decode steps with a new prompt's prefill chunks copies neither.
"""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import torch

from k3compile import library
from k3compile.config import K3Config
from k3compile.interface import (
    ExportError,
    Past,
    check_step,
    init_past,
    numpy_inputs,
    numpy_state,
    open_export,
    unflatten,
)
from k3compile.library import INPLACE_FUNC, LAST_FUNC, RELEASE_AT, has_function, release_pool

MIN_CAPACITY = 256  # rows a new cache buffer holds at least; it doubles when a step needs more
CACHE_SETS = 2  # decode batches whose buffers are kept: a server's running batch and the prompt it prefills beside


class _InPlaceCaches:
    """The MLA caches of one decode batch in buffers [B, capacity, width] (TVM tensors; `full` their torch views),
    their first `length` rows filled."""

    def __init__(self, cfg: K3Config, batch: int, capacity: int, device, empty) -> None:
        self.layers = [i for i in range(cfg.num_hidden_layers) if cfg.is_mla(i)]
        widths = (cfg.kv_lora_rank, cfg.qk_rope_head_dim)
        self.buffers = {i: tuple(empty((batch, capacity, w), "float32", device) for w in widths) for i in self.layers}
        self.full = {i: tuple(torch.from_dlpack(b) for b in pair) for i, pair in self.buffers.items()}
        self.batch, self.capacity, self.length = batch, capacity, 0
        self.views: dict = {}  # layer -> the views present() last handed out

    def holds(self, past: Past, batch: int, length: int) -> bool:
        """Whether `past`'s MLA caches are this object's filled rows as it last handed them out."""
        if batch != self.batch or length != self.length:
            return False
        if self.views and all(past[i][0] is v[0] and past[i][1] is v[1] for i, v in self.views.items()):
            return True  # the very views present() made (a decode loop's case: the cheapest check)
        return all(got.data_ptr() == full.data_ptr() and got.stride() == full.stride()
                   and tuple(got.shape) == (batch, length, full.shape[2])
                   for i in self.layers for got, full in zip(past[i], self.full[i]))

    def fill(self, past: Past, length: int) -> None:
        """Copy `length` rows of `past`'s MLA caches in (a state from elsewhere, or a smaller buffer's)."""
        for i in self.layers:
            for full, got in zip(self.full[i], past[i]):
                full[:, :length].copy_(got)
        self.length = length

    def present(self, length: int) -> dict:
        """layer -> the views [B, length, width] a step returns as its MLA present."""
        self.length = length
        self.views = {i: tuple(full[:, :length] for full in pair) for i, pair in self.full.items()}
        return self.views


class TvmBackend:
    """`folder`: an export folder (compiled here, in memory) or a compiled artifact (`k3compile compile`'s OUT,
    loaded after its manifest and every file's sha256 are checked)."""

    def __init__(self, folder: str | Path, target="llvm") -> None:
        import tvm
        from tvm.runtime.vm import VirtualMachine

        from k3compile import host_gemm
        from k3compile.manifest import MANIFEST
        from k3compile.ops import register_tvm_references
        from k3compile.targets import resolve

        folder = Path(folder)
        register_tvm_references()
        host_gemm.register()  # the packed function a CPU kernel calls for prefill rows (k3compile/host_gemm.py)
        self.device = tvm.cpu()
        self._tensor = tvm.runtime.tensor
        t0 = time.perf_counter()
        self._decode_executable = None  # the decode library (decode.so), when the artifact has one
        if (folder / MANIFEST).is_file():
            self._load_artifact(folder)
        else:
            self._compile_export(folder, resolve(target))  # a Target, or its name
        self.compile_s = time.perf_counter() - t0
        self._vm = VirtualMachine(self.executable, self.device)
        self._decode_vm = None if self._decode_executable is None else VirtualMachine(self._decode_executable,
                                                                                      self.device)
        self._caches: list[_InPlaceCaches] = []  # MLA caches kept in place (main_inplace), most recent last
        self._returned: list[dict] = []  # the states steps returned: id(torch tensor) -> (it, the TVM tensor it views)
        self.inplace = self._has(INPLACE_FUNC)
        self._last = self._has(LAST_FUNC)

    def _vm_for(self, input_ids):
        """The decode library for a batch-1 decode step, when the artifact has one; else main's."""
        return library.vm_for(self._vm, self._decode_vm, input_ids.shape)

    def _has(self, name: str) -> bool:
        """Whether the library (and the decode library, when there is one) has function `name`."""
        return all(vm is None or has_function(vm, name) for vm in (self._vm, self._decode_vm))

    def _compile_export(self, folder: Path, target) -> None:
        from k3compile.compile import build

        self.record, self.config = open_export(folder, graph=True)
        self.name = f"tvm-{target.name}"
        self.mod, self.executable, _, self._params = build(folder, target)

    def _load_artifact(self, folder: Path) -> None:
        from k3compile.targets import TARGETS, resolve

        self.manifest, self.config = library.open_artifact(folder)
        self.name = f"tvm-{self.manifest['target']}"
        target, runtime_only = self.manifest["target"], library.runtime_only()
        if target != "llvm" and (runtime_only or target in TARGETS and resolve(target).gpu):
            raise ExportError(f"{folder}: compiled for {target}, which TVM's VM does not run (no "
                              f"device runtime in this TVM); `k3compile generate {folder}` runs it on its device's "
                              "executor (backends/executor.py)")
        if runtime_only:  # TVM's runtime library alone (lean.import_tvm): the host check without LLVM
            from k3compile.lean import check_host

            check_host(folder, self.manifest)
        else:
            here = resolve(target).describe()
            if self.manifest.get("tvm_target") != here:
                raise ExportError(f"{folder}: compiled for {self.manifest.get('tvm_target')}, not for this machine "
                                  f"({here}); compile it again here")
        self.executable, self._decode_executable, self._params = library.load_artifact(folder, self.manifest,
                                                                                        self.device)

    def _input(self, x: np.ndarray):
        """A TVM tensor of `x`: shared when it is already aligned as TVM needs (a `present` the VM wrote and that
        comes back as `past`), else copied."""
        import tvm

        x = np.ascontiguousarray(x)
        if x.size and x.ctypes.data % 64 == 0:
            return tvm.runtime.from_dlpack(x)
        return self._tensor(x, self.device)

    def init_past(self, batch: int) -> Past:
        return init_past(self.config, batch)

    @torch.no_grad()
    def step(self, input_ids, attention_mask, past: Past):
        check_step(self.config, input_ids, attention_mask, past)
        vm = self._vm_for(input_ids)
        if self.inplace:
            return self._step_inplace(vm, INPLACE_FUNC, input_ids, attention_mask, past)
        feeds = [self._input(x) for x in numpy_inputs(input_ids, attention_mask, past)]
        outs = [torch.from_dlpack(o) for o in vm["main"](*feeds, *self._params)]  # shared, not copied
        return outs[0], unflatten(outs[1:])

    def _caches_for(self, past: Past, batch: int, length: int, needed: int) -> _InPlaceCaches:
        """Buffers holding `past`'s MLA caches (`length` rows) with room for `needed` rows: this backend's own when
        `past` is what it last returned (grown by doubling when full), else new ones with `past` copied in."""
        from tvm.runtime import empty

        mine = next((c for c in self._caches if c.holds(past, batch, length)), None)
        if mine is not None:
            self._caches.remove(mine)
        if mine is not None and mine.capacity >= needed:
            self._caches.append(mine)
            return mine
        capacity = max(MIN_CAPACITY, mine.capacity if mine is not None else 0)
        while capacity < needed:
            capacity *= 2
        caches = _InPlaceCaches(self.config, batch, capacity, self.device, empty)
        caches.fill(past, length)
        self._caches = [*self._caches[-(CACHE_SETS - 1):], caches]
        return caches

    @torch.no_grad()
    def step_last(self, input_ids, attention_mask, past: Past):
        """`step` with the logits of each row's last position only, [B, 1, V] (generate.step_last_of): a prefill
        then skips the LM head for every other position (passes/inplace_caches.py, `main_inplace_last`)."""
        if not (self.inplace and self._last):
            logits, present = self.step(input_ids, attention_mask, past)
            return logits[:, -1:], present
        check_step(self.config, input_ids, attention_mask, past)
        vm = self._vm_for(input_ids)
        return self._step_inplace(vm, LAST_FUNC, input_ids, attention_mask, past)

    def _step_inplace(self, vm, function: str, input_ids, attention_mask, past: Past):
        import tvm

        ids = np.asarray(input_ids, dtype=np.int64)
        mask = np.asarray(attention_mask, dtype=np.int64)
        batch, tokens = ids.shape
        length = mask.shape[1] - tokens
        caches = self._caches_for(past, batch, length, mask.shape[1])
        feeds = [self._input(ids), self._input(mask)]
        first = next((pair[1] for i, pair in enumerate(past) if i not in caches.buffers), None)  # a KDA state
        returned = next((r for r in self._returned if id(first) in r), {})
        for i, pair in enumerate(past):
            feeds += caches.buffers[i] if i in caches.buffers else [self._state(t, returned) for t in pair]
        outs = vm[function](*feeds, tvm.runtime.ShapeTuple([length]), *self._params)
        if tokens * mask.shape[1] >= RELEASE_AT:
            release_pool()
        mla = caches.present(mask.shape[1])  # the buffers main_inplace wrote and returned, as views
        present, mine = [], {}
        for i in range(len(past)):
            if i in mla:
                present.append(mla[i])
                continue
            pair = (outs[1 + 2 * i], outs[2 + 2 * i])
            views = tuple(torch.from_dlpack(x) for x in pair)
            mine.update((id(v), (v, x)) for v, x in zip(views, pair))
            present.append(views)
        self._returned = [*[r for r in self._returned if r is not returned][-(CACHE_SETS - 1):], mine]
        return torch.from_dlpack(outs[0]), present

    def _state(self, t, returned: dict):
        """The TVM tensor to feed for decode-state tensor `t`: the one a step returned `t` as a view of, when `t` is
        that view (`returned`: that step's id -> (view, tensor)); else `t`'s values (copied when misaligned)."""
        hit = returned.get(id(t))
        if hit is not None and hit[0] is t:
            return hit[1]
        return self._input(numpy_state(t))

