"""Program.warm (k3compile/executors/plan.py; docs/architecture.md, "GPU artifacts and their executors"): loading a
launch plan runs main once on placeholder inputs so that the driver compiles its kernels then. Checked on a host
driver (numpy buffers) and a hand-written plan: the placeholders' shapes and values, the host functions not called
and given back, every placeholder buffer returned to the pool once even where main returns an input as it is."""

from __future__ import annotations

import numpy as np

from k3compile.executors.plan import Program


class HostDriver:
    """A driver whose buffers are numpy byte arrays (executors/plan.py's driver interface)."""

    def __init__(self) -> None:
        self.launched: list[tuple[str, tuple]] = []

    def prepare(self, kernels: dict) -> None:
        self.kernels = dict(kernels)

    def alloc(self, nbytes: int):
        return np.zeros(nbytes, np.uint8)

    def upload(self, array: np.ndarray):
        raw = np.asarray(array, order="C").reshape(-1).view(np.uint8)
        buf = self.alloc(max(4, -(-raw.size // 4) * 4))
        buf[:raw.size] = raw
        return buf

    def write(self, handle, array: np.ndarray) -> None:
        raw = np.asarray(array, order="C").reshape(-1).view(np.uint8)
        handle[:raw.size] = raw

    def download(self, handle, nbytes: int, offset: int = 0) -> bytes:
        return handle[offset:offset + nbytes].tobytes()

    def launch(self, name, launch, handles, scalars, grid, block) -> None:
        self.launched.append((name, tuple(scalars)))

    def sync(self) -> None:
        pass


# main(ids [batch, seq] int64, mask [batch, past + seq] int64, state [batch, 4] float32, cache [batch, past] float32,
# w [4] float32):
# y = copy(state) through kernel "copy"; z = the host function k3.all_reduce(y); returns (z, mask)
PLAN = {
    "kernels": {"copy_kernel": "// source"},
    "funcs": {"copy": {
        "params": [{"buffer": True, "dtype": "float32", "shape": ["n", 4], "offset": 0},
                   {"buffer": True, "dtype": "float32", "shape": ["n", 4], "offset": 0}],
        "binds": [], "workspace": [],
        "launches": [{"kernel": "copy_kernel", "params": [], "buffers": [0, 1], "scalars": ["n"],
                      "extents": {"blockIdx.x": "n", "threadIdx.x": 4}}]}},
    "main": {
        "num_input": 4,
        "params": [{"name": "input_ids", "dtype": "int64", "shape": ["batch", "seq"]},
                   {"name": "attention_mask", "dtype": "int64", "shape": ["batch", ["+", "past", "seq"]]},
                   {"name": "state", "dtype": "float32", "shape": ["batch", 4]},
                   {"name": "cache", "dtype": "float32", "shape": ["batch", "past"]},
                   {"name": "w", "dtype": "float32", "shape": [4]}],
        "bindings": [
            {"op": "call", "func": "copy", "args": ["p2"], "scalars": [],
             "results": [{"shape": ["batch", 4], "dtype": "float32"}], "out": "y", "tuple": False},
            {"op": "extern", "symbol": "k3.all_reduce", "args": ["y"],
             "results": [{"shape": ["batch", 4], "dtype": "float32"}], "out": "z", "tuple": False}],
        "result": {"tuple": ["z", "p1"]},
        "weights": ["w"]},
}


def test_warm_runs_main_on_placeholders_without_the_host_functions():
    called: list = []
    externs = {"k3.all_reduce": lambda *a: called.append(a)}
    driver = HostDriver()
    program = Program(PLAN, {}, driver, externs)
    weight = program.upload(np.ones(4, np.float32))
    uploaded: list[np.ndarray] = []
    real_upload = driver.upload
    driver.upload = lambda array: (uploaded.append(np.array(array)), real_upload(array))[1]
    program.warm([weight], {"attention_mask": 1})
    assert [(u.shape, u.dtype.name, u.tolist()) for u in uploaded] == [  # every shape variable 1, mask 1, else 0
        ((1, 1), "int64", [[0]]), ((1, 2), "int64", [[1, 1]]), ((1, 4), "float32", [[0.0] * 4]),
        ((1, 1), "float32", [[0.0]])]
    assert driver.launched == [("copy_kernel", (1,))]
    assert not called and program.externs is externs  # the stand-in answered, the caller's functions are back
    pooled = [id(h) for hs in program._pool.values() for h in hs]
    # the 4 inputs (the mask also returned as it came), y (pooled by run after its last use), z: each once
    assert len(pooled) == len(set(pooled)) == 6
    assert id(weight.handle) not in pooled
    inputs = [program.upload(np.full(s, v, d)) for s, v, d in
              (((1, 1), 5, np.int64), ((1, 2), 1, np.int64), ((1, 4), 2.0, np.float32), ((1, 1), 0.5, np.float32))]
    program.run([*inputs, weight])  # a real call reaches the caller's host function
    assert len(called) == 1
