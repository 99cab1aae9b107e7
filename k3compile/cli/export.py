"""`k3compile export`: trace a source to ONNX with k3 ops, gated on parity."""

from __future__ import annotations

import click

from k3compile.cli import common
from k3compile.cli.common import (
    DEFAULT_TOL,
    DENSE_HELP,
    SEED,
    THREADS_HELP,
    FiniteFloat,
    IntRange,
    dumps,
    status,
    user_errors,
)
from k3compile.config import EXPERT_CHOICES
from k3compile.modes import ACT_QUANT_FLAGS, DENSE_CHOICES
from k3compile.presets import DEFAULT_PRESET


@click.command("export")
@click.argument("source", default=DEFAULT_PRESET)
@click.option("-o", "--out", "out", required=True, type=click.Path(file_okay=False),
              help="Output folder (created; written through a temporary folder renamed at the end).")
@click.option("--weights", type=click.Choice(EXPERT_CHOICES), default="auto", show_default=True,
              help="Routed-expert weights in the file: as SOURCE stores them, packed MXFP4, or float.")
@click.option("--activations", type=click.Choice(list(ACT_QUANT_FLAGS)), default="none",
              show_default=True, help="MXFP8 (E4M3, or E5M2) activation quantization in front of the expert matmuls.")
@click.option("--opset", default=27, show_default=True, type=IntRange(min=0), help="Default-domain ONNX opset (>= 27).")
@click.option("--weight-seed", "weight_seed", default=None, type=SEED,
              help="Seed of the random weights when SOURCE is a preset or a config.json [default: 0].")
@click.option("--seed", "seed_alias", default=None, type=SEED, hidden=True, help="Old name of --weight-seed.")
@click.option("--overwrite", is_flag=True,
              help="Replace OUT if it is an earlier k3compile export (never any other folder).")
@click.option("--tolerance", default=DEFAULT_TOL, show_default=True, type=FiniteFloat(min=0.0),
              help="Largest max-abs difference of the parity run (fp32); past it the export fails.")
@click.option("--no-verify", "no_verify", is_flag=True, help="Skip the onnxruntime-vs-eager parity check.")
@click.option("--target", default=None,
              help="Also compile with TVM for this target (llvm: this CPU): OUT is then the compiled artifact "
                   "(`k3compile compile`'s OUT, holding the ONNX too).")
@click.option("--dense-weights", "dense", type=click.Choice(DENSE_CHOICES), default="auto", show_default=True,
              help=DENSE_HELP + " mxfp8 also applies to an ONNX export (no --target): it holds the MXFP8 values, "
                   "which a later `compile` stores as such.")
@click.option("--mesh", default=None, metavar="[tp=T,]ep=E[,pp=P][,dp=D]",
              help="Shard over this device mesh (tp: heads, widths and vocabulary; ep: experts; pp: stages; dp: "
                   "replicas): OUT holds one library and weight file per rank and a manifest with the plan and each "
                   "rank's step schedule; run it with `k3compile run OUT`.")
@click.option("--dispatch", type=click.Choice(["all-reduce", "all-to-all"]), default="all-reduce", show_default=True,
              help="With --mesh: how the ranks of a stage join their expert slices: all-reduce the latent partial "
                   "sums (every rank computes every row), or split the rows and send each token to its experts' "
                   "ranks and back (all-to-all with static no-drop buffers).")
@click.option("--threads", type=IntRange(min=1), default=None, help=THREADS_HELP)
@click.option("--json", "as_json", is_flag=True, help="Print export.json (with --target: manifest.json) on stdout.")
@click.option("--quiet", is_flag=True, help="No progress output.")
def command(source, out, weights, activations, opset, weight_seed, seed_alias, overwrite, tolerance, no_verify,
            target, dense, mesh, dispatch, threads, as_json, quiet):
    """Trace SOURCE with torch.export and write OUT/model.onnx with k3 custom ops, config.json and export.json.

    The graph serves prefill and decode (dynamic batch, new tokens and past length). OUT is written through a
    temporary folder renamed into place once the parity check passed. With --target, the export is compiled in
    the same run and OUT is the compiled artifact (as `k3compile compile` writes it).
    """
    from k3compile import source as sources
    from k3compile.export import check_options, source_paths
    from k3compile.pipeline import export_checked
    from k3compile.threads import default_threads, use_threads
    from k3compile.verify import worst

    if weight_seed is not None and seed_alias is not None and weight_seed != seed_alias:
        raise click.UsageError("--seed is the old name of --weight-seed; give one of them")
    seed = weight_seed if weight_seed is not None else (seed_alias or 0)
    record = sources.record(source, seed, weights)
    if mesh is not None and dense != "auto":
        raise click.UsageError("--dense-weights does not apply to --mesh (its ranks store bf16 matrices where "
                               "they hold bf16 values, else fp32)")
    if target is None and dense not in ("auto", "mxfp8"):
        raise click.UsageError(f"--dense-weights {dense} applies to a compiled artifact: give --target")
    held = "mxfp8" if dense == "mxfp8" else "source"  # what the export's matrices hold (quant/dense.py)
    if mesh is not None:
        return _export_sharded(source, out, mesh, target, seed, weights, activations, opset, overwrite,
                               threads, as_json, quiet, dispatch)
    with user_errors():
        check_options(out, opset, activations, overwrite, source_paths(record))
        if target is not None:
            from k3compile.targets import resolve

            target = resolve(target)  # once, here: the library takes the Target
        with status(f"loading {source}", quiet) as step:
            model = sources.load_model(source, seed=seed, experts=weights)
            use_threads(threads or default_threads(model.config))
            if target is not None:
                return _export_and_compile(model, out, target, record, opset, activations, overwrite, no_verify,
                                           tolerance, threads, as_json, quiet, step, dense=dense, held=held)
            doc = export_checked(model, out, opset=opset, activations=activations, overwrite=overwrite,
                                 verify_parity=not no_verify, tolerance=tolerance, threads=threads, source=record,
                                 progress=step, dense_weights=held)
    if as_json:
        click.echo(dumps(doc, indent=2))
        return
    if quiet:
        return
    nodes = ", ".join(f"{v} {k}" for k, v in doc["k3_nodes"].items())
    mib = doc["file_bytes"] / 2**20
    click.echo(f"wrote {out}: opset {doc['opset']}, k3 nodes: {nodes}; {mib:.1f} MiB in {doc['export_s']:.1f} s")
    if "parity" in doc:
        w = worst(doc["parity"])
        click.echo(f"onnxruntime vs eager: max |Δ| {w['max_abs']:.2e} ({w['output']}, {w['phase']})")


def _export_and_compile(model, out, target, record, opset, activations, overwrite, no_verify, tolerance, threads,
                        as_json, quiet, step, dense="auto", held="source"):
    """Export into a temporary folder (removed after, whatever happens), then compile it into OUT."""
    import shutil
    import tempfile
    from pathlib import Path

    from k3compile.compile import compile_export
    from k3compile.pipeline import export_checked

    scratch = Path(tempfile.mkdtemp(prefix="k3compile-export-"))
    try:
        export_checked(model, scratch / "export", opset=opset, activations=activations, verify_parity=not no_verify,
                       tolerance=tolerance, threads=threads, source=record, progress=step,
                       dense_weights=held)
        manifest = compile_export(scratch / "export", out, target=target, overwrite=overwrite, progress=step,
                                  dense=dense)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    if as_json:
        click.echo(dumps(manifest, indent=2))
    elif not quiet:
        click.echo(f"wrote {out}: {manifest['target']} library, {len(manifest['params'])} weights "
                   f"({common.dense_summary(manifest)}), compiled in {manifest['compile_s']:.1f} s")


def _export_sharded(source, out, mesh, target, seed, weights, activations, opset, overwrite, threads, as_json, quiet,
                    dispatch="all-reduce"):
    """--mesh: one library and weight file per rank (k3compile/partition.py)."""
    from k3compile.export import check_options, source_paths
    from k3compile.partition import check_mesh_target, export_sharded
    from k3compile.sharding import Mesh
    from k3compile.source import record
    from k3compile.targets import resolve
    from k3compile.threads import use_threads

    with user_errors():
        mesh = Mesh.parse(mesh)
        check_options(out, opset, activations, overwrite, source_paths(record(source, seed, weights)))
        target = resolve(target)  # once, here (default: llvm); the library takes the Target
        check_mesh_target(target)
        if threads:
            use_threads(threads)
        with status(f"loading {source}", quiet) as step:
            manifest = export_sharded(source, out, mesh, target, seed=seed, experts=weights, activations=activations,
                                      opset=opset, overwrite=overwrite, progress=step,
                                      dispatch=dispatch.replace("-", "_"))
    common.print_sharded(manifest, out, mesh, dispatch, as_json, quiet)
