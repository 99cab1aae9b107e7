"""`k3compile verify`: eager against onnxruntime (and onnx.reference) on an export folder."""

from __future__ import annotations

import click

from k3compile.cli.common import DEFAULT_TOL, THREADS_HELP, FiniteFloat, dumps, status, table_console, user_errors


@click.command("verify")
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
def command(folder, reference, tolerance, decode_steps, source_override, threads, as_json, quiet):
    """Run eager and onnxruntime (and onnx.reference) on the same inputs; exit 1 past tolerance.

    Checks first that the folder is intact (export.json, config.json, model.onnx agree) and that the source is the
    exported model, before building any weights."""
    from k3compile.pipeline import verify_export

    with user_errors(), status("running eager and onnxruntime", quiet):
        rows = verify_export(folder, source_override, reference=reference, decode_steps=decode_steps,
                             threads=threads)
    failed = [r for r in rows if not r["max_abs"] <= tolerance]
    if as_json:
        click.echo(dumps({"tolerance": tolerance, "ok": not failed, "rows": rows}, indent=2))
    else:
        from rich.table import Table

        table = Table(title=f"{folder}: eager vs exported (tolerance {tolerance:g})")
        for col in ("backend", "phase", "output", "max abs", "max rel", ""):
            table.add_column(col, justify="right" if col.startswith("max") else "left")
        for r in rows:
            ok = r["max_abs"] <= tolerance  # NaN is not ok
            table.add_row(r["backend"], r["phase"], r["output"], f"{r['max_abs']:.2e}", f"{r['max_rel']:.2e}",
                          "ok" if ok else "FAIL")
        table_console().print(table)
    if failed:
        from k3compile.verify import worst

        raise click.ClickException(f"{len(failed)} output(s) past tolerance {tolerance:g}; worst "
                                   f"{worst(failed)['max_abs']:.2e}")
