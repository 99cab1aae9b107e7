"""`k3compile compile`: an export folder compiled by TVM into an artifact folder."""

from __future__ import annotations

import click

from k3compile.cli import common
from k3compile.cli.common import DENSE_HELP, IntRange, dumps, status, user_errors
from k3compile.modes import DENSE_CHOICES
from k3compile.targets import MATMUL_PRECISIONS


@click.command("compile")
@click.argument("folder", type=click.Path(file_okay=False))
@click.option("-o", "--out", "out", required=True, type=click.Path(file_okay=False),
              help="Artifact folder (written through a temporary folder renamed at the end).")
@click.option("--target", default="llvm", show_default=True, help="TVM target (llvm: this CPU).")
@click.option("--dense-weights", "dense", type=click.Choice(DENSE_CHOICES), default="auto", show_default=True,
              help=DENSE_HELP)
@click.option("--overwrite", is_flag=True, help="Replace OUT if it is an earlier k3compile output.")
@click.option("--dump-ir", "dump_ir", type=click.Path(file_okay=False), default=None,
              help="Write the IR before and after each compile phase (TVMScript) into this new or empty folder.")
@click.option("--decode-library/--no-decode-library", "decode_library", default=True, show_default=True,
              help="On a CPU target, also build decode.so: the decode step at batch 1 (one token, `generate`'s and "
                   "a lone client's) with static shapes, which the VM runs with fewer calls (k3-small: ~6% faster; "
                   "about as long to build again as the library).")
@click.option("--host-gemm/--no-host-gemm", "host_gemm", default=True, show_default=True,
              help="On a CPU target, prefill matmuls of 512 rows or more call numpy's BLAS through k3compile's runtime "
                   "(the host GEMM: faster from there). --no-host-gemm keeps every row in the compiled kernels, so a "
                   "plain TVM runtime runs the whole library.")
@click.option("--matmul-precision", "matmul_precision", type=click.Choice(MATMUL_PRECISIONS), default="fp32",
              show_default=True,
              help="On a CPU with AVX512_BF16, bf16: the matmuls over bf16 dense weights (prefill and decode) round "
                   "their activations to bf16 (as llama.cpp's bf16 matmul does) and run a C kernel the library links "
                   "in at twice fp32's multiply rate; the logits then differ from eager's by that rounding. fp32: "
                   "exact.")
@click.option("--tune", "tune", type=IntRange(0, 100_000), default=0, show_default=True, metavar="N",
              help="Tune decode.so's functions with N meta_schedule trials in all (at most 100000); 0: no tuning. "
                   "Minutes: each builder worker starts in ~1 minute.")
@click.option("--mesh", default=None, metavar="[tp=T,]ep=E[,pp=P][,dp=D]",
              help="Shard over this mesh: the ranks' graphs are traced again from the source FOLDER records (its "
                   "export.json), one library and weight file per rank; run OUT with `k3compile run`.")
@click.option("--dispatch", type=click.Choice(["all-reduce", "all-to-all"]), default="all-reduce", show_default=True,
              help="With --mesh: how a stage's ranks join their expert slices (see `k3compile export --help`).")
@click.option("--json", "as_json", is_flag=True, help="Print manifest.json on stdout.")
@click.option("--quiet", is_flag=True, help="No progress output.")
def command(folder, out, target, dense, overwrite, dump_ir, decode_library, host_gemm, matmul_precision, tune, mesh,
            dispatch, as_json, quiet):
    """Compile FOLDER (`k3compile export`'s OUT) with TVM for TARGET into OUT: the library, the weights, the ONNX it
    came from and manifest.json (checked on load). Run it with `k3compile generate OUT --backend tvm`."""
    from k3compile.compile import compile_export
    from k3compile.targets import resolve

    with user_errors():
        target = resolve(target)  # once, here: the library takes the Target
        if not host_gemm:
            target = target.without_host_gemm()
    if mesh is not None:
        if dump_ir or tune or dense != "auto" or matmul_precision != "fp32":
            raise click.UsageError("--dump-ir, --tune, --dense-weights and --matmul-precision do not apply to --mesh "
                                   "(its ranks store bf16 matrices where that is exact, and multiply in fp32)")
        return _compile_sharded(folder, out, target, overwrite, mesh, dispatch, as_json, quiet)
    with user_errors(), status(f"compiling {folder}", quiet) as step:
        manifest = compile_export(folder, out, target=target, overwrite=overwrite, progress=step, dump_ir=dump_ir,
                                  tune=tune, dense=dense, decode_library=decode_library,
                                  matmul_precision=matmul_precision)
    if as_json:
        click.echo(dumps(manifest, indent=2))
    elif not quiet:
        click.echo(f"wrote {out}: {manifest['target']} library, {len(manifest['params'])} weights "
                   f"({common.dense_summary(manifest)}"
                   f"{'; bf16 dense matmuls' if 'matmul_precision' in manifest else ''}), "
                   f"compiled in {manifest['compile_s']:.1f} s")
        for row in manifest.get("tuning", {}).get("functions", []):
            tuned = "-" if row["tuned_us"] is None else f"{row['tuned_us']:.1f} us"
            click.echo(f"  decode {row['function']} (x{row['calls']}): hand {row['hand_us']:.1f} us, tuned {tuned}: "
                       f"{row['chosen']}")


def _compile_sharded(folder, out, target, overwrite, mesh, dispatch, as_json, quiet):
    from k3compile.partition import compile_sharded
    from k3compile.sharding import Mesh

    with user_errors(), status(f"sharding {folder}", quiet) as step:
        mesh = Mesh.parse(mesh)
        manifest = compile_sharded(folder, out, mesh, target, overwrite=overwrite, progress=step,
                                   dispatch=dispatch.replace("-", "_"))
    common.print_sharded(manifest, out, mesh, dispatch, as_json, quiet)
