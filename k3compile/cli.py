"""The `k3compile` command line: a thin click layer. Each command parses, calls one library function, prints.

Errors the user can fix (bad config, checkpoint, token, option) print one line and exit 1; progress goes to
stderr on a terminal; `--json` prints machine-readable results on stdout.
"""

from __future__ import annotations

import json
import logging
import sys
from contextlib import contextmanager

import click

from k3compile import __version__
from k3compile.checkpoint import CheckpointError
from k3compile.config import DEFAULT_PRESET, PRESETS, ConfigError
from k3compile.generate import GenerationError

USER_ERRORS = (ConfigError, CheckpointError, GenerationError)


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
    from rich.progress import Progress

    bar = Progress(transient=True)
    task = bar.add_task(label, total=None)

    def cb(done: int, total: int) -> None:
        bar.update(task, completed=done, total=total)

    return bar, cb


@contextmanager
def _status(text: str, quiet: bool):
    """A spinner on a terminal for work without a known length (loading, random init)."""
    if quiet or not sys.stderr.isatty():
        yield
        return
    from rich.console import Console

    with Console(stderr=True).status(text):
        yield


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
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
        click.echo(json.dumps(rows, indent=2))
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


def _parse_ids(text: str) -> list[int]:
    try:
        return [int(t) for t in text.replace(" ", "").split(",") if t != ""]
    except ValueError:
        raise click.BadParameter(f"{text!r}: expected comma-separated integers", param_hint="--prompt-ids") from None


@main.command()
@click.argument("source", default=DEFAULT_PRESET)
@click.option("--prompt-ids", "prompt_ids", multiple=True, default=("1,2,3",), show_default=True,
              help="Comma-separated token ids; repeat the option for a left-padded batch.")
@click.option("--max-new-tokens", default=16, show_default=True, type=click.IntRange(min=0))
@click.option("--backend", type=click.Choice(["eager"]), default="eager", show_default=True)
@click.option("--temperature", default=0.0, show_default=True, type=click.FloatRange(min=0.0),
              help="0 is greedy.")
@click.option("--top-p", default=1.0, show_default=True, type=click.FloatRange(min=0.0, max=1.0, min_open=True))
@click.option("--seed", default=0, show_default=True, help="Seed of the random weights (presets) and sampling.")
@click.option("--experts", type=click.Choice(["auto", "float", "mxfp4"]), default="auto", show_default=True,
              help="Routed-expert weights: as stored, dequantized to float, or quantized to MXFP4.")
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON.")
@click.option("--quiet", is_flag=True, help="No progress output.")
def generate(source, prompt_ids, max_new_tokens, backend, temperature, top_p, seed, experts, as_json, quiet):
    """Generate tokens from SOURCE (default: the k3-tiny preset with seeded random weights)."""
    from k3compile.checkpoint import load_model
    from k3compile.generate import EagerBackend
    from k3compile.generate import generate as run

    prompts = [_parse_ids(p) for p in prompt_ids]
    with user_errors():
        with _status(f"loading {source}", quiet):
            model = load_model(source, seed=seed, experts=experts)
        bar, cb = _progress("generating", quiet)
        with bar or _nullctx():
            result = run(EagerBackend(model), prompts, max_new_tokens, temperature=temperature, top_p=top_p,
                         seed=seed, eos_token_id=model.config.eos_token_id, progress=cb)
    doc = {
        "source": source, "backend": backend, "prompts": prompts, "tokens": result.tokens,
        "prefill_s": round(result.prefill_s, 6), "decode_s": round(result.decode_s, 6),
        "decode_tokens_per_s": round(result.decode_tokens_per_s, 3) if result.decode_steps else None,
    }
    if as_json:
        click.echo(json.dumps(doc))
        return
    for p, toks in zip(prompts, result.tokens):
        click.echo(f"{','.join(map(str, p))} -> {','.join(map(str, toks))}")
    if not quiet:
        rate = f", decode {doc['decode_tokens_per_s']} tok/s" if result.decode_steps else ""
        click.echo(f"[{backend}] prefill {result.prefill_s * 1e3:.1f} ms{rate}", err=True)


@contextmanager
def _nullctx():
    yield


if __name__ == "__main__":
    main()
