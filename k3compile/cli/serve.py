"""`k3compile serve`: an OpenAI-compatible HTTP server over any SOURCE the runtime runs (serving/)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import click

from k3compile.artifact import Terminated
from k3compile.backends.choose import KINDS, open_backend
from k3compile.cli.common import (
    MAX_TIMEOUT,
    SEED,
    START_TIMEOUT_OPTION,
    THREADS_HELP,
    WIRE_OPTION,
    FiniteFloat,
    IntRange,
    node_options,
    status,
    stuck_safe,
    user_errors,
)
from k3compile.config import EXPERT_CHOICES
from k3compile.presets import DEFAULT_PRESET
from k3compile.serving.app import DEFAULT_CACHE_BYTES
from k3compile.serving.engine import BATCH_WAIT_S

LOCAL = "127.0.0.1"


@click.command("serve")
@click.argument("source", default=DEFAULT_PRESET)
@click.option("--host", default=LOCAL, show_default=True,
              help="The address to listen on. Anything but a loopback address exposes the server to the network: "
                   "give --api-key with it.")
@click.option("--port", default=8000, show_default=True, type=IntRange(min=0, max=65535),
              help="The port (0: a free one, printed when the server listens).")
@click.option("--api-key", default=None, envvar="K3COMPILE_API_KEY", show_envvar=True,
              help="Require `Authorization: Bearer KEY` on every path but /health.")
@click.option("--model-name", default=None,
              help="The model name clients ask for (default: the preset's name, or SOURCE's folder name).")
@click.option("--max-batch", default=8, show_default=True, type=IntRange(min=1, max=1024),
              help="Requests decoded together in the running batch.")
@click.option("--batch-wait-ms", default=BATCH_WAIT_S * 1e3, show_default=True, type=FiniteFloat(min=0.0, max=1000.0),
              help="An idle server woken by short prompts waits while more arrive, each within this many ms of the "
                   "last (10 waits at most), so requests sent together are prefilled together (0: no wait).")
@click.option("--max-queue", default=64, show_default=True, type=IntRange(min=0),
              help="Requests waiting for a row; one more is answered 429.")
@click.option("--prefill-chunk", default=None, type=IntRange(min=1),
              help="Tokens per prefill step (default: sized to the prompt and this machine's free memory, at most "
                   "4096); decode steps of the running batch run between a long prompt's chunks.")
@click.option("--cache-block", default=256, show_default=True, type=IntRange(min=1),
              help="The prefix cache keeps the decode state every this many prompt tokens.")
@click.option("--prefix-cache-bytes", default=DEFAULT_CACHE_BYTES, show_default=True, type=IntRange(min=0),
              help="The prefix cache's byte budget (least recently used evicted first; 0: no prefix cache).")
@click.option("--backend", type=click.Choice(KINDS), default="auto", show_default=True,
              help="As `generate --backend`: an artifact on its own target, an export in onnxruntime, anything else "
                   "eager; tvm / onnx build a preset, config or checkpoint into the cache first.")
@click.option("--device", type=IntRange(min=0), default=None, help="A GPU artifact's device index.")
@click.option("--weight-seed", default=0, show_default=True, type=SEED,
              help="Seed of the random weights when SOURCE is a preset or a config.json.")
@click.option("--experts", type=click.Choice(EXPERT_CHOICES), default="auto", show_default=True)
@click.option("--threads", type=IntRange(min=1), default=None, help=THREADS_HELP)
@click.option("--timeout", default=60.0, show_default=True, type=FiniteFloat(min=1.0, max=MAX_TIMEOUT),
              help="A sharded OUT: seconds a collective waits for a rank (as `run --timeout`); a step, a long "
                   "prompt's chunk included, must finish within it.")
@WIRE_OPTION
@START_TIMEOUT_OPTION
@node_options
@click.option("--quiet", is_flag=True, help="No progress output.")
def command(source, host, port, api_key, model_name, max_batch, batch_wait_ms, max_queue, prefill_chunk, cache_block,
            prefix_cache_bytes, backend, device, weight_seed, experts, threads, timeout, wire, start_timeout, nnodes,
            node_rank, rendezvous, quiet):
    """Serve SOURCE (default: the k3-tiny preset) over the OpenAI API: /v1/chat/completions and /v1/completions
    (streamed or not), /v1/models, /health, /metrics. Binds 127.0.0.1 unless --host says otherwise. A sharded OUT
    over several machines: this command on each, node 0 the server (README)."""
    from k3compile.presets import load_config
    from k3compile.runtime.rendezvous import Rendezvous
    from k3compile.threads import default_threads, use_threads

    with user_errors():
        rdzv = Rendezvous.parse(rendezvous, nnodes, node_rank)
        if rdzv.node_rank > 0:
            _serve_node(source, rdzv, threads, device, timeout, wire, start_timeout, quiet)
            return
        cfg = load_config(source)
        use_threads(threads or default_threads(cfg))
        with status(f"loading {source}", quiet) as step:
            from k3compile.lean import runtime_library_for

            runtime_library_for(source, backend)  # this process never compiles
            engine_backend = stuck_safe(lambda: open_backend(
                source, backend, seed=weight_seed, experts=experts, threads=threads, device=device, progress=step,
                timeout=timeout, wire=wire, rendezvous=rdzv if nnodes > 1 else None, start_timeout=start_timeout))
        try:
            _serve(engine_backend, source, host, port, api_key, model_name, max_batch, max_queue, prefill_chunk,
                   cache_block, prefix_cache_bytes, quiet, batch_wait_ms / 1e3)
        finally:
            if hasattr(engine_backend, "close"):  # a sharded artifact's ranks
                engine_backend.close()
        if not quiet:
            click.echo("server stopped", err=True)


def _serve_node(source, rdzv, threads, device, timeout, wire, start_timeout, quiet) -> None:
    """Node R > 0 of a served sharded OUT: its ranks, until node 0's server stops them (runtime/launch.serve_node)."""
    from k3compile.manifest import is_sharded
    from k3compile.runtime.launch import serve_node
    from k3compile.runtime.worker import Options

    if not is_sharded(source):
        raise click.UsageError(f"--node-rank {rdzv.node_rank}: only a sharded OUT's ranks spread over machines; "
                               f"{source} is not one")
    if not quiet:
        click.echo(f"node {rdzv.node_rank}: starting its ranks for the server at {rdzv}", err=True)
    stuck_safe(lambda: serve_node(source, Options([], 0, threads=threads, timeout=timeout,
                                                  devices=() if device is None else (device,), wire=wire,
                                                  start_timeout=start_timeout), rdzv))
    if not quiet:
        click.echo(f"node {rdzv.node_rank}: the server stopped its ranks", err=True)


def _serve(engine_backend, source, host, port, api_key, model_name, max_batch, max_queue, prefill_chunk, cache_block,
           prefix_cache_bytes, quiet, batch_wait: float) -> None:
    from k3compile.serving.app import create_server, serve
    from k3compile.source import kind_of, tokenizer_for

    tokenizer = tokenizer_for(source, engine_backend.config)
    app, engine = create_server(engine_backend, tokenizer, model_name or _default_name(source, kind_of(source)),
                                api_key, max_batch, max_queue, prefill_chunk, cache_block, prefix_cache_bytes,
                                batch_wait)
    if host not in (LOCAL, "localhost", "::1") and api_key is None:
        click.echo(f"warning: listening on {host} without --api-key: anyone who reaches it can use it", err=True)

    def ready(h: str, p: int) -> None:
        shown = f"[{h}]" if ":" in h else h
        click.echo(f"serving {app.state.model_name} ({engine_backend.name}) on http://{shown}:{p}/v1", err=True)
        if not quiet:
            click.echo(_context_line(engine_backend.config, max_batch), err=True)
        sys.stderr.flush()

    try:
        serve(app, host, port, ready)
    except (Terminated, KeyboardInterrupt):  # uvicorn shut down gracefully, then passed the signal on
        pass
    finally:
        engine.close()


def _context_line(cfg, max_batch: int) -> str:
    """The longest context this machine's free memory holds now: the MLA cache grows per token (fp32 rows of
    kv_lora_rank + qk_rope_head_dim per MLA layer, as `plan` prices it: sharding/cost.py), the KDA state does not."""
    import psutil

    from k3compile.sharding import Mesh, make_plan
    from k3compile.sharding.cost import rank_state

    per_token = rank_state(cfg, make_plan(cfg, Mesh()).rank(0), 1, 1, 4)["mla_cache"]
    if not per_token:
        return f"context {cfg.max_position_embeddings:,} tokens (no MLA layer: the state does not grow)"
    holds = psutil.virtual_memory().available // per_token
    return (f"context {cfg.max_position_embeddings:,} tokens; the MLA cache takes {per_token / 1024:,.1f} KiB a token "
            f"a row: free memory holds {holds:,} tokens ({holds // max_batch:,} per row at --max-batch {max_batch})")


def _default_name(source: str, kind: str) -> str:
    from k3compile.source import PRESET

    return source if kind == PRESET else Path(os.path.abspath(source)).name
