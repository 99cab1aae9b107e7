"""What every verb of the command line shares: the error and SIGTERM handling, option types, strict JSON output
and progress on stderr (docs/architecture.md, "Errors")."""

from __future__ import annotations

import json
import math
import os
import re
import sys
from contextlib import contextmanager

import click

from k3compile.artifact import Terminated, sigterm_raises
from k3compile.errors import UserError
from k3compile.interface import DEFAULT_TOL
from k3compile.runtime.worker import START_S
from k3compile.sharding.plan import AUTO_MICRO_BATCHES, DISPATCH

__all__ = ["DEFAULT_TOL", "DENSE_HELP", "SEED", "THREADS_HELP", "FiniteFloat", "dense_summary", "dumps", "parse_ids",
           "progress", "status", "user_errors"]

EXIT_SIGTERM = 128 + 15
# docs/architecture.md, "Dense weights"
DENSE_HELP = ("How the compiled artifact stores its dense matrices: fp32; bf16 (half the bytes, widened in the matmul "
              "kernels; only matrices that hold bf16 values, as K3's checkpoints and the presets do); mxfp8 (a "
              "quarter: E4M3 values with a scale per 32, decoded in the kernels; the export quantizes the model's "
              "dense matrices, and eager and verify use the same values); auto: mxfp8 for an export made so, else "
              "bf16 where that is exact, else fp32. GPU targets keep fp32.")


def dense_summary(manifest: dict) -> str:
    """The manifest's dense matrices for a one-line report: "bf16 matrices", or "matrices: 40 mxfp8, 3 bf16"."""
    counts = manifest.get("dense_matrices") or {}
    if len(counts) <= 1:
        return f"{manifest.get('dense_weights', 'fp32')} matrices"
    return "matrices: " + ", ".join(f"{n} {fmt}" for fmt, n in sorted(counts.items(), key=lambda kv: -kv[1]))


_NUMBER = re.compile(r"\s*[-+]?[0-9]+\s*")  # what an integer option takes: int() would also take "1_0" and "５"


def _short(value: str) -> str:
    return repr(value[:24]) + ("…" if len(value) > 24 else "")


class IntRange(click.IntRange):
    """click's IntRange taking ASCII digits only (no "１" or "1_0", which int() accepts), at most 40 of them (int()
    refuses 4300 with a traceback; the range says the rest)."""

    def convert(self, value, param, ctx):
        if isinstance(value, str) and not (_NUMBER.fullmatch(value) and len(value.strip().lstrip("+-")) <= 40):
            self.fail(f"{_short(value)} is not an integer in ASCII digits", param, ctx)
        return super().convert(value, param, ctx)


class FiniteFloat(click.FloatRange):
    """A FloatRange that also refuses nan and inf (click's comparisons let nan through every bound) and numbers not
    written in ASCII."""

    name = "finite float"

    def convert(self, value, param, ctx):
        if isinstance(value, str) and (not value.isascii() or "_" in value):
            self.fail(f"{_short(value)} is not a number in ASCII digits", param, ctx)
        v = super().convert(value, param, ctx)
        if not math.isfinite(v):
            self.fail(f"{value!r} is not a finite number", param, ctx)
        return v


class Group(click.Group):
    """Every command runs with SIGTERM raising Terminated, so that cleanup runs as on Ctrl-C. `verbs`: the commands,
    each the `command` of module k3compile.cli.<verb>, imported when it is asked for (a command's imports cost only
    its own runs: `generate` on a CPU artifact never imports torch, k3compile/lean.py)."""

    def __init__(self, *args, verbs: tuple[str, ...] = (), **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.verbs = verbs

    def list_commands(self, ctx) -> list[str]:
        return [*self.verbs, *(n for n in super().list_commands(ctx) if n not in self.verbs)]

    def get_command(self, ctx, name: str):
        if name in self.verbs and name not in self.commands:
            import importlib

            self.add_command(importlib.import_module(f"k3compile.cli.{name}").command, name)
        return super().get_command(ctx, name)

    def invoke(self, ctx):
        try:
            with sigterm_raises():
                return super().invoke(ctx)
        except Terminated:
            click.echo("Error: terminated by SIGTERM (temporary files removed)", err=True)
            ctx.exit(EXIT_SIGTERM)


def dumps(doc, indent: int | None = None) -> str:
    """Strict JSON: a NaN or Infinity in a result is a bug to report, never bare `NaN` on stdout."""
    try:
        return json.dumps(doc, indent=indent, allow_nan=False)
    except ValueError as e:
        raise click.ClickException(f"a result holds a non-finite number ({e})") from None


@contextmanager
def user_errors():
    """Turn the library's input errors (errors.UserError) into one-line messages and exit status 1."""
    try:
        yield
    except UserError as e:
        raise click.ClickException(str(e)) from None


def progress(label: str, quiet: bool):
    """A callback(done, total) drawing a rich progress bar on a terminal; silent otherwise."""
    if quiet or not sys.stderr.isatty():
        return None, None
    from rich.console import Console
    from rich.progress import Progress

    bar = Progress(console=Console(stderr=True), transient=True)  # never on stdout, which may carry --json
    task = bar.add_task(label, total=None)

    def cb(done: int, total: int) -> None:
        bar.update(task, completed=done, total=total)

    return bar, cb


@contextmanager
def status(text: str, quiet: bool):
    """A spinner on a terminal for work without a known length; yields a callback(text) that updates it."""
    if quiet or not sys.stderr.isatty():
        yield lambda msg: None
        return
    from rich.console import Console

    with Console(stderr=True).status(text) as status:
        yield lambda msg: status.update(msg)




_IDS = re.compile(r"\s*[0-9]+(\s*,\s*[0-9]+)*\s*")  # ASCII digits only: int() would also take "1_0" and "١"


def parse_ids(text: str, option: str = "--prompt-ids") -> list[int]:
    if not _IDS.fullmatch(text):
        raise click.BadParameter(f"{text!r}: expected comma-separated integers such as 1,2,3", param_hint=option)
    parts = [t.strip() for t in text.split(",")]
    long = next((t for t in parts if len(t.lstrip("0")) > 18), None)  # past any vocabulary (and int()'s 4300 digits)
    if long is not None:
        what = "is outside any vocabulary" if option == "--prompt-ids" else "is too large"
        raise click.BadParameter(f"{'token id ' if option == '--prompt-ids' else ''}{long[:20]}... {what}",
                                 param_hint=option)
    return [int(t) for t in parts]


def micro_batches_callback(top: int):
    """--micro-batches' callback (plan, run): a count from 1 to `top`, or "auto" (AUTO_MICRO_BATCHES)."""
    bound = IntRange(1, top)

    def parse(ctx, param, value: str) -> int:
        if value == "auto":
            return AUTO_MICRO_BATCHES
        try:
            return bound.convert(value, param, ctx)
        except click.BadParameter:
            raise click.BadParameter(f"{value!r} is neither a count from 1 to {top} nor 'auto'") from None
    return parse


SEED = IntRange(0, 2**64 - 1)  # a 64-bit seed (decoding.Sampler's PCG64 takes any; torch's weight draws this)
THREADS_HELP = ("CPU threads for torch, onnxruntime and TVM, at most the cores this process may use [default: 1 below "
                "hidden size 512, else every core].")


def table_console():
    """A rich Console for tables on stdout: 120 columns when piped."""
    from rich.console import Console

    return Console(width=None if sys.stdout.isatty() else 120)


def print_sharded(manifest, out, mesh, dispatch, as_json, quiet) -> None:
    """What `export --mesh` and `compile --mesh` print about the sharded OUT they wrote."""
    if as_json:
        click.echo(dumps(manifest, indent=2))
    elif not quiet:
        click.echo(f"wrote {out}: {len(manifest['ranks'])} ranks ({mesh}, {dispatch}), {manifest['builds']} distinct "
                   f"libraries, built in {manifest['build_s']:.1f} s; run it with `k3compile run {out}`")


# `run`, and `serve` / `generate` of a sharded OUT: the all-to-all dispatch's vectors on the wire (runtime/worker.py)
WIRE_OPTION = click.option(
    "--wire-dtype", "wire", type=click.Choice(["fp32", "bf16"]), default="fp32", show_default=True,
    help="A sharded OUT with the all-to-all dispatch: its latent vectors on the wire, fp32 (exact, as the graph "
         "computes them) or bf16 (half the bytes, each vector rounded; the expert ids and weights stay exact).")


def node_options(fn):
    """`run`'s and `serve`'s --nnodes / --node-rank / --rendezvous: a sharded OUT's ranks over several machines."""
    fn = click.option("--rendezvous", default=None, metavar="HOST:PORT",
                      help="With --nnodes > 1: an address of node 0 that every node reaches; node 0 listens on it "
                           "(only), the others join it. Default: this machine alone, on 127.0.0.1. See the README's "
                           "trust model.")(fn)
    fn = click.option("--node-rank", default=0, show_default=True, type=IntRange(0, 4095),
                      help="This machine's place among the --nnodes (node 0 hosts the rendezvous; `run`: it prints "
                           "the result, `serve`: it is the server).")(fn)
    return click.option("--nnodes", default=1, show_default=True, type=IntRange(1, 4096),
                        help="A sharded OUT: machines its ranks are spread over (ranks in node order); run this "
                             "command on each.")(fn)


def stuck_safe(fn):
    """fn(); a rendezvous whose store client still waits in a thread ends the process with its one line (os._exit,
    without unwinding that thread: runtime/rendezvous.py)."""
    from k3compile.runtime.rendezvous import RendezvousError

    try:
        return fn()
    except RendezvousError as e:
        if not e.stuck_thread:
            raise
        click.echo(f"Error: {e}", err=True)
        sys.stderr.flush()
        os._exit(1)


# `run` and `serve` of a sharded OUT: how long the ranks may take to load before they wait for each other
MAX_TIMEOUT = 7 * 24 * 3600.0  # a week: past it a timeout only overflows torch's timedelta
START_TIMEOUT_OPTION = click.option(
    "--start-timeout", "start_timeout", default=START_S, show_default=True,
    type=FiniteFloat(min=1.0, max=MAX_TIMEOUT),
    help="A sharded OUT: seconds its ranks may take to start, join each other and load their libraries and "
         "weights (a large shard takes minutes); --timeout bounds every wait after that.")


def name_list(choices):
    """A click callback: a list like eager,tvm of distinct names from `choices`, no empty item."""
    def parse(ctx, param, text: str) -> tuple[str, ...]:
        names = tuple(t.strip() for t in text.split(","))
        if not set(names) <= set(choices) or len(set(names)) != len(names):
            raise click.BadParameter(f"{text!r}: expected distinct names from {', '.join(choices)}")
        return names

    return parse


# `--dispatch` (bench --mesh, plan): the CLI spelling of the plan's vocabulary
DISPATCH_FLAGS = {d.replace("_", "-"): d for d in DISPATCH}
