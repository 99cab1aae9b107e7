"""`k3compile run`: distributed decode of a sharded artifact, one process per rank on this machine."""

from __future__ import annotations

import click

from k3compile.cli.common import (
    MAX_TIMEOUT,
    SEED,
    START_TIMEOUT_OPTION,
    WIRE_OPTION,
    FiniteFloat,
    IntRange,
    dumps,
    micro_batches_callback,
    node_options,
    parse_ids,
    stuck_safe,
    table_console,
    user_errors,
)


@click.command("run")
@click.argument("folder", type=click.Path(file_okay=False))
@click.option("--prompt-ids", "prompt_ids", multiple=True, default=("1,2,3",), show_default=True,
              help="Comma-separated token ids; repeat the option for a left-padded batch.")
@click.option("--max-new-tokens", default=16, show_default=True, type=IntRange(min=0))
@click.option("--temperature", default=0.0, show_default=True, type=FiniteFloat(min=0.0), help="0 is greedy.")
@click.option("--top-p", default=1.0, show_default=True, type=FiniteFloat(min=0.0, max=1.0, min_open=True))
@click.option("--seed", default=0, show_default=True, type=SEED, help="Seed of the sampling.")
@click.option("--threads", type=IntRange(min=1), default=None,
              help="CPU threads per rank, at most the cores this process may use [default: those cores / ranks, at "
                   "least 1].")
@click.option("--timeout", default=60.0, show_default=True, type=FiniteFloat(min=1.0, max=MAX_TIMEOUT),
              help="Seconds a collective waits for a peer before every rank gives up (and a node waits to reach "
                   "node 0); starting and loading are bounded by --start-timeout.")
@START_TIMEOUT_OPTION
@node_options
@click.option("--device", "devices", default=None, metavar="N[,N...]",
              help="GPU ranks: the device index of each of this node's ranks, in rank order (one index: all of them) "
                   "[default: the driver's variable (K3COMPILE_OPENCL_DEVICE, K3COMPILE_WEBGPU_ADAPTER), else 0].")
@click.option("--micro-batches", "micro_batches", default="auto", show_default=True,
              callback=micro_batches_callback(4096), metavar="M|auto",
              help="Run each step's rows as M micro-batches so that pipeline stages overlap (pp > 1, CPU or GPU "
                   "ranks; at most the rows a replica decodes); auto: pp of them, at most the rows of the smallest "
                   "replica (1 without stages), which keeps every stage busy.")
@WIRE_OPTION
@click.option("--stats", is_flag=True, help="Print each rank's bytes per decode token by collective, measured and "
                                            "as the plan predicts.")
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON.")
@click.option("--quiet", is_flag=True, help="No progress output.")
def command(folder, prompt_ids, max_new_tokens, temperature, top_p, seed, threads, timeout, start_timeout, nnodes,
            node_rank, rendezvous, devices, micro_batches, wire, stats, as_json, quiet):
    """Decode with FOLDER (`k3compile export --mesh`'s OUT): one worker process per rank on this machine, talking
    over torch.distributed (gloo), nothing listening beyond 127.0.0.1. On several machines run it on each with
    --nnodes, --node-rank and --rendezvous (README)."""
    from k3compile.runtime.launch import run
    from k3compile.runtime.rendezvous import Rendezvous
    from k3compile.runtime.worker import Options

    prompts = [parse_ids(p) for p in prompt_ids]
    devices = tuple(parse_ids(devices, "--device")) if devices is not None else ()
    with user_errors():
        rdzv = Rendezvous.parse(rendezvous, nnodes, node_rank)
        res = stuck_safe(lambda: run(folder, Options(prompts, max_new_tokens, temperature, top_p, seed, threads,
                                                     timeout, progress=not quiet and not as_json, devices=devices,
                                                     micro_batches=micro_batches, wire=wire,
                                                     start_timeout=start_timeout), rdzv))
    if res is None:  # another node's share: node 0 prints the result
        if not quiet:
            click.echo(f"node {node_rank}: its ranks decoded; node 0 has the result", err=True)
        return
    if as_json:
        click.echo(dumps(res, indent=2))
        return
    for p, toks in zip(prompts, res["tokens"]):
        click.echo(f"{','.join(map(str, p))} -> {','.join(map(str, toks))}")
    if res["decode_tokens_per_s"] is not None and not quiet:
        from k3compile.sharding import Mesh

        micro = f", {res['micro_batches']} micro-batches" if res["micro_batches"] > 1 else ""
        click.echo(f"decode: {res['decode_tokens_per_s']:.1f} tokens/s over mesh {Mesh(**res['mesh'])} "
                   f"({res['dispatch'].replace('_', '-')} dispatch{micro})")
    if stats:
        _stats(res)


def _stats(res) -> None:
    from rich.table import Table

    t = Table(title="bytes per decode token, measured (plan; the all-to-all's: expected under uniform routing)")
    from k3compile.sharding.cost import COLLECTIVES

    ops = [op for op in COLLECTIVES if op != "gather" or any(r["predicted_bytes_per_step"][op] for r in res["ranks"])]
    for col in ("rank", "rows", *(op.replace("_", "-") for op in ops)):
        t.add_column(col, justify="right")
    for r in res["ranks"]:
        rows = r["rows"]
        t.add_row(str(r["rank"]), str(rows), *(f"{r['bytes_per_token'][op]:,.0f} "
                                               f"({r['predicted_bytes_per_step'][op] / rows:,.0f})" for op in ops))
    table_console().print(t)
