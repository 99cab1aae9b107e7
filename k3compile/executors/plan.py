"""Running a launch plan (targets/launch_plan.py) on a device driver: main's bindings in order, each call a PrimFunc
whose device kernels are launched with their buffers, scalars and extents evaluated from the shapes at hand
(docs/architecture.md, "GPU artifacts and their executors"). No TVM: a plan is JSON, its kernels are source text.

A driver (executors/opencl.py; a WebGPU one would give the same) gives `prepare(kernels)` (build every kernel once,
at load), `alloc(nbytes)`, `upload(array)`, `download(handle, nbytes, offset)`, `launch(name, launch, handles,
scalars, grid, block)`, `write(handle, array)` and `sync()`. Tensors stay on the device between calls and between steps
(`DeviceTensor`: a handle, a shape and a dtype); an intermediate is returned to a pool, by byte size, after its last
use, so the steps of one shape reuse their buffers.

An `extern` binding (a collective of a sharded rank's graph) is the one place data crosses to the host inside a
call: its tensor arguments are downloaded, the host function the caller gave for its symbol (`externs`) fills its
results in host memory in TVM's destination-passing order (arguments, then results), and those are written into
device buffers from the pool.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from k3compile.interface import ExportError


class PlanError(ExportError):
    """A launch plan that cannot be run as written (malformed, or a size it cannot evaluate)."""


@dataclass
class DeviceTensor:
    """A tensor in device memory: `handle` is the driver's buffer (at least 4 bytes, a multiple of 4)."""

    handle: object
    shape: tuple[int, ...]
    dtype: str

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * np.dtype(self.dtype).itemsize


def _div(a: int, b: int) -> int:  # C's truncating division (TIR Div on integers)
    q = abs(a) // abs(b)
    return q if (a >= 0) == (b >= 0) else -q


_OPS = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b, "//": lambda a, b: a // b,
        "%": lambda a, b: a % b, "/": _div, "rem": lambda a, b: a - _div(a, b) * b, "min": min, "max": max,
        "<": lambda a, b: int(a < b), "<=": lambda a, b: int(a <= b), ">": lambda a, b: int(a > b),
        ">=": lambda a, b: int(a >= b), "==": lambda a, b: int(a == b), "!=": lambda a, b: int(a != b),
        "and": lambda a, b: int(bool(a) and bool(b)), "or": lambda a, b: int(bool(a) or bool(b))}


def evaluate(e, env: dict[str, int]) -> int:
    """A plan expression's value: a number, a variable of `env`, or [op, args...]."""
    if isinstance(e, bool):
        raise PlanError(f"a size expression holds {e!r}")
    if isinstance(e, int):
        return e
    if isinstance(e, str):
        if e not in env:
            raise PlanError(f"a size refers to {e!r}, which is not known here")
        return env[e]
    if isinstance(e, list) and e and isinstance(e[0], str):
        op, *args = e
        if op == "not" and len(args) == 1:
            return int(not evaluate(args[0], env))
        if op == "select" and len(args) == 3:
            return evaluate(args[1], env) if evaluate(args[0], env) else evaluate(args[2], env)
        if op in _OPS and len(args) == 2:
            a, b = evaluate(args[0], env), evaluate(args[1], env)
            if op in ("//", "%", "/", "rem") and b == 0:
                raise PlanError("a size divides by zero")
            return _OPS[op](a, b)
    raise PlanError(f"a size expression {str(e)[:80]} is malformed")


class Program:
    """A launch plan loaded on a driver: its kernels built, its constants uploaded (weights are the caller's)."""

    def __init__(self, plan: dict, constants: dict[str, np.ndarray], driver, externs: dict | None = None) -> None:
        self.plan, self.driver = plan, driver
        self.externs = externs or {}
        main = plan["main"]
        self.params, self.bindings = main["params"], main["bindings"]
        self.num_input = main["num_input"]
        self.funcs = plan["funcs"]
        driver.prepare(plan["kernels"])
        self.constants = {name: self.upload(np.asarray(a)) for name, a in constants.items()}
        # each binding's last use (its index), so that an intermediate returns to the pool at once
        self._last: dict[str, int] = {}
        for i, b in enumerate(self.bindings):
            self._last[b["out"]] = i  # a value nobody reads dies where it is made
            for name in _names(b):
                self._last[name] = i
        for name in _names({"x": main["result"]}):
            self._last[name] = len(self.bindings)  # returned: never pooled
        self._pool: dict[int, list] = {}

    # ---- memory ---------------------------------------------------------------------------------------------------
    def upload(self, array: np.ndarray) -> DeviceTensor:
        array = np.asarray(array, order="C")  # (np.ascontiguousarray makes a 0-d array 1-d)
        return DeviceTensor(self.driver.upload(array), tuple(array.shape), str(array.dtype))

    def empty(self, shape: tuple[int, ...], dtype: str) -> DeviceTensor:
        nbytes = _room(math.prod(shape) * np.dtype(dtype).itemsize)
        free = self._pool.get(nbytes)
        handle = free.pop() if free else self.driver.alloc(nbytes)
        return DeviceTensor(handle, tuple(shape), dtype)

    def release(self, t: DeviceTensor) -> None:
        self._pool.setdefault(_room(t.nbytes), []).append(t.handle)

    def download(self, t: DeviceTensor, first: int = 0, count: int | None = None) -> np.ndarray:
        """Elements [first, first + count) of t (flat), as a host array."""
        item = np.dtype(t.dtype).itemsize
        count = math.prod(t.shape) - first if count is None else count
        raw = self.driver.download(t.handle, count * item, first * item)
        return np.frombuffer(raw, np.uint8)[:count * item].view(t.dtype).copy()

    # ---- a call of main -------------------------------------------------------------------------------------------
    def run(self, args: list[DeviceTensor]) -> list[DeviceTensor]:
        """main(*args): graph inputs then weights, as device tensors; returns main's results (device tensors)."""
        if len(args) != len(self.params):
            raise PlanError(f"main takes {len(self.params)} values, given {len(args)}")
        env: dict[str, int] = {}
        values: dict[str, object] = {"env": env}  # "env": main's shape variables, for integer values
        _bind_all([(p["shape"], t.shape, f"main's {p['name']}") for p, t in zip(self.params, args)], env)
        for i, (p, t) in enumerate(zip(self.params, args)):
            if t.dtype != p["dtype"]:
                raise PlanError(f"main's {p['name']} is {p['dtype']}, given {t.dtype}")
            values[f"p{i}"] = t
        owned: set[int] = set()  # the tensors this call allocated (by id), pooled when no live name refers to them
        refs: dict[int, set[str]] = {}
        for i, b in enumerate(self.bindings):
            if b["op"] in ("call", "extern"):
                ins = [self._value(a, values) for a in b["args"]]
                outs = [self.empty(tuple(evaluate(d, env) for d in r["shape"]), r["dtype"]) for r in b["results"]]
                if b["op"] == "call":
                    self._call(b["func"], [*ins, *outs], [evaluate(s, env) for s in b["scalars"]])
                else:
                    self._extern(b["symbol"], ins, outs)
                values[b["out"]] = outs if b["tuple"] else outs[0]
                owned.update(id(t) for t in outs)
            elif b["op"] == "item":
                values[b["out"]] = self._value(b["of"], values)[b["index"]]
            else:
                values[b["out"]] = self._value(b["value"], values)
            for t in _tensors(values[b["out"]]):
                refs.setdefault(id(t), set()).add(b["out"])
            for name in {*_names(b), b["out"]}:  # names whose last reader this was: their tensors may go back
                if self._last.get(name) != i:
                    continue
                for t in _tensors(values[name]):
                    live = refs.get(id(t), set())
                    live.discard(name)
                    if not live and id(t) in owned:
                        owned.discard(id(t))
                        self.release(t)
        result = self._value(self.plan["main"]["result"], values)
        return list(result) if isinstance(result, list) else [result]

    def warm(self, weights: list[DeviceTensor], fill: dict[str, int]) -> None:
        """main once on placeholder inputs, its results dropped: every shape variable of its inputs 1 (one row, one
        new position after one cached), each input `fill`'s value by name or 0, the host functions answering zeros
        (a rank's collectives are not called). Drivers compile a kernel's device code at its first launch, not
        when it is built (PoCL for its work-group size: 45 s for one stage of k3-tiny on this kind of machine's
        2-core AMD EPYC; Mesa's lavapipe: 24 s for k3-tiny with a cold shader cache); this does it inside loading,
        and not in the first step, where a rank's peers wait for it only --timeout (docs/architecture.md, "GPU
        artifacts and their executors")."""
        inputs = self.params[:self.num_input]
        # a shape variable appears alone in some input's shape (`run` binds those first: _bind_all)
        env = {d: 1 for p in inputs for d in p["shape"] if isinstance(d, str)}
        args = [self.upload(np.full(tuple(evaluate(d, env) for d in p["shape"]), fill.get(p["name"], 0), p["dtype"]))
                for p in inputs]
        externs, self.externs = self.externs, {s: _zeros for s in self.externs}
        try:
            outs = self.run([*args, *weights])
        finally:
            self.externs = externs
        kept = {id(t.handle) for t in [*weights, *self.constants.values()]}  # a result may be one of these, or an
        for t in [*args, *outs]:  # input as it came: each placeholder's buffer goes back to the pool once
            if id(t.handle) not in kept:
                kept.add(id(t.handle))
                self.release(t)
        self.driver.sync()

    def _value(self, ref, values):
        if isinstance(ref, str):
            return values[ref]
        if "tuple" in ref:
            return [self._value(r, values) for r in ref["tuple"]]
        if "const" in ref:
            return self.constants[ref["const"]]
        if "int" in ref:
            return evaluate(ref["int"], values["env"])
        raise PlanError(f"a value {str(ref)[:80]} is malformed")

    def _extern(self, symbol: str, ins: list, outs: list[DeviceTensor]) -> None:
        """The host function `symbol` on ins (tensors downloaded, integers as they are), filling outs."""
        if symbol not in self.externs:
            raise PlanError(f"the launch plan calls the host function {symbol}, which this run does not provide (a "
                            "sharded rank's collective: run it with `k3compile run`)")
        host = [self.download(a).reshape(a.shape) if isinstance(a, DeviceTensor) else a for a in ins]
        results = [np.empty(t.shape, t.dtype) for t in outs]
        self.externs[symbol](*host, *results)
        for t, r in zip(outs, results):
            self.driver.write(t.handle, r)

    def _call(self, name: str, args: list, scalars: list[int]) -> None:
        """PrimFunc `name` on its arguments in its parameters' order: main's values (tensors, or integers for its
        scalar parameters), its outputs, then the call's scalar arguments."""
        func = self.funcs[name]
        params = func["params"]
        args = [*args, *scalars]
        if len(args) != len(params):
            raise PlanError(f"{name}: takes {len(params)} arguments, given {len(args)}")
        env: dict[str, int] = {}
        handles: dict = {}
        shapes = []
        for i, (p, a) in enumerate(zip(params, args)):
            if p["buffer"] != isinstance(a, DeviceTensor):
                raise PlanError(f"{name}: parameter {i} takes a {'buffer' if p['buffer'] else 'scalar'}")
            if p["buffer"]:
                shapes.append((p["shape"], a.shape, f"{name}'s parameter {i}"))
                if isinstance(p["offset"], str):
                    env[p["offset"]] = 0  # every buffer here starts at its beginning
                handles[i] = a.handle
            else:
                env[p["name"]] = int(a)
        _bind_all(shapes, env)
        for var, value in func["binds"]:
            try:
                env[var] = evaluate(value, env)
            except PlanError:
                continue  # a binding of the host's that no launch reads (a pointer computation)
        scratch = []
        for w in func["workspace"]:
            t = self.empty(tuple(evaluate(d, env) for d in w["shape"]), w["dtype"])
            handles[w["name"]] = t.handle
            scratch.append(t)
        for launch in func["launches"]:
            ext = {tag: evaluate(v, env) for tag, v in launch["extents"].items()}
            grid = tuple(ext.get(f"blockIdx.{a}", 1) for a in "xyz")
            block = tuple(ext.get(f"threadIdx.{a}", 1) for a in "xyz")
            if not math.prod(grid):
                continue
            bufs = [handles[b] for b in launch["buffers"]]
            values = [evaluate(s, env) for s in launch["scalars"]]
            self.driver.launch(launch["kernel"], launch, bufs, values, grid, block)
        for t in scratch:
            self.release(t)


def _zeros(*arrays) -> None:
    """A host function's stand-in in Program.warm: its results zeros."""
    for a in arrays:
        if isinstance(a, np.ndarray):
            a[...] = 0


def _bind_all(shapes: list[tuple[list, tuple, str]], env: dict[str, int]) -> None:
    """Bind every (dims, shape, what): the plain variables first, then check the expressions (a dimension may be
    past + seq before `past` appears alone)."""
    for dims, shape, what in shapes:
        _bind([d if isinstance(d, (str, int)) else None for d in dims], shape, env, what)
    for dims, shape, what in shapes:
        _bind(dims, shape, env, what)


def _bind(dims: list, shape: tuple[int, ...], env: dict[str, int], what: str) -> None:
    if len(dims) != len(shape):
        raise PlanError(f"{what} takes {len(dims)} dimensions, given {len(shape)}")
    for d, n in zip(dims, shape):
        if d is None:
            continue
        if isinstance(d, str):
            if env.setdefault(d, n) != n:
                raise PlanError(f"{what}: {d} is {env[d]} elsewhere, {n} here")
        elif isinstance(d, int):
            if d != n:
                raise PlanError(f"{what} has {n} where {d} is expected")
        elif evaluate(d, env) != n:
            raise PlanError(f"{what} has {n} where {evaluate(d, env)} is expected")


def _names(binding: dict) -> list[str]:
    """The value names a binding reads."""
    out: list[str] = []

    def walk(r):
        if isinstance(r, str):
            out.append(r)
        elif isinstance(r, dict) and "tuple" in r:
            for x in r["tuple"]:
                walk(x)

    for key in ("args", "of", "value", "x"):
        v = binding.get(key)
        if isinstance(v, list):
            for x in v:
                walk(x)
        elif v is not None:
            walk(v)
    return out


def _tensors(value) -> list[DeviceTensor]:
    return [t for v in value for t in _tensors(v)] if isinstance(value, list) else (
        [value] if isinstance(value, DeviceTensor) else [])


def _room(nbytes: int) -> int:
    """A device buffer's size for nbytes: at least 4 and a multiple of 4 (WebGPU; an empty OpenCL buffer is an
    error)."""
    return max(4, -(-nbytes // 4) * 4)
