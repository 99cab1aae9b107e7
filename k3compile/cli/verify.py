"""`k3compile verify`: eager against onnxruntime (and onnx.reference) on an export folder, and an artifact on its
own target (TVM's VM, or its GPU executor); `--kernels` runs the k3 kernels and the model kernel by kernel on a
device driver."""

from __future__ import annotations

import click

from k3compile.cli.common import (
    DEFAULT_TOL,
    THREADS_HELP,
    FiniteFloat,
    IntRange,
    dumps,
    status,
    table_console,
    user_errors,
)


@click.command("verify")
@click.argument("folder", type=click.Path(file_okay=False))
@click.option("--reference", is_flag=True, help="Also run onnx.reference (slow; small inputs).")
@click.option("--tolerance", default=DEFAULT_TOL, show_default=True, type=FiniteFloat(min=0.0),
              help="Largest max-abs difference accepted (fp32).")
@click.option("--decode-steps", default=2, show_default=True, type=IntRange(min=0, max=4096))
@click.option("--source", "source_override", default=None,
              help="Rebuild the eager model from here instead of export.json's record.")
@click.option("--per-layer", "per_layer", is_flag=True,
              help="One row per backend and layer (the worst of its states over every phase) instead of per output.")
@click.option("--kernels", type=click.Choice(["opencl", "webgpu"]), default=None,
              help="Instead: run the model's k3 kernels for this GPU target on this machine's driver (OpenCL: PoCL; "
                   "WebGPU: wgpu on Vulkan) against the llvm build and eager, then the whole model kernel by kernel "
                   "through host memory (FOLDER: an export, or an artifact compiled for that target).")
@click.option("--device", type=IntRange(0, 4096), default=None, metavar="N",
              help="The device a GPU artifact runs on (its executor's device index; default: the driver's "
                   "environment variable, else the first).")
@click.option("--threads", type=IntRange(min=1), default=None, help=THREADS_HELP)
@click.option("--json", "as_json", is_flag=True)
@click.option("--quiet", is_flag=True, help="No progress output.")
def command(folder, reference, tolerance, decode_steps, source_override, per_layer, kernels, device, threads,
            as_json, quiet):
    """Run eager and onnxruntime (and onnx.reference) on the same inputs, and, when FOLDER is a compiled artifact
    (`k3compile compile`'s OUT), the artifact on its own target: TVM's VM for llvm, its device's executor for a GPU
    target; exit 1 past tolerance.

    Checks first that the folder is intact (export.json, config.json, model.onnx agree; an artifact's manifest and
    every file's sha256) and that the source is the exported model, before building any weights."""
    from k3compile.pipeline import verify_export
    from k3compile.verify import per_layer as by_layer

    if kernels is not None:
        if device is not None:
            raise click.ClickException("--device picks a GPU artifact's device; --kernels runs on the driver's first")
        return _kernels(folder, kernels, tolerance, decode_steps, source_override, threads, as_json, quiet)
    with user_errors(), status("running eager and the exported model", quiet):
        rows = verify_export(folder, source_override, reference=reference, decode_steps=decode_steps,
                             threads=threads, device=device)
    failed = [r for r in rows if not r["max_abs"] <= tolerance]
    if per_layer:
        rows = by_layer(rows)
    if as_json:
        click.echo(dumps({"tolerance": tolerance, "ok": not failed, "rows": rows}, indent=2))
    else:
        from rich.table import Table

        table = Table(title=f"{folder}: eager vs exported (tolerance {tolerance:g})")
        first = ("backend", "layer") if per_layer else ("backend",)
        for col in (*first, "phase", "output", "max abs", "max rel", ""):
            table.add_column(col, justify="right" if col.startswith("max") else "left")
        for r in rows:
            ok = r["max_abs"] <= tolerance  # NaN is not ok
            table.add_row(*(r[c] for c in first), r["phase"], r["output"], f"{r['max_abs']:.2e}",
                          f"{r['max_rel']:.2e}", "ok" if ok else "FAIL")
        table_console().print(table)
    if failed:
        from k3compile.verify import worst

        raise click.ClickException(f"{len(failed)} output(s) past tolerance {tolerance:g}; worst "
                                   f"{worst(failed)['max_abs']:.2e}")


def _kernels(folder, device, tolerance, decode_steps, source_override, threads, as_json, quiet):
    """verify --kernels: the per-kernel table, then the whole model's rows (or why it did not run)."""
    from k3compile.device_check import RTOL
    from k3compile.pipeline import verify_device

    with user_errors(), status(f"running the kernels on {device}", quiet) as step:
        kernels, rows, refused = verify_device(folder, device, source_override, decode_steps, threads, step)
    failed = [k for k in kernels if not k.ok] + [r for r in rows if not r["max_abs"] <= tolerance]
    if as_json:
        click.echo(dumps({"device": device, "rtol": RTOL, "tolerance": tolerance, "ok": not failed,
                          "kernels": [k.as_dict() for k in kernels], "rows": rows, "whole_model_refused": refused},
                         indent=2))
    else:
        from rich.table import Table

        table = Table(title=f"{folder}: k3 kernels on {device} (error / max |reference|, bound {RTOL:g})")
        for col in ("kernel", "inputs", "launches", "vs llvm", "vs eager", ""):
            table.add_column(col, justify="right" if col.startswith("vs") or col == "launches" else "left")
        for k in kernels:
            table.add_row(k.kernel, k.shape, str(k.launches), f"{k.vs_llvm:.1e}", f"{k.vs_eager:.1e}",
                          "ok" if k.ok else "FAIL")
        table_console().print(table)
        if refused:
            click.echo(f"whole model not run on {device}: {refused}")
        else:
            table = Table(title=f"{folder}: whole model on {device}, kernel by kernel, vs eager "
                                f"(tolerance {tolerance:g})")
            for col in ("phase", "output", "max abs", "max rel", ""):
                table.add_column(col, justify="right" if col.startswith("max") else "left")
            for r in rows:
                table.add_row(r["phase"], r["output"], f"{r['max_abs']:.2e}", f"{r['max_rel']:.2e}",
                              "ok" if r["max_abs"] <= tolerance else "FAIL")
            table_console().print(table)
    if failed:
        raise click.ClickException(f"{len(failed)} kernel(s) or output(s) past their bound on {device}")
