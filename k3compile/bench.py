"""`k3compile bench`: eager torch, onnxruntime, TVM and the OpenCL executor side by side on one machine, in one run
(docs/toolchain.md, "Benchmarks").

Rules kept by every measurement here: the backends are built first (export and artifact from the build cache),
every backend then runs in the same process with the same thread count (torch, onnxruntime's intra-op pool and
TVM's pool all set to `threads`), the repetitions are interleaved (rep 1 of every backend, then rep 2, ...) so a
slow phase of the machine hits all of them, and each figure is the median over the repetitions. onnxruntime's idle
threads sleep instead of spinning, and each measurement starts after a pause, so one backend's spinning workers do
not slow the next (a first run without this gave TVM decode repetitions of 23, 45 and 25 tokens/s). Nothing here is
asserted; the JSON records the machine, versions and thread count beside the figures. Load time and peak resident
memory are measured in a fresh process per backend (a process's peak RSS cannot be reset).

Sections:
- decode: tokens/s over `steps` decode steps after a 16-token prompt, batch 1 and 8;
- prefill: tokens/s of one prompt of T tokens (batch 1);
  each step as generate runs it (generate.step_last_of: the logits of the last position; TVM computes only those);
- decode_past (`--decode-past`): batch-1 decode after a prompt of P tokens (prefilled in chunks), TVM and llama.cpp;
- moe_kernel: the TVM MXFP4 expert kernel (top-k routed experts of a token) against torch fp32 `F.linear` on the
  same shapes (the k3 op's own math, experts dequantized ahead), both cycling through routes over every expert of
  a layer, TVM's calls also through copies of the packed experts larger than the last-level cache together (each
  call reads its experts from memory, as a decode step does); a pause before each backend's calls (torch's
  threads spin after its last call and would take the cores TVM's pool needs); with the bytes of the experts a
  call reads over its time (GB/s);
- kda: the TVM KDA kernels (chunked, and the token-by-token recurrence) as T doubles (time per token should
  stay flat: linear in T);
- opencl_profile (with the opencl backend): decode at batch 1 on the OpenCL executor with a profiling queue, the
  kernels' own device time (OpenCL profiling events) as a share of each step's wall time: what the runtime (plan
  evaluation, launches, the logits' download) costs beside the device;
- roofline: bytes of weights a decode token reads (every dense weight, one embedding row, top-k / E of the packed
  experts) and the memory bandwidth measured here (a large array summed by torch) give the decode ceiling; TVM's
  decode is reported as a fraction of it.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from k3compile.llama_bench import QUIET_BOUND
from k3compile.threads import glue_threads

# opencl: SOURCE compiled for opencl, on the OpenCL executor (backends/executor.py); opencl-kernels: the same
# artifact kernel by kernel through host memory (backends/device.py, what `verify --kernels` runs): the runner the
# executor replaced, for the ratio; webgpu: SOURCE compiled for webgpu, on the WebGPU executor
BACKENDS = ("eager", "onnx", "tvm", "tvm-mxfp8", "tvm-bf16", "opencl", "opencl-kernels", "webgpu")
TVM_MXFP8 = "tvm-mxfp8"  # TVM with the dense matrices exported as MXFP8 (compile's --dense-weights mxfp8)
TVM_BF16 = "tvm-bf16"  # TVM with bf16 dense matmuls (compile's --matmul-precision bf16)
LLAMA = "llama.cpp"  # the peer's rows (k3compile/llama_bench.py), with --llama-bench and --gguf
PAST_CHUNK = 1024  # tokens per prefill step when building a long past (a step's scores: heads x chunk x past)
# the backends --decode-past measures (eager and onnxruntime take minutes per past)
PAST_BACKENDS = ("tvm", TVM_MXFP8, TVM_BF16, LLAMA)
DEVICE_BACKENDS = ("opencl", "opencl-kernels", "webgpu")  # the backends that run a GPU artifact: target by name
PROMPT = 16
WARMUP_STEPS = 2  # decode steps before the measured ones
MESH_PROMPT = 8  # run_mesh_bench's prompt length
PAUSE_S = 0.5
COLD_BYTES = 256 << 20  # the MoE kernel row's copies of the packed experts: 8x this machine's 32 MiB L3
COLD_COPIES = 64
MAX_REPEATS = 1000  # a bound for typos: medians settle after a handful


def _median(xs: list[float]) -> float:
    return statistics.median(xs)


def check_run(config, backends: tuple[str, ...], decode_batches: tuple[int, ...], decode_steps: int,
              prefill: tuple[int, ...], prompt: int = PROMPT, decode_past: tuple[int, ...] = ()) -> None:
    """Refuse, before any build, runs that `config` or this machine cannot hold (docs/architecture.md, "Errors"):
    tokens past max_position_embeddings, or a step that does not fit in memory beside the weights of every backend
    (all are loaded at once; sizing.check_step_fits). Each error line names its option and the limit."""
    from k3compile.config import ConfigError
    from k3compile.sizing import check_step_fits, model_size

    limit = config.max_position_embeddings
    for length in prefill:
        if length > limit:
            raise ConfigError(f"--prefill {length}: longer than {config.name}'s max_position_embeddings ({limit})")
    steps = max(decode_steps, WARMUP_STEPS)
    if prompt + steps > limit:
        raise ConfigError(f"--decode-steps {decode_steps}: a run of {prompt + steps} positions exceeds {config.name}'s "
                          f"max_position_embeddings ({limit})")
    weights = len(backends) * model_size(config).resident_bytes
    for length in prefill:
        check_step_fits(config, f"--prefill {length}", 1, length, weights=weights)
    for batch in decode_batches:  # the prompt's step, and the last decode step's cache
        check_step_fits(config, f"--decode-batches {batch}", batch, prompt, weights=weights)
        check_step_fits(config, f"--decode-batches {batch}", batch, 1, prompt + steps - 1, weights=weights)
    for past in decode_past:  # its last prefill chunk after the rest, then the decode steps
        if past + steps > limit:
            raise ConfigError(f"--decode-past {past}: a run of {past + steps} positions exceeds {config.name}'s "
                              f"max_position_embeddings ({limit})")
        chunk = min(past, PAST_CHUNK)
        check_step_fits(config, f"--decode-past {past}", 1, chunk, past - chunk, weights=weights)



def memory_bandwidth(gib: float = 0.5, reps: int = 5) -> float:
    """Bytes/s of reading a large fp32 array (torch sum over `gib` GiB, median of `reps`)."""
    import torch

    a = torch.ones(int(gib * 2**30) // 4)
    a.sum()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        a.sum()
        times.append(time.perf_counter() - t)
    return a.numel() * 4 / _median(times)


def weight_table(path: Path) -> dict:
    """name -> (shape, dtype, bytes) of every tensor of a safetensors file, read from its header only."""
    from safetensors import safe_open

    size = {"F32": 4, "F16": 2, "BF16": 2, "U16": 2, "U8": 1, "I8": 1, "I32": 4, "I64": 8, "BOOL": 1, "F64": 8}
    table = {}
    with safe_open(str(path), "np") as f:
        for name in f.keys():
            sl = f.get_slice(name)
            shape, dtype = list(sl.get_shape()), sl.get_dtype()
            n = 1
            for d in shape:
                n *= d
            table[name] = (shape, dtype, n * size.get(dtype, 4))
    return table


def decode_bytes(config, weights: dict, experts: list[str] | None = None) -> int:
    """Weight bytes one decode token reads from the artifact: all of them, minus the embedding table but one row,
    minus the routed experts a token does not use (top-k of E). `experts`: the manifest's `expert_params` (the
    weights the expert kernels take); an artifact made before it was recorded: its uint8 tensors (then only the
    packed experts were)."""
    total = 0
    routed = config.num_experts_per_token / max(config.num_experts, 1)
    for name, (shape, dtype, nbytes) in weights.items():
        if "embed_tokens" in name:
            total += nbytes // shape[0]
        elif name in experts if experts is not None else dtype == "U8":
            total += int(nbytes * routed)
        else:
            total += nbytes
    return total


def peak_rss() -> int:
    """This process's peak resident memory in bytes: VmHWM (reset by exec, unlike ru_maxrss, which a child started
    by a big parent inherits on Linux), else ru_maxrss."""
    try:
        for line in open("/proc/self/status"):
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def load_probe(kind: str, folder: str, threads: int) -> dict:
    """Run in a fresh process: load one backend, one decode step, report load time and peak RSS."""
    import torch

    from k3compile.threads import use_threads

    use_threads(threads)
    t = time.perf_counter()
    engine = _open(kind, folder, threads)
    load_s = time.perf_counter() - t
    past = engine.init_past(1)
    engine.step(torch.tensor([[1, 2, 3]]), torch.ones(1, 3, dtype=torch.long), past)
    return {"load_s": load_s, "peak_rss_bytes": peak_rss()}


def lean_probe(folder: str, threads: int) -> dict:
    """load_probe of a CPU artifact that `generate` runs without torch (lean.eligible), run as generate runs it, in a
    fresh process that imports neither torch nor TVM's compiler: load time, then a 3-token prompt and one decode
    step, and the process's peak resident memory."""
    from k3compile.lean import LeanArtifact
    from k3compile.threads import use_threads

    use_threads(threads, with_torch=False)
    art = LeanArtifact(folder)
    art.generate([[1, 2, 3]], 2)
    from tvm import base

    return {"load_s": art.load_s, "peak_rss_bytes": peak_rss(),
            "runtime": "torch-free" if sys.modules.get("torch") is None else "torch imported",
            "tvm_compiler_loaded": "tvm_compiler" in base._LOADED_LIBS}


def _open(kind: str, folder: str, threads: int):
    if kind == "eager":
        from k3compile.backends.eager import EagerBackend
        from k3compile.source import load_model

        return EagerBackend(load_model(folder))
    if kind == "onnx":
        from k3compile.backends.onnx import OnnxBackend

        return OnnxBackend(folder, threads=threads, spinning=False)
    if kind in ("opencl", "webgpu"):
        from k3compile.backends.executor import ExecutorBackend

        return ExecutorBackend(folder)
    if kind == "opencl-kernels":
        from k3compile.backends.device import DeviceBackend

        return DeviceBackend(folder, "opencl")
    from k3compile.backends.tvm import TvmBackend

    return TvmBackend(folder)


def _probe_in_subprocess(kind: str, folder: str, threads: int) -> dict:
    """load_probe in a fresh process; a CPU artifact that `generate` runs without torch (lean.eligible) is probed
    as generate runs it, by lean_probe."""
    from k3compile.lean import eligible

    if kind in ("tvm", TVM_MXFP8, TVM_BF16) and eligible(folder):
        code = ("import json; from k3compile.bench import lean_probe; "
                f"print(json.dumps(lean_probe({folder!r}, {threads})))")
    else:
        code = ("import json, sys; from k3compile.bench import load_probe; "
                f"print(json.dumps(load_probe({kind!r}, {folder!r}, {threads})))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    if r.returncode != 0:
        return {"error": (r.stderr.strip().splitlines() or ["failed"])[-1][:200]}
    return json.loads(r.stdout.strip().splitlines()[-1])


def _decode_once(engine, batch: int, steps: int, vocab: int) -> float:
    import torch

    from k3compile.generate import step_last_of

    step = step_last_of(engine)  # what generate runs: logits of the last position
    gen = torch.Generator().manual_seed(batch)
    ids = torch.randint(3, vocab, (batch, PROMPT), generator=gen)
    mask = torch.ones(batch, PROMPT, dtype=torch.long)
    _, past = step(ids, mask, engine.init_past(batch))
    t = time.perf_counter()
    for s in range(steps):
        mask = torch.ones(batch, PROMPT + s + 1, dtype=torch.long)
        _, past = step(torch.randint(3, vocab, (batch, 1), generator=gen), mask, past)
    return batch * steps / (time.perf_counter() - t)


def _decode_at_past(engine, past: int, steps: int, vocab: int) -> float:
    """Tokens/s of `steps` batch-1 decode steps after a prompt of `past` tokens, prefilled in chunks of PAST_CHUNK
    (the graph takes new tokens after a past, so no step holds scores for the whole prompt at once)."""
    import torch

    from k3compile.generate import step_last_of
    from k3compile.llama_bench import LlamaBench

    if isinstance(engine, LlamaBench):
        return engine.decode(1, steps, past)
    step = step_last_of(engine)
    gen = torch.Generator().manual_seed(past)
    state, done = engine.init_past(1), 0
    while done < past:
        n = min(PAST_CHUNK, past - done)
        _, state = step(torch.randint(3, vocab, (1, n), generator=gen), torch.ones(1, done + n, dtype=torch.long),
                        state)
        done += n
    t = time.perf_counter()
    for s in range(steps):
        _, state = step(torch.randint(3, vocab, (1, 1), generator=gen), torch.ones(1, past + s + 1, dtype=torch.long),
                        state)
    return steps / (time.perf_counter() - t)


def _prefill_once(engine, length: int, vocab: int) -> float:
    import torch

    from k3compile.generate import step_last_of

    ids = torch.randint(3, vocab, (1, length), generator=torch.Generator().manual_seed(length))
    mask = torch.ones(1, length, dtype=torch.long)
    past, step = engine.init_past(1), step_last_of(engine)
    t = time.perf_counter()
    step(ids, mask, past)
    return length / (time.perf_counter() - t)


def opencl_profile(folder: str, steps: int, vocab: int, repeats: int) -> dict:
    """Decode at batch 1 on a profiling OpenCL queue: per step, wall time and the kernels' device time (medians of
    `repeats` runs of `steps` steps). The profiling queue is a separate engine, so the tokens/s figures above are
    measured without it."""
    import torch

    from k3compile.backends.executor import ExecutorBackend

    engine = ExecutorBackend(folder, profile=True)
    gen = torch.Generator().manual_seed(1)
    walls, kernels, launches = [], [], 0
    _decode_once(engine, 1, WARMUP_STEPS, vocab)
    for _ in range(repeats):
        ids = torch.randint(3, vocab, (1, PROMPT), generator=gen)
        _, past = engine.step(ids, torch.ones(1, PROMPT, dtype=torch.long), engine.init_past(1))
        engine.driver.kernel_time()  # the prompt's launches are not the figure
        t = time.perf_counter()
        for s in range(steps):
            mask = torch.ones(1, PROMPT + s + 1, dtype=torch.long)
            _, past = engine.step(torch.randint(3, vocab, (1, 1), generator=gen), mask, past)
        walls.append((time.perf_counter() - t) / steps)
        seconds, launches = engine.driver.kernel_time()
        kernels.append(seconds / steps)
    wall, kernel = _median(walls), _median(kernels)
    return {"device": engine.describe(), "step_ms": wall * 1e3, "kernel_ms": kernel * 1e3,
            "kernel_share": kernel / wall, "launches_per_step": launches // steps}


def _decode_any(engine, batch: int, steps: int, vocab: int) -> float | None:
    from k3compile.llama_bench import LlamaBench

    if isinstance(engine, LlamaBench):  # its own tool, in a fresh process, after the same prompt
        return engine.decode(batch, steps, PROMPT)
    return _decode_once(engine, batch, steps, vocab)


def _prefill_any(engine, length: int, vocab: int) -> float:
    from k3compile.llama_bench import LlamaBench

    if isinstance(engine, LlamaBench):
        return engine.prefill(length)
    return _prefill_once(engine, length, vocab)


def _interleaved(engines: dict, repeats: int, measure: Callable) -> dict:
    runs: dict[str, list[float]] = {name: [] for name in engines}
    for _ in range(repeats):
        for name, engine in engines.items():
            time.sleep(PAUSE_S)  # the previous backend's worker threads go idle before this one starts
            with glue_threads(engine):  # torch's threads held as generate holds them (threads.py)
                runs[name].append(measure(engine))
    return {name: {"median": _median(v), "runs": v} for name, v in runs.items()}


def _ratios(rows: dict, base: str = "eager") -> dict:
    base = rows.get(base, {}).get("median")
    return {name: (r["median"] / base if base else None) for name, r in rows.items()}


def _figures(rows: dict) -> dict:
    """A section's rows with their ratios to eager and, when llama.cpp ran, to llama.cpp."""
    return {"tokens_per_s": rows, "vs_eager": _ratios(rows),
            **({"vs_llama_cpp": _ratios(rows, LLAMA)} if LLAMA in rows else {})}


def moe_kernel(config, tgt, repeats: int, tokens: tuple[int, ...] = (1, 8)) -> list[dict]:
    """The MXFP4 expert kernel vs torch fp32 F.linear (dequantized experts), the config's expert shapes."""
    import numpy as np
    import torch
    import torch.nn.functional as F
    import tvm

    from k3compile.kernels.moe import expert_tiles
    from k3compile.kernels.moe import moe_kernel as tvm_moe_kernel
    from k3compile.ops.activations import situ
    from k3compile.quant.mx import dequantize_mxfp4, quantize_mxfp4

    e, k = config.num_experts, config.num_experts_per_token
    d, i = config.routed_expert_hidden_size or config.hidden_size, config.moe_intermediate_size
    gen = torch.Generator().manual_seed(0)
    (w13, s13), (w2, s2) = (quantize_mxfp4(torch.randn(e, 2 * i, d, generator=gen) * 0.05),
                            quantize_mxfp4(torch.randn(e, d, i, generator=gen) * 0.05))
    f13, f2 = dequantize_mxfp4(w13, s13), dequantize_mxfp4(w2, s2)
    lib = tvm.compile(tvm.IRModule({"main": tvm_moe_kernel(e, i, d, 0, True, 4.0, 25.0, target=tgt).with_attr(
        "global_symbol", "main")}), target=tgt.tvm())
    tiles = [expert_tiles(x.numpy()) for x in (w13, w2, s13, s2)]
    # copies of the packed experts, COLD_BYTES of them in all (at most COLD_COPIES), a call's through the next copy
    copies = max(1, min(COLD_COPIES, COLD_BYTES // sum(t.nbytes for t in tiles)))
    packed = [[tvm.runtime.tensor(t) for t in tiles] for _ in range(copies)]
    expert_bytes = sum(x[0].numel() for x in (w13, w2, s13, s2))  # uint8 codes and scale bytes of one expert
    def measure(n: int) -> dict:
        z = torch.randn(n, d, generator=gen)
        w = torch.rand(n, k, generator=gen)
        routes = [torch.randint(0, e, (n, k), generator=gen) for _ in range(8)]  # cycle: no warm single expert
        y = tvm.runtime.empty((n, d), "float32")
        zt, wt = tvm.runtime.tensor(z.numpy()), tvm.runtime.tensor(w.numpy())
        idx = [tvm.runtime.tensor(r.numpy()) for r in routes]

        calls = [0]

        def run_tvm(r):
            lib["main"](zt, idx[r], wt, *packed[calls[0] % copies], y)
            calls[0] += 1

        def run_torch(r):
            out = torch.zeros(n, d)
            for t in range(n):
                for j in range(k):
                    ex = int(routes[r][t, j])
                    h = F.linear(z[t:t + 1], f13[ex])
                    out[t] += w[t, j] * F.linear(situ(h[:, :i], h[:, i:], 4.0, 25.0), f2[ex])[0]
            return out

        times: dict[str, list[float]] = {"tvm_mxfp4": [], "torch_fp32": []}
        run_tvm(0), run_torch(0)  # warm-up: thread pools start, first-touch of the outputs
        for _ in range(repeats):
            for name, fn in (("tvm_mxfp4", run_tvm), ("torch_fp32", run_torch)):
                time.sleep(PAUSE_S)  # the other backend's threads go idle first
                t = time.perf_counter()
                for r in range(len(routes)):
                    fn(r)
                times[name].append((time.perf_counter() - t) / len(routes))
        med = {name: _median(v) for name, v in times.items()}
        # the packed bytes of the experts the routes name (codes + scales), each read once a call
        read = float(np.mean([len(set(r.flatten().tolist())) for r in routes])) * expert_bytes
        return {"tokens": n, "experts": e, "top_k": k, "width": d, "inter": i,
                "tvm_mxfp4_ms": med["tvm_mxfp4"] * 1e3, "torch_fp32_ms": med["torch_fp32"] * 1e3,
                "speedup": med["torch_fp32"] / med["tvm_mxfp4"], "tvm_gb_s": read / med["tvm_mxfp4"] / 1e9}

    rows = [measure(n) for n in tokens]
    return rows


def kda_scaling(config, tgt, repeats: int, lengths: tuple[int, ...] = (256, 512, 1024, 2048)) -> list[dict]:
    """The TVM KDA kernels at batch 1 as T doubles: the chunked one (the compile path's) and the token-by-token
    recurrence, their repetitions interleaved."""
    import numpy as np
    import tvm

    from k3compile.kernels.kda import kda_chunked_kernel, kda_recurrence_kernel

    h, dk = config.kda_num_heads, config.kda_head_dim
    libs = {name: tvm.compile(tvm.IRModule({"main": make(h, dk, dk).with_attr("global_symbol", "main")}),
                              target=tgt.tvm())
            for name, make in (("chunked", kda_chunked_kernel), ("recurrent", kda_recurrence_kernel))}
    rng = np.random.default_rng(0)
    rows = []
    for length in lengths:
        q, k_, v = (rng.standard_normal((1, length, h, dk), dtype=np.float32) * 0.1 for _ in range(3))
        g = -np.abs(rng.standard_normal((1, length, h, dk), dtype=np.float32)) * 0.1
        beta = rng.random((1, length, h), dtype=np.float32)
        s0 = np.zeros((1, h, dk, dk), np.float32)
        args = [tvm.runtime.tensor(x) for x in (q, k_, v, g, beta, s0)]
        outs = [tvm.runtime.empty((1, length, h, dk), "float32"), tvm.runtime.empty((1, h, dk, dk), "float32")]
        times: dict[str, list[float]] = {name: [] for name in libs}
        for lib in libs.values():
            lib["main"](*args, *outs)  # warm-up
        for _ in range(repeats):
            for name, lib in libs.items():
                t = time.perf_counter()
                lib["main"](*args, *outs)
                times[name].append(time.perf_counter() - t)
        chunked, recurrent = _median(times["chunked"]), _median(times["recurrent"])
        rows.append({"T": length, "chunked_ms": chunked * 1e3, "recurrent_ms": recurrent * 1e3,
                     "us_per_token": chunked / length * 1e6, "recurrent_us_per_token": recurrent / length * 1e6,
                     "chunked_speedup": recurrent / chunked})
    return rows


def run_bench(source: str = "k3-small", backends: tuple[str, ...] = BACKENDS, threads: int | None = None,
              repeats: int = 5, decode_batches: tuple[int, ...] = (1, 8), decode_steps: int = 8,
              prefill: tuple[int, ...] = (512, 2048), target="llvm",
              progress: Callable[[str], None] | None = None, llama: tuple[str, str] | None = None,
              allow_busy: bool = False, decode_past: tuple[int, ...] = ()) -> dict:
    """The bench (the module's docstring). `llama`: (llama-bench's path, a GGUF of the same model) to run llama.cpp
    beside the backends (k3compile/llama_bench.py); the machine must be quiet before and after the measurements
    (llama_bench.check_quiet) unless `allow_busy`, which records the busy cores and marks the figures.
    `decode_past`: also batch-1 decode after prompts of these lengths, TVM and llama.cpp only (decode cost as the
    context grows)."""
    import platform

    import onnxruntime
    import torch
    import tvm

    from k3compile.cache import cached_artifact, cached_export
    from k3compile.config import read_config
    from k3compile.llama_bench import LlamaBench
    from k3compile.manifest import WEIGHTS, read_manifest
    from k3compile.presets import load_config
    from k3compile.targets import cpu_record, resolve
    from k3compile.threads import available_cores, use_threads

    check_run(load_config(source), backends, decode_batches, decode_steps, prefill, decode_past=decode_past)
    step = progress or (lambda msg: None)
    threads = use_threads(threads or available_cores())  # capped at the cores; every backend alike
    peer = LlamaBench(*llama, threads) if llama else None  # checked before any build
    target = resolve(target)  # a Target, or its name
    artifact = Path(cached_artifact(source, target=target, progress=step))  # the roofline reads it in any case
    folders = {name: source if name == "eager" else str(artifact) if name == "tvm"
               else str(cached_artifact(source, target=target, progress=step, dense_weights="mxfp8"))
               if name == TVM_MXFP8
               else str(cached_artifact(source, target=target, progress=step, matmul_precision="bf16"))
               if name == TVM_BF16
               else str(cached_artifact(source, target=name.split("-")[0], progress=step)) if name in DEVICE_BACKENDS
               else str(cached_export(source, progress=step)) for name in backends}
    config = read_config(artifact / "config.json")
    manifest = read_manifest(artifact)

    quiet = _quiet(step, "before the measurements", allow_busy)
    step("measuring load time and peak memory (a fresh process per backend)")
    load = {name: _probe_in_subprocess(name, folder, threads) for name, folder in folders.items()}
    step("measuring memory bandwidth")
    bandwidth = memory_bandwidth()

    step("loading the backends")
    engines = {name: _open(name, folder, threads) for name, folder in folders.items()}
    if peer is not None:
        engines[LLAMA] = peer
    vocab = config.vocab_size
    result: dict = {
        "source": source, "threads": threads, "repeats": repeats, "target": manifest["tvm_target"],
        "dense_weights": manifest.get("dense_weights", "fp32"),
        "machine": {"platform": platform.platform(), "cpu": cpu_record(), "cores": available_cores()},
        "versions": {"torch": torch.__version__, "onnxruntime": onnxruntime.__version__, "tvm": tvm.__version__},
        "load": load, "decode": {}, "prefill": {},
        "devices": {name: e.describe() for name, e in engines.items() if name in (*DEVICE_BACKENDS, LLAMA)},
    }
    ours = {name: e for name, e in engines.items() if name != LLAMA}
    for batch in decode_batches:
        step(f"decode, batch {batch}")
        for engine in ours.values():  # warm-up: allocations and first-call compilation are not the figure
            _decode_once(engine, batch, WARMUP_STEPS, vocab)
        runs = engines if peer is None or batch == 1 or peer.batched else ours  # llama-batched-bench: batch > 1
        rows = _interleaved(runs, repeats, lambda e, b=batch: _decode_any(e, b, decode_steps, vocab))
        result["decode"][str(batch)] = _figures(rows)
    for length in prefill:
        step(f"prefill, T = {length}")
        for engine in ours.values():
            _prefill_once(engine, min(length, 64), vocab)
        rows = _interleaved(engines, repeats, lambda e, n=length: _prefill_any(e, n, vocab))
        result["prefill"][str(length)] = _figures(rows)
    if decode_past:
        result["decode_past"] = {}
        deep = {name: e for name, e in engines.items() if name in PAST_BACKENDS}
    for past in decode_past:
        step(f"decode after {past} tokens, batch 1")
        rows = _interleaved(deep, repeats, lambda e, p=past: _decode_at_past(e, p, decode_steps, vocab))
        result["decode_past"][str(past)] = _figures(rows)
    del engines, ours
    if "opencl" in folders:
        step("the OpenCL executor's decode, profiled")
        result["opencl_profile"] = opencl_profile(folders["opencl"], decode_steps, vocab, repeats)

    step("the MXFP4 expert kernel against torch fp32")
    result["moe_kernel"] = moe_kernel(config, target, repeats)
    step("the KDA recurrence as T doubles")
    result["kda"] = kda_scaling(config, target, repeats)

    weights = weight_table(artifact / WEIGHTS)
    per_token = decode_bytes(config, weights, manifest.get("expert_params"))
    ceiling = bandwidth / per_token
    decode_1 = result["decode"].get("1", {}).get("tokens_per_s", {})
    tvm_decode = decode_1.get("tvm", {}).get("median")
    result["roofline"] = {
        "bandwidth_gb_s": bandwidth / 1e9, "bytes_per_decode_token": per_token,
        "ceiling_tokens_per_s": ceiling,
        "tvm_fraction": tvm_decode / ceiling if tvm_decode else None,
    }
    if TVM_MXFP8 in folders:  # its own bytes per token: a quarter of fp32's for the dense matrices
        mx = Path(folders[TVM_MXFP8])
        mx_bytes = decode_bytes(config, weight_table(mx / WEIGHTS), read_manifest(mx).get("expert_params"))
        mx_decode = decode_1.get(TVM_MXFP8, {}).get("median")
        result["roofline"].update({
            "mxfp8_bytes_per_decode_token": mx_bytes, "mxfp8_ceiling_tokens_per_s": bandwidth / mx_bytes,
            "tvm_mxfp8_fraction": mx_decode * mx_bytes / bandwidth if mx_decode else None})
    weight_bytes = sum(nbytes for _, _, nbytes in weights.values())
    result["artifact_weight_bytes"] = weight_bytes
    if "tvm" in load and "peak_rss_bytes" in load["tvm"]:
        result["tvm_peak_rss_vs_weights"] = load["tvm"]["peak_rss_bytes"] / weight_bytes
    after = _quiet(step, "after the measurements", allow_busy)
    result["quiet"] = {"bound_cores": QUIET_BOUND, "busy_cores_before": quiet, "busy_cores_after": after,
                       "checked": not allow_busy}
    return result


def _quiet(step, when: str, allow_busy: bool) -> float:
    """The cores other processes kept busy (`when`), after a pause that lets this process's pools go idle; refused
    past the bound unless `allow_busy`."""
    from k3compile.llama_bench import busy_cores, check_quiet

    step(f"checking that the machine is quiet {when}")
    time.sleep(1.0)
    return busy_cores() if allow_busy else check_quiet(when)


def chart(result: dict, path: str | Path) -> None:
    """A PNG of the decode and prefill tokens/s per backend (needs matplotlib: `pip install k3compile[bench]`)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        from k3compile.errors import UserError

        raise UserError("--png needs matplotlib (pip install 'k3compile[bench]')") from None
    groups = [(f"decode b{b}", r["tokens_per_s"]) for b, r in result["decode"].items()]
    groups += [(f"prefill T={t}", r["tokens_per_s"]) for t, r in result["prefill"].items()]
    names = sorted({n for _, rows in groups for n in rows})
    fig, axes = plt.subplots(1, len(groups), figsize=(3.2 * len(groups), 3.2), squeeze=False)
    for ax, (title, rows) in zip(axes[0], groups):
        ax.bar(names, [rows[n]["median"] if n in rows else 0 for n in names], color=["#888", "#4a7", "#36c"])
        ax.set_title(title)
        ax.set_ylabel("tokens/s")
    fig.suptitle(f"{result['source']}, {result['threads']} threads, median of {result['repeats']}")
    fig.tight_layout()
    fig.savefig(str(path), dpi=100, format="png")  # whatever the file's name ends with (a temporary name)


def run_mesh_bench(source: str, meshes: tuple[str, ...], batch: int = 4, steps: int = 32, repeats: int = 3,
                   progress: Callable[[str], None] | None = None,
                   dispatches: tuple[str, ...] = ("all_reduce",), micro_batches: tuple[int, ...] = (1,),
                   wires: tuple[str, ...] = ("fp32",)) -> dict:
    """Distributed decode of SOURCE over each mesh (`k3compile run` on this machine), a mesh with ep > 1 once per
    dispatch, a mesh with pp > 1 once per micro-batch count, an all-to-all once per wire dtype: decode tokens/s
    (interleaved repetitions, medians, ratio to the first) and bytes per decode token by collective (measured; the
    same in every repetition). Each rank runs max(1, cores / ranks) threads; with more ranks than cores they share
    cores, which the figures include."""
    import platform

    import torch
    import tvm

    from k3compile.cache import cached_sharded
    from k3compile.config import read_config
    from k3compile.presets import load_config
    from k3compile.runtime.launch import default_threads, run
    from k3compile.runtime.worker import Options
    from k3compile.sharding import Mesh, PlanError, make_plan
    from k3compile.sharding.cost import COLLECTIVES
    from k3compile.targets import cpu_record
    from k3compile.threads import available_cores

    step = progress or (lambda msg: None)
    runs = [(m, d) for m in meshes for d in (dispatches if Mesh.parse(m).ep > 1 else ("all_reduce",))]
    config = load_config(source)
    for m, d in runs:  # every mesh refused before the first is built
        mesh = make_plan(config, Mesh.parse(m), d).mesh
        if mesh.dp > batch:
            raise PlanError(f"--mesh {m}: dp={mesh.dp} needs a batch of at least {mesh.dp} (--decode-batches)")
        if max(micro_batches) > -(-batch // mesh.dp):
            raise PlanError(f"--micro-batches {max(micro_batches)}: above the {-(-batch // mesh.dp)} rows a replica "
                            f"of --mesh {m} decodes (--decode-batches)")
    variants = [(m, d, n, wire) for m, d in runs for n in (micro_batches if Mesh.parse(m).pp > 1 else (1,))
                for wire in (wires if d == "all_to_all" else ("fp32",))]
    check_run(config, ("tvm",), (batch,), steps, (), MESH_PROMPT + 1)  # its first new token is the prompt's
    built = {(m, d): cached_sharded(source, m, progress=step, dispatch=d) for m, d in runs}
    folders = {f"{m} {d}" + (f" mb{n}" if len(micro_batches) > 1 and Mesh.parse(m).pp > 1 else "")
               + (f" {wire}" if len(wires) > 1 and d == "all_to_all" else ""): (built[m, d], n, wire)
               for m, d, n, wire in variants}
    vocab = read_config(next(iter(built.values())) / "config.json").vocab_size
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, vocab, (MESH_PROMPT,), generator=gen).tolist() for _ in range(batch)]
    speed: dict[str, list[float]] = {k: [] for k in folders}
    last: dict[str, dict] = {}
    for r in range(repeats):
        for key, (folder, n, wire) in folders.items():
            step(f"repetition {r + 1}/{repeats}: {key}")
            res = run(folder, Options(prompts, steps + 1, micro_batches=n, wire=wire))
            speed[key].append(res["decode_tokens_per_s"])
            last[key] = res
    first = _median(speed[next(iter(folders))])
    rows = {}
    for key in folders:
        ranks = last[key]["ranks"]
        ops = COLLECTIVES
        per_token = {op: sum(r["bytes_per_token"][op] for r in ranks) for op in ops}
        planned = {op: sum(r["predicted_bytes_per_step"][op] / r["rows"] for r in ranks) for op in ops}
        rows[key] = {"ranks": len(ranks), "threads_per_rank": default_threads(len(ranks)),
                     "decode_tokens_per_s": _median(speed[key]), "samples": speed[key],
                     "vs_first": _median(speed[key]) / first, "bytes_per_token": per_token,
                     "plan_bytes_per_token": planned,  # the all-to-all's: expected under uniform routing
                     "bytes_per_token_by_rank": [r["bytes_per_token"] for r in ranks]}
    return {"source": source, "batch": batch, "decode_steps": steps, "repeats": repeats,
            "machine": {"platform": platform.platform(), "cpu": cpu_record(), "cores": available_cores()},
            "versions": {"torch": torch.__version__, "tvm": tvm.__version__}, "meshes": rows}


def mesh_table(result: dict) -> str:
    """The README table of run_mesh_bench: bytes per decode token summed over the ranks (the all-to-all's measured,
    and the plan's expectation under uniform routing beside it)."""
    gather = any(r["bytes_per_token"].get("gather") for r in result["meshes"].values())  # tp > 1: the logits
    lines = ["| mesh, dispatch | ranks x threads | decode tok/s (vs first) | all-reduce B/token | all-to-all B/token "
             "(plan) | send B/token | broadcast B/token |" + (" gather B/token |" if gather else ""),
             "|---|---|---|---|---|---|---|" + ("---|" if gather else "")]
    for key, r in result["meshes"].items():
        b, plan = r["bytes_per_token"], r.get("plan_bytes_per_token", {}).get("all_to_all")
        a2a = f"{b['all_to_all']:,.0f}" + (f" ({plan:,.0f})" if plan else "")
        lines.append(f"| {key.replace('_', '-')} | {r['ranks']} x {r['threads_per_rank']} | "
                     f"{r['decode_tokens_per_s']:.1f} ({r['vs_first']:.2f}x) | {b['all_reduce']:,.0f} | "
                     f"{a2a} | {b['send']:,.0f} | {b['broadcast']:,.0f} |"
                     + (f" {b.get('gather', 0):,.0f} |" if gather else ""))
    return "\n".join(lines)
