"""`k3compile bench --serve` (docs/architecture.md, "Serving"): what `k3compile serve` costs and saves, measured on a
live server process over HTTP, as a client sees it.

- Time to first token of a prompt whose prefix the cache holds (a `prefix`-token shared prefix, a `suffix`-token
  new tail) against the same shape of prompt never seen (a fresh random prefix each time).
- `clients` concurrent streaming requests of `tokens` tokens each against the same requests one by one: total
  generated tokens per second (continuous batching). Both on open connections: the one-by-one requests share one
  keep-alive connection, and the concurrent clients connect before the clock starts.
- One client's decode tokens/s through the server (from its stream's token times) against `generate` on the same
  artifact in this process (the serving overhead: HTTP, SSE, the engine's bookkeeping).

Repetitions are interleaved and the figures are medians. The server runs with the same thread count as `generate`
here, one of them at a time (the server is idle while `generate` runs), and each measurement starts after a pause
(bench.PAUSE_S): TVM's idle workers spin a fixed number of yields after their last task, which on busy cores
stretches over seconds, so the pool of the process that ran last took cores from the next measurement (this
process's worker, after `generate`, spun through the next repetition's uncached prompt and took ~half a core for
~1 s after the cached one, into the concurrent streams; the server's, after the one-by-one requests, into
`generate`). k3-small on the AMD EPYC VM, `--repeats 5`: 8 streams 2.85x one by one without the pauses, 3.21x with.
Requests ask `ignore_eos` (an extension of this server, as vLLM's), so every request generates exactly `tokens`
tokens whatever the random weights pick.

SOURCE is anything `serve` runs: a preset, config or checkpoint (its llvm artifact, built into the cache; with
`matmul_precision` "bf16" compiled as `compile --matmul-precision bf16` compiles it), a compiled
artifact, or a sharded OUT (`export --mesh`; with `mesh`, SOURCE's sharded artifact built into the cache). A
sharded OUT's server and `generate` here each start its ranks (backends/sharded.py; one set idles while the other
runs), each rank with `threads` threads, or by default the machine's cores over the ranks (`run`'s rule).
"""

from __future__ import annotations

import json
import re
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import torch

from k3compile.errors import UserError


class ServeBenchError(UserError):
    pass


def start_server(args: list[str], timeout: float = 600):
    """`k3compile serve ARGS --port 0 --quiet` in a new process: (the process, its base URL) once it listens; its
    stderr lines in `process.log`."""
    argv = [sys.executable, "-m", "k3compile.cli", "serve", *args, "--port", "0", "--quiet"]
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    lines = []
    deadline = time.time() + timeout
    while time.time() < deadline:
        line = proc.stderr.readline()
        if not line:
            break
        lines.append(line)
        m = re.search(r"on (http://[^ ]+)/v1", line)
        if m:
            # the rest of its stderr kept in `proc.log` (a full pipe nobody reads would stop the server)
            proc.log = lines
            threading.Thread(target=lambda: lines.extend(proc.stderr), daemon=True).start()
            return proc, m.group(1)
    proc.kill()
    raise ServeBenchError("the server did not start: " + "".join(lines[-5:]).strip())


def _stream(client, url: str, model: str, prompt: list[int], tokens: int) -> list[float]:
    """One streamed completion; the arrival time of each token, from the request's start (seconds)."""
    body = {"model": model, "prompt": prompt, "max_tokens": tokens, "temperature": 0, "stream": True,
            "ignore_eos": True}
    t0 = time.perf_counter()
    times = []
    with client.stream("POST", url + "/v1/completions", json=body, timeout=600) as r:
        if r.status_code != 200:
            raise ServeBenchError(f"the server answered {r.status_code}: {r.read().decode()[:200]}")
        for line in r.iter_lines():
            if line.startswith("data: {"):
                doc = json.loads(line[6:])
                if "error" in doc:
                    raise ServeBenchError(f"the server failed a request: {doc['error']['message']}")
                now = time.perf_counter() - t0
                times += [now] * len(doc["choices"][0].get("token_ids") or [])
    if len(times) != tokens:
        raise ServeBenchError(f"a request got {len(times)} tokens, not {tokens}")
    return times


def _decode_rate(times: list[float]) -> float:
    return (len(times) - 1) / (times[-1] - times[0]) if len(times) > 1 and times[-1] > times[0] else float("nan")


def run_serve_bench(source: str = "k3-small", threads: int | None = None, repeats: int = 3, prefix: int = 2048,
                    suffix: int = 32, clients: int = 8, tokens: int = 64, cache_block: int = 256,
                    progress: Callable[[str], None] | None = None, allow_busy: bool = False,
                    mesh: str | None = None, dispatch: str = "all_reduce", matmul_precision: str = "fp32") -> dict:
    import asyncio

    import httpx

    from k3compile.backends.choose import open_backend
    from k3compile.bench import PAUSE_S, _quiet
    from k3compile.cache import cached_artifact, cached_sharded
    from k3compile.generate import generate
    from k3compile.manifest import is_sharded, loose_manifest
    from k3compile.presets import load_config
    from k3compile.source import ARTIFACT, kind_of
    from k3compile.targets import cpu_record
    from k3compile.threads import available_cores, use_threads

    step = progress or (lambda msg: None)
    cfg = load_config(source)
    if prefix % cache_block:
        raise ServeBenchError(f"--serve-prefix {prefix} is not a whole number of --cache-block {cache_block} tokens")
    if prefix + suffix + 1 > cfg.max_position_embeddings or 16 + tokens > cfg.max_position_embeddings:
        raise ServeBenchError(f"a prompt of {prefix + suffix} tokens does not fit {cfg.name}'s context "
                              f"({cfg.max_position_embeddings})")
    if mesh is not None:
        from k3compile.sharding import Mesh, make_plan

        if kind_of(source) == ARTIFACT:
            raise ServeBenchError(f"--mesh builds SOURCE's sharded artifact; {source} is compiled already")
        make_plan(cfg, Mesh.parse(mesh), dispatch)  # a mesh the model does not split: refused before any build
    if matmul_precision != "fp32" and (mesh is not None or kind_of(source) == ARTIFACT):
        raise ServeBenchError(f"--matmul-precision builds SOURCE's artifact; {source} is "
                              + ("compiled already" if mesh is None else "sharded (--mesh)"))
    artifact = (str(cached_sharded(source, mesh, progress=step, dispatch=dispatch)) if mesh is not None
                else source if kind_of(source) == ARTIFACT
                else str(cached_artifact(source, progress=step, matmul_precision=matmul_precision)))
    sharded = is_sharded(artifact)
    if not sharded:  # what the artifact was compiled with (an OUT given as SOURCE: its own); open_backend below
        # checks the manifest and every file's sha256, so it is read loosely here, not hashed twice
        matmul_precision = (loose_manifest(artifact).get("matmul_precision") or {}).get("precision", "fp32")
    if sharded:  # each rank's threads: as given, or the cores over the ranks (None: run's rule)
        threads = threads and use_threads(threads)
    else:
        threads = use_threads(threads or available_cores())
    model = Path(artifact).resolve().name
    step("loading the artifact here (generate) and in a server process")
    backend = open_backend(artifact, threads=threads)
    try:
        proc, url = start_server([artifact, *(["--threads", str(threads)] if threads else []), "--max-batch",
                                  str(clients), "--cache-block", str(cache_block)])
    except BaseException:
        getattr(backend, "close", lambda: None)()
        raise
    gen = torch.Generator().manual_seed(0)

    def ids(n: int) -> list[int]:
        return torch.randint(3, cfg.vocab_size, (n,), generator=gen).tolist()

    rows = {k: [] for k in ("ttft_miss_s", "ttft_hit_s", "concurrent_tok_s", "serial_tok_s", "serve_decode_tok_s",
                            "generate_decode_tok_s")}
    try:
        with httpx.Client() as client:
            step("warming up")
            _stream(client, url, model, ids(prefix + suffix), 2)
            generate(backend, [ids(16)], 4)
            quiet = _quiet(step, "before the measurements", allow_busy)
            for r in range(repeats):
                step(f"repetition {r + 1} of {repeats}")
                shared = ids(prefix)
                time.sleep(PAUSE_S)  # before each measurement: the other process's workers go idle (docstring)
                rows["ttft_miss_s"].append(_stream(client, url, model, shared + ids(suffix), 1)[0])
                rows["ttft_hit_s"].append(_stream(client, url, model, shared + ids(suffix), 1)[0])
                prompts = [ids(16) for _ in range(clients)]

                async def together(prompts=prompts):
                    """(the clients' token counts, the seconds from the first request to the last token): the
                    clients connect first (one GET /health each, all at once, so `clients` connections open), and
                    the clock starts once they have, as the one-by-one requests below run on an open connection."""
                    async with httpx.AsyncClient(limits=httpx.Limits(max_keepalive_connections=clients)) as ac:
                        await asyncio.gather(*(ac.get(url + "/health", timeout=60) for _ in prompts))

                        async def one(p):
                            body = {"model": model, "prompt": p, "max_tokens": tokens, "temperature": 0,
                                    "stream": True, "ignore_eos": True}
                            n = 0
                            async with ac.stream("POST", url + "/v1/completions", json=body, timeout=600) as resp:
                                async for line in resp.aiter_lines():
                                    if line.startswith("data: {"):
                                        n += len(json.loads(line[6:])["choices"][0].get("token_ids") or [])
                            return n
                        t0 = time.perf_counter()
                        counts = await asyncio.gather(*(one(p) for p in prompts))
                        return counts, time.perf_counter() - t0

                time.sleep(PAUSE_S)
                counts, wall = asyncio.run(together())
                if sum(counts) != clients * tokens:
                    raise ServeBenchError(f"concurrent requests got {sum(counts)} tokens, not {clients * tokens}")
                rows["concurrent_tok_s"].append(clients * tokens / wall)
                time.sleep(PAUSE_S)
                t0 = time.perf_counter()
                rates = [_decode_rate(_stream(client, url, model, p, tokens)) for p in prompts]
                rows["serial_tok_s"].append(clients * tokens / (time.perf_counter() - t0))
                rows["serve_decode_tok_s"].append(statistics.median(rates))
                time.sleep(PAUSE_S)
                g = generate(backend, [prompts[0]], tokens)
                rows["generate_decode_tok_s"].append(g.decode_tokens_per_s)
            after = _quiet(step, "after the measurements", allow_busy)
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
        getattr(backend, "close", lambda: None)()  # a sharded OUT's ranks
    med = {k: statistics.median(v) for k, v in rows.items()}
    return {
        "source": source, "artifact": artifact, "backend": backend.name, "threads": threads, "repeats": repeats,
        "matmul_precision": matmul_precision, "machine": {"cpu": cpu_record(), "cores": available_cores()},
        "prefix": prefix,
        "suffix": suffix, "clients": clients, "tokens": tokens, "cache_block": cache_block,
        "runs": rows, "medians": med,
        "ttft_hit_over_miss": med["ttft_hit_s"] / med["ttft_miss_s"],
        "concurrent_over_serial": med["concurrent_tok_s"] / med["serial_tok_s"],
        "serve_over_generate": med["serve_decode_tok_s"] / med["generate_decode_tok_s"],
        "quiet": {"busy_cores_before": quiet, "busy_cores_after": after, "checked": not allow_busy},
    }


def serve_table(result: dict) -> str:
    m = result["medians"]
    return "\n".join([
        "| serve | figure | against | ratio |",
        "|---|---|---|---|",
        f"| time to first token, {result['prefix']}-token cached prefix + {result['suffix']} new | "
        f"{m['ttft_hit_s'] * 1e3:.1f} ms | {m['ttft_miss_s'] * 1e3:.1f} ms uncached | "
        f"{result['ttft_hit_over_miss']:.3f} |",
        f"| {result['clients']} concurrent streams x {result['tokens']} tokens | {m['concurrent_tok_s']:.1f} tok/s | "
        f"{m['serial_tok_s']:.1f} tok/s one by one | {result['concurrent_over_serial']:.2f}x |",
        f"| one client's decode through serve | {m['serve_decode_tok_s']:.1f} tok/s | "
        f"{m['generate_decode_tok_s']:.1f} tok/s generate | {result['serve_over_generate']:.2f}x |",
    ])
