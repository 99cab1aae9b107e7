"""The decode library and `compile --tune N`, meta_schedule tuning of it (docs/architecture.md, "The decode library
and tuning").

The artifact's `main` serves every batch, sequence and cache length; a CPU compile also builds `decode.so`: the same
graph imported with batch = seq = 1 (one token of one sequence: `generate`'s decode step at batch 1), through the
same phases, sharing `main`'s weights (k3compile/compile.py: `build_decode`). meta_schedule tunes static shapes
only, so with `--tune N` that module's functions are tuned. Its standard-op
PrimFuncs are then static except where the cache length enters (attention), and each static one the target's
rules schedule becomes a meta_schedule task, weighted by its number of calls; TVM's gradient task scheduler shares
the N trials among them. For each tuned task the best tuned schedule and the hand schedule are timed here on the
same random inputs (and their outputs compared): the faster goes into decode.so. The tuning database (meta_schedule
JSON: workloads and records) and the per-function table stay in the artifact.

meta_schedule's builder workers each import TVM's tensor intrinsics first (~1 minute here), hence the long builder
timeout; the cost model is "random" (the "xgb" one needs xgboost).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from pathlib import Path

DECODE_LIBRARY = "decode.so"
WORKLOADS = "tuning_workloads.json"  # meta_schedule's JSON database, kept in the artifact
RECORDS = "tuning_records.json"
BUILDER_TIMEOUT_S = 300
MAX_TASKS = 16
TRIALS_PER_TASK = 4  # trials a task gets at least (one round of the task scheduler each)
FAILED_RUN_S = 1e9  # meta_schedule records a failed measurement as 1e10 s
TIMING_REPEATS = 5
AGREE_RTOL, AGREE_ATOL = 1e-4, 1e-5  # fp32: a tuned schedule may sum in another order, never compute other values

log = logging.getLogger(__name__)


def decode_proto(proto):
    """The export's ONNX with batch = seq = 1 (the cache length stays symbolic)."""
    import copy

    proto = copy.deepcopy(proto)
    for vi in list(proto.graph.input) + list(proto.graph.output):
        for d in vi.type.tensor_type.shape.dim:
            if d.dim_param in ("batch", "seq"):
                d.ClearField("dim_param")
                d.dim_value = 1
            elif d.dim_param == "past+seq":
                d.dim_param = "past+1"
    return proto


def _static(ty) -> bool:
    import tvm

    return all(isinstance(d, tvm.tirx.IntImm) for d in ty.shape)


def static_calls(mod) -> dict:
    """{GlobalVar name: (call count, [argument types], output type)} of the PrimFuncs `main` calls with static
    float tensors only (an integer input is an index: meta_schedule's runner would feed it random values) and not
    yet scheduled (k3 kernels are written scheduled)."""
    import tvm
    from tvm import relax

    call_tir = tvm.ir.Op.get("relax.call_tir")
    found: dict = {}
    for block in mod["main"].body.blocks:
        for binding in block.bindings:
            call = binding.value
            if not (isinstance(call, relax.Call) and call.op.same_as(call_tir)) or len(call.args) > 2:
                continue  # a call with tir_vars (the cache length) is not static
            gv = call.args[0]
            func = mod[gv]
            if func.attrs is not None and "tirx.is_scheduled" in func.attrs:
                continue
            types = [a.ty for a in call.args[1].fields] + [call.ty]
            if not all(isinstance(t, relax.TensorType) and _static(t) and str(t.dtype) == "float32" for t in types):
                continue
            count = found.get(gv.name_hint, (0,))[0]
            found[gv.name_hint] = (count + 1, types[:-1], call.ty)
    return found


def pick_tasks(mod, calls: dict, trials: int) -> list[str]:
    """The functions worth the trials: by estimated FLOPs x calls, at most one per TRIALS_PER_TASK trials (and
    MAX_TASKS), those that compute nothing (reshapes) left out."""
    import tvm
    from tvm.s_tir.analysis import estimate_tir_flops

    work = {n: estimate_tir_flops(tvm.IRModule({"main": mod[n]})) * c[0] for n, c in calls.items()}
    ranked = sorted((n for n in work if work[n] > 0), key=lambda n: (-work[n], n))
    return ranked[:max(1, min(MAX_TASKS, trials // TRIALS_PER_TASK))]


def _random_args(types, seed: int) -> list:
    import numpy as np
    import tvm

    rng = np.random.default_rng(seed)
    out = []
    for ty in types:
        shape = [int(d) for d in ty.shape]
        if str(ty.dtype).startswith("float"):
            out.append(tvm.runtime.tensor(rng.standard_normal(shape).astype(str(ty.dtype))))
        else:  # indices and masks: zeros are in range for every gather
            out.append(tvm.runtime.tensor(np.zeros(shape, dtype=str(ty.dtype))))
    return out


def _time_and_run(func, target, types, seed: int):
    """(median seconds per call, outputs) of `func` built alone for `target`, on seeded random inputs."""
    import numpy as np
    import tvm

    with target.compiling():
        lib = tvm.compile(_workload(func), target=target.tvm())
    args = _random_args(types, seed)
    lib["main"](*args)
    timer = lib.mod.time_evaluator("main", tvm.cpu(), number=10, repeat=TIMING_REPEATS)
    return float(np.median(timer(*args).results)), [a.numpy() for a in args]


def keep_tuned(hand_s: float, tuned_s: float) -> bool:
    """Whether a tuned schedule that computes the same replaces the hand one: when it measured faster."""
    return tuned_s < hand_s


def _workload(func):
    """A PrimFunc as meta_schedule takes it: alone in a module, public as "main" (the builder fails on a private
    function: "This pass must be called after MakePackedAPI")."""
    import tvm

    return tvm.IRModule({"main": func.with_attr("global_symbol", "main")})


def tune_decode(legalized, scheduled, target, trials: int, work_dir: str | Path,
                progress: Callable[[str], None] | None = None):
    """The decode module `scheduled` (hand schedules) with every static PrimFunc replaced by its tuned schedule
    where that measured faster; `legalized` is the same module before scheduling. Returns (module, rows): one row
    per task {function, calls, hand_us, tuned_us, chosen}."""
    import numpy as np
    from tvm.s_tir import meta_schedule as ms

    step = progress or (lambda msg: None)
    calls = static_calls(legalized)
    names = pick_tasks(legalized, calls, trials) if calls else []
    work_dir = Path(work_dir)
    database = ms.database.JSONDatabase(str(work_dir / WORKLOADS), str(work_dir / RECORDS), allow_missing=True)
    if not names:
        return scheduled, []
    tvm_target = target.tvm()
    workloads = {n: _workload(legalized[n]) for n in names}
    tasks = [ms.ExtractedTask(task_name=n, mod=workloads[n], target=tvm_target, dispatched=[workloads[n]],
                              weight=calls[n][0]) for n in names]
    step(f"tuning {len(names)} decode functions, {trials} trials in all (meta_schedule)")
    t0 = time.perf_counter()
    quiet = logging.getLogger("tvm.s_tir.meta_schedule")
    level = quiet.level
    quiet.setLevel(logging.WARNING)  # its task tables go to the work folder's logs, not the terminal
    try:
        contexts, weights = ms.relax_integration.extracted_tasks_to_tune_contexts(tasks, str(work_dir), seed=0)
        with target.compiling():
            ms.tune_tasks(tasks=contexts, task_weights=weights, work_dir=str(work_dir), max_trials_global=trials,
                          num_trials_per_iter=max(1, min(64, trials // len(names))), database=database,
                          cost_model="random",
                          builder=ms.builder.LocalBuilder(max_workers=2, timeout_sec=BUILDER_TIMEOUT_S))
    finally:
        quiet.setLevel(level)
    log.info("tuning took %.1f s", time.perf_counter() - t0)
    step("timing tuned against hand schedules")
    mod = scheduled.clone()
    rows = []
    for seed, name in enumerate(names):
        count, arg_types, out_ty = calls[name]
        workload = workloads[name]
        records = database.get_top_k(database.commit_workload(workload), 1) if database.has_workload(workload) \
            else []
        measured = bool(records) and float(records[0].run_secs[0]) < FAILED_RUN_S
        best = database.query_schedule(workload, tvm_target, workload_name="main") if measured else None
        row = {"function": name, "calls": count, "hand_us": None, "tuned_us": None, "chosen": "hand"}
        types = [*arg_types, out_ty]
        hand_s, hand_out = _time_and_run(mod[name], target, types, seed)
        row["hand_us"] = round(hand_s * 1e6, 2)
        if best is None:
            row["chosen"] = "hand (no valid tuned schedule)"
        else:
            tuned = best.mod["main"].without_attr("global_symbol").with_attr("tirx.is_scheduled", True)
            tuned_s, tuned_out = _time_and_run(tuned, target, types, seed)
            row["tuned_us"] = round(tuned_s * 1e6, 2)
            agree = np.allclose(tuned_out[-1], hand_out[-1], rtol=AGREE_RTOL, atol=AGREE_ATOL, equal_nan=True)
            if not agree:
                row["chosen"] = "hand (tuned output differs)"
            elif keep_tuned(hand_s, tuned_s):
                mod[name] = tuned
                row["chosen"] = "tuned"
        rows.append(row)
    return mod, rows
