"""`k3compile run`: start one worker per rank on this machine with torchrun's elastic launcher and gather what they
decoded (docs/architecture.md, "Sharding and the runtime").

The whole artifact is checked first (every file's sha256, the plan against the config): a damaged one is refused
before any process starts. The launcher's agent watches the workers: when one fails (an error, a kill, a timeout in
a collective), it stops the others and the run ends with one line naming the rank. `summarize` turns the ranks'
results into the tokens per prompt, the decode speed and each rank's bytes per collective next to the plan's
(runtime/report.py).
"""

from __future__ import annotations

import dataclasses
import logging
import signal
import socket
import uuid
from pathlib import Path

from k3compile.runtime.report import summarize
from k3compile.runtime.worker import Options, RuntimeFault, decode

SHUTDOWN_S = 5  # seconds a worker has to exit on SIGTERM when the run ends (torch's failure path keeps its own 30)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def default_threads(world: int) -> int:
    from k3compile.threads import available_cores

    return max(1, available_cores() // world)


def run(folder: str | Path, options: Options) -> dict:
    """Decode with every rank of OUT's mesh as a process of this machine; returns summarize()'s document."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    from k3compile.generate import check_request
    from k3compile.partition import read_sharded

    folder = Path(folder)
    _, cfg, plan = read_sharded(folder)
    check_request(cfg, options.prompts, options.max_new_tokens, options.temperature, options.top_p)
    need = plan.mesh.dp * len(plan.token_sources(0))
    if len(options.prompts) < need:
        raise RuntimeFault(f"mesh {plan.mesh} with {plan.dispatch} dispatch needs a batch of at least {need} prompts "
                           "(every replica, and with all-to-all every rank of a stage, decodes at least one)")
    if options.threads is None:
        options = dataclasses.replace(options, threads=default_threads(plan.mesh.size))
    config = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=plan.mesh.size, run_id=uuid.uuid4().hex,
                          rdzv_backend="c10d", rdzv_endpoint=f"localhost:{free_port()}", max_restarts=0,
                          monitor_interval=0.1, start_method="spawn", shutdown_timeout=SHUTDOWN_S)
    quiet = [logging.getLogger(name) for name in ("torch.distributed.elastic", "torch.multiprocessing.spawn")]
    levels = [q.level for q in quiet]
    for q in quiet:
        q.setLevel(logging.CRITICAL)  # the agent logs each failure at length; the one line below says it
    try:
        out = elastic_launch(config, decode)(str(folder.resolve()), options)
    except ChildFailedError as e:
        raise RuntimeFault(failure_line(e)) from None
    finally:
        for q, level in zip(quiet, levels):
            q.setLevel(level)
    return summarize(folder, out[0]["results"])


def failure_line(e) -> str:
    """The first failed rank and why, from the agent's report."""
    rank, f = min(e.failures.items(), key=lambda kv: kv[1].timestamp)
    if f.exitcode < 0:
        try:
            why = f"killed by {signal.Signals(-f.exitcode).name}"
        except ValueError:
            why = f"killed by signal {-f.exitcode}"
    else:
        msg = f.message if isinstance(f.message, str) else (f.message or {}).get("message", "")
        msg = str(msg).strip().splitlines()[-1] if str(msg).strip() else ""
        why = msg.split(": ", 1)[1] if msg.startswith(("RuntimeFault: ", "RuntimeError: ", "DistBackendError: ")) \
            else (msg or f"exit code {f.exitcode}")
        if why.startswith(f"rank {rank}: "):  # a RuntimeFault names its rank already
            why = why[len(f"rank {rank}: "):]
    return f"rank {rank} failed: {why}"[:500] + " (the other ranks were stopped)"
