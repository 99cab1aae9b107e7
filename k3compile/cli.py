"""The `k3compile` command line: a thin click layer. Each command parses, calls one library function, prints.

Errors the user can fix (bad config, checkpoint, token, option) print one line and exit 1; SIGTERM ends a command
like Ctrl-C (its temporary files removed) with one line and exit 143; progress goes to stderr on a terminal;
`--json` prints strict JSON on stdout.
"""

from __future__ import annotations

import json
import logging
import math
import re
import sys
from contextlib import contextmanager, nullcontext

import click

from k3compile import __version__
from k3compile.artifact import ArtifactError, Terminated, sigterm_raises
from k3compile.checkpoint import CheckpointError
from k3compile.config import DEFAULT_PRESET, PRESETS, ConfigError
from k3compile.export import DEFAULT_TOL, ExportError
from k3compile.generate import GenerationError

USER_ERRORS = (ConfigError, CheckpointError, GenerationError, ExportError, ArtifactError)
SEED = click.IntRange(0, 2**64 - 1)  # what torch.Generator.manual_seed takes
EXIT_SIGTERM = 128 + 15


class FiniteFloat(click.FloatRange):
    """A FloatRange that also refuses nan and inf (click's comparisons let nan through every bound)."""

    name = "finite float"

    def convert(self, value, param, ctx):
        v = super().convert(value, param, ctx)
        if not math.isfinite(v):
            self.fail(f"{value!r} is not a finite number", param, ctx)
        return v


class _Group(click.Group):
    """Every command runs with SIGTERM raising Terminated, so that cleanup runs as on Ctrl-C."""

    def invoke(self, ctx):
        try:
            with sigterm_raises():
                return super().invoke(ctx)
        except Terminated:
            click.echo("Error: terminated by SIGTERM (temporary files removed)", err=True)
            ctx.exit(EXIT_SIGTERM)


def _dumps(doc, indent: int | None = None) -> str:
    """Strict JSON: a NaN or Infinity in a result is a bug to report, never bare `NaN` on stdout."""
    try:
        return json.dumps(doc, indent=indent, allow_nan=False)
    except ValueError as e:
        raise click.ClickException(f"a result holds a non-finite number ({e})") from None


@contextmanager
def user_errors():
    """Turn the library's input errors into one-line messages and exit status 1 (no traceback)."""
    try:
        yield
    except USER_ERRORS as e:
        raise click.ClickException(str(e)) from None


def _progress(label: str, quiet: bool):
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
def _status(text: str, quiet: bool):
    """A spinner on a terminal for work without a known length; yields a callback(text) that updates it."""
    if quiet or not sys.stderr.isatty():
        yield lambda msg: None
        return
    from rich.console import Console

    with Console(stderr=True).status(text) as status:
        yield lambda msg: status.update(msg)


@click.group(cls=_Group, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="k3compile")
@click.option("-v", "--verbose", count=True, help="More log output (-v info, -vv debug).")
def main(verbose: int) -> None:
    """k3compile: deploy Kimi K3 (and the Kimi-Linear family) to non-CUDA accelerators.

    SOURCE arguments take a preset name (see `k3compile presets`), an HF config.json (seeded random weights)
    or a checkpoint folder (config.json + safetensors).
    """
    level = logging.WARNING - 10 * verbose
    logging.basicConfig(level=max(level, logging.DEBUG), format="%(levelname)s %(name)s: %(message)s")


@main.command()
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of a table.")
def presets(as_json: bool) -> None:
    """List the built-in presets with parameter counts, active parameters per token and stored bytes."""
    from k3compile.config import preset
    from k3compile.sizing import model_size

    rows = []
    for name in PRESETS:
        cfg = preset(name)
        size = model_size(cfg)
        rows.append({
            "name": name, "layers": cfg.num_hidden_layers, "mla_layers": len(cfg.full_attn_layers),
            "hidden": cfg.hidden_size, "experts": cfg.num_experts, "top_k": cfg.num_experts_per_token,
            "expert_format": cfg.expert_format, "params": size.params, "active_params": size.active_params,
            "bytes": size.bytes,
        })
    if as_json:
        click.echo(_dumps(rows, indent=2))
        return
    from rich.console import Console
    from rich.table import Table

    table = Table(title="k3compile presets (bytes: bf16, routed experts in their stored format)")
    for col in ("preset", "layers (MLA)", "hidden", "experts", "params", "active/token", "bytes"):
        table.add_column(col, justify="left" if col == "preset" else "right")
    for r in rows:
        table.add_row(r["name"], f"{r['layers']} ({r['mla_layers']})", str(r["hidden"]),
                      f"{r['experts']} top-{r['top_k']} {r['expert_format']}", _human(r["params"]),
                      _human(r["active_params"]), _human(r["bytes"], "B"))
    Console(width=None if sys.stdout.isatty() else 120).print(table)


def _human(n: float, unit: str = "") -> str:
    for suffix in ("", "K", "M", "G", "T"):
        if abs(n) < 1000 or suffix == "T":
            return f"{n:.0f}{unit}" if suffix == "" else f"{n:.2f}{suffix}{unit}"
        n /= 1000
    return str(n)


_IDS = re.compile(r"\s*[0-9]+(\s*,\s*[0-9]+)*\s*")  # ASCII digits only: int() would also take "1_0" and "١"


def _parse_ids(text: str) -> list[int]:
    if not _IDS.fullmatch(text):
        raise click.BadParameter(f"{text!r}: expected comma-separated integers such as 1,2,3",
                                 param_hint="--prompt-ids")
    return [int(t) for t in text.split(",")]


THREADS_HELP = "CPU threads for torch and onnxruntime [default: 1 below hidden size 512, else every core]."


@main.command()
@click.argument("source", default=DEFAULT_PRESET)
@click.option("--prompt-ids", "prompt_ids", multiple=True, default=("1,2,3",), show_default=True,
              help="Comma-separated token ids; repeat the option for a left-padded batch.")
@click.option("--max-new-tokens", default=16, show_default=True, type=click.IntRange(min=0))
@click.option("--backend", type=click.Choice(["eager", "onnx", "onnx-reference"]), default="eager", show_default=True,
              help="eager: the PyTorch model; onnx: onnxruntime on an export folder (SOURCE = `k3compile export`'s "
                   "OUT); onnx-reference: onnx.reference on it (slow, small inputs).")
@click.option("--temperature", default=0.0, show_default=True, type=FiniteFloat(min=0.0),
              help="0 is greedy.")
@click.option("--top-p", default=1.0, show_default=True, type=FiniteFloat(min=0.0, max=1.0, min_open=True))
@click.option("--seed", default=0, show_default=True, type=SEED, help="Seed of the sampling.")
@click.option("--weight-seed", default=0, show_default=True, type=SEED,
              help="Seed of the random weights when SOURCE is a preset or a config.json (eager backend).")
@click.option("--experts", type=click.Choice(["auto", "float", "mxfp4"]), default="auto", show_default=True,
              help="Routed-expert weights (eager backend): as stored, dequantized to float, or quantized to MXFP4.")
@click.option("--threads", type=click.IntRange(min=1), default=None, help=THREADS_HELP)
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON.")
@click.option("--quiet", is_flag=True, help="No progress output.")
@click.pass_context
def generate(ctx, source, prompt_ids, max_new_tokens, backend, temperature, top_p, seed, weight_seed, experts, threads,
             as_json, quiet):
    """Generate tokens from SOURCE (default: the k3-tiny preset with seeded random weights)."""
    from k3compile.checkpoint import load_model
    from k3compile.generate import EagerBackend
    from k3compile.generate import generate as run
    from k3compile.threads import default_threads, use_threads

    prompts = [_parse_ids(p) for p in prompt_ids]
    if backend != "eager":
        for name in ("experts", "weight_seed"):
            if ctx.get_parameter_source(name) != click.core.ParameterSource.DEFAULT:
                raise click.UsageError(f"--{name.replace('_', '-')} applies to the eager backend only: an export "
                                       "folder runs the weights it was exported with")
    with user_errors():
        with _status(f"loading {source}", quiet):
            if backend == "eager":
                engine = EagerBackend(load_model(source, seed=weight_seed, experts=experts))
            else:
                from k3compile.onnx_backend import OnnxBackend

                engine = OnnxBackend(source, reference=backend == "onnx-reference", threads=threads)
        use_threads(threads or default_threads(engine.config))
        bar, cb = _progress("generating", quiet)
        with bar or nullcontext():
            result = run(engine, prompts, max_new_tokens, temperature=temperature, top_p=top_p,
                         seed=seed, eos_token_id=engine.config.eos_token_id, progress=cb)
    doc = {
        "source": source, "backend": backend, "prompts": prompts, "tokens": result.tokens,
        "prefill_s": round(result.prefill_s, 6), "decode_s": round(result.decode_s, 6),
        "decode_tokens_per_s": round(result.decode_tokens_per_s, 3) if result.decode_steps else None,
    }
    if as_json:
        click.echo(_dumps(doc))
        return
    for p, toks in zip(prompts, result.tokens):
        click.echo(f"{','.join(map(str, p))} -> {','.join(map(str, toks))}")
    if not quiet:
        rate = f", decode {doc['decode_tokens_per_s']} tok/s" if result.decode_steps else ""
        click.echo(f"[{backend}] prefill {result.prefill_s * 1e3:.1f} ms{rate}", err=True)


@main.command("export")
@click.argument("source", default=DEFAULT_PRESET)
@click.option("-o", "--out", "out", required=True, type=click.Path(file_okay=False),
              help="Output folder (created; written through a temporary folder renamed at the end).")
@click.option("--weights", type=click.Choice(["auto", "mxfp4", "float"]), default="auto", show_default=True,
              help="Routed-expert weights in the file: as SOURCE stores them, packed MXFP4, or float.")
@click.option("--activations", type=click.Choice(["none", "mxfp8", "mxfp8-e5m2"]), default="none",
              show_default=True, help="MXFP8 (E4M3, or E5M2) activation quantization in front of the expert matmuls.")
@click.option("--opset", default=27, show_default=True, type=int, help="Default-domain ONNX opset (>= 27).")
@click.option("--weight-seed", "weight_seed", default=None, type=SEED,
              help="Seed of the random weights when SOURCE is a preset or a config.json [default: 0].")
@click.option("--seed", "seed_alias", default=None, type=SEED, hidden=True, help="Old name of --weight-seed.")
@click.option("--overwrite", is_flag=True,
              help="Replace OUT if it is an earlier k3compile export (never any other folder).")
@click.option("--tolerance", default=DEFAULT_TOL, show_default=True, type=FiniteFloat(min=0.0),
              help="Largest max-abs difference of the parity run (fp32); past it the export fails.")
@click.option("--no-verify", "no_verify", is_flag=True, help="Skip the onnxruntime-vs-eager parity check.")
@click.option("--threads", type=click.IntRange(min=1), default=None, help=THREADS_HELP)
@click.option("--json", "as_json", is_flag=True, help="Print export.json on stdout.")
@click.option("--quiet", is_flag=True, help="No progress output.")
def export_cmd(source, out, weights, activations, opset, weight_seed, seed_alias, overwrite, tolerance, no_verify,
               threads, as_json, quiet):
    """Trace SOURCE with torch.export and write OUT/model.onnx with k3 custom ops, config.json and export.json.

    The graph serves prefill and decode (dynamic batch, new tokens and past length). OUT is written through a
    temporary folder renamed into place once the parity check passed. Compilation to accelerator targets
    (--target, --mesh) extends this command in later releases.
    """
    from k3compile.checkpoint import load_model
    from k3compile.export import check_options, export, source_paths
    from k3compile.threads import default_threads, use_threads
    from k3compile.verify import worst

    if weight_seed is not None and seed_alias is not None and weight_seed != seed_alias:
        raise click.UsageError("--seed is the old name of --weight-seed; give one of them")
    seed = weight_seed if weight_seed is not None else (seed_alias or 0)
    record = _source_record(source, seed, weights)
    with user_errors():
        check_options(out, opset, activations, overwrite, source_paths(record))
        with _status(f"loading {source}", quiet) as status:
            model = load_model(source, seed=seed, experts=weights)
            use_threads(threads or default_threads(model.config))
            doc = export(model, out, opset=opset, activations=activations, overwrite=overwrite,
                         verify=not no_verify, tolerance=tolerance, source=record, progress=status)
    if as_json:
        click.echo(_dumps(doc, indent=2))
        return
    if quiet:
        return
    nodes = ", ".join(f"{v} {k}" for k, v in doc["k3_nodes"].items())
    mib = doc["file_bytes"] / 2**20
    click.echo(f"wrote {out}: opset {doc['opset']}, k3 nodes: {nodes}; {mib:.1f} MiB in {doc['export_s']:.1f} s")
    if "parity" in doc:
        w = worst(doc["parity"])
        click.echo(f"onnxruntime vs eager: max |Δ| {w['max_abs']:.2e} ({w['output']}, {w['phase']})")


def _source_record(source: str, seed: int, weights: str) -> dict:
    """Where the weights came from, so that `verify` can rebuild the eager model."""
    from pathlib import Path

    from k3compile.config import PRESETS

    path = source if source in PRESETS else str(Path(source).resolve())
    return {"source": path, "seed": seed, "experts": weights}


@main.command()
@click.argument("folder", type=click.Path(file_okay=False))
@click.option("--reference", is_flag=True, help="Also run onnx.reference (slow; small inputs).")
@click.option("--tolerance", default=DEFAULT_TOL, show_default=True, type=FiniteFloat(min=0.0),
              help="Largest max-abs difference accepted (fp32).")
@click.option("--decode-steps", default=2, show_default=True, type=click.IntRange(min=0, max=4096))
@click.option("--source", "source_override", default=None,
              help="Rebuild the eager model from here instead of export.json's record.")
@click.option("--threads", type=click.IntRange(min=1), default=None, help=THREADS_HELP)
@click.option("--json", "as_json", is_flag=True)
@click.option("--quiet", is_flag=True, help="No progress output.")
def verify(folder, reference, tolerance, decode_steps, source_override, threads, as_json, quiet):
    """Run eager and onnxruntime (and onnx.reference) on the same inputs; exit 1 past tolerance.

    Checks first that the folder is intact (export.json, config.json, model.onnx agree) and that the source is the
    exported model, before building any weights."""
    from k3compile.checkpoint import load_model
    from k3compile.export import open_export
    from k3compile.threads import default_threads, use_threads
    from k3compile.verify import check_model, check_source, compare

    with user_errors():
        doc, cfg = open_export(folder)
        rec = doc.get("source") or {}
        src = source_override or rec.get("source")
        if not src:
            raise ExportError(f"{folder}: export.json does not say where the weights came from; pass --source")
        check_source(src, cfg)
        with _status("running eager and onnxruntime", quiet):
            model = load_model(src, seed=rec.get("seed", 0), experts=rec.get("experts", "auto"))
            check_model(model, cfg)
            use_threads(threads or default_threads(cfg))
            act = doc.get("activations", "none")
            rows = [dict(r, backend="onnxruntime") for r in
                    compare(model, folder, act, decode_steps=decode_steps, threads=threads)]
            if reference:
                rows += [dict(r, backend="onnx.reference") for r in
                         compare(model, folder, act, reference=True, decode_steps=decode_steps)]
    failed = [r for r in rows if not r["max_abs"] <= tolerance]
    if as_json:
        click.echo(_dumps({"tolerance": tolerance, "ok": not failed, "rows": rows}, indent=2))
    else:
        from rich.console import Console
        from rich.table import Table

        table = Table(title=f"{folder}: eager vs exported (tolerance {tolerance:g})")
        for col in ("backend", "phase", "output", "max abs", "max rel", ""):
            table.add_column(col, justify="right" if col.startswith("max") else "left")
        for r in rows:
            ok = r["max_abs"] <= tolerance  # NaN is not ok
            table.add_row(r["backend"], r["phase"], r["output"], f"{r['max_abs']:.2e}", f"{r['max_rel']:.2e}",
                          "ok" if ok else "FAIL")
        Console(width=None if sys.stdout.isatty() else 120).print(table)
    if failed:
        raise click.ClickException(f"{len(failed)} output(s) past tolerance {tolerance:g}; worst "
                                   f"{max(r['max_abs'] for r in failed):.2e}")


if __name__ == "__main__":
    main()
