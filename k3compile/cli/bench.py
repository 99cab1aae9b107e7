"""`k3compile bench`: eager / onnxruntime / TVM side by side (k3compile.bench)."""

from __future__ import annotations

import click

from k3compile.cli.common import dumps, status, user_errors


def _ints(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise click.BadParameter(f"{text!r}: comma-separated positive integers") from None
    if not values or any(v < 1 for v in values):
        raise click.BadParameter(f"{text!r}: comma-separated positive integers")
    return values


@click.command("bench")
@click.argument("source", default="k3-small")
@click.option("--backends", default="eager,onnx,tvm", show_default=True,
              help="Comma-separated: eager, onnx, tvm.")
@click.option("--threads", type=click.IntRange(min=1), default=None,
              help="Threads of every backend (torch, onnxruntime, TVM) [default: every core].")
@click.option("--repeats", type=click.IntRange(min=1), default=5, show_default=True,
              help="Interleaved repetitions; figures are medians.")
@click.option("--decode-batches", default="1,8", show_default=True, help="Batch sizes of the decode runs.")
@click.option("--decode-steps", type=click.IntRange(min=1), default=8, show_default=True)
@click.option("--prefill", default="512,2048", show_default=True, help="Prompt lengths of the prefill runs.")
@click.option("--target", default="llvm", show_default=True)
@click.option("--json", "json_path", type=click.Path(dir_okay=False), default=None,
              help="Write the results as JSON to this file (a new file).")
@click.option("--png", "png_path", type=click.Path(dir_okay=False), default=None,
              help="Write a chart to this PNG file (a new file; needs matplotlib).")
@click.option("--mesh", "meshes", multiple=True, metavar="ep=E[,pp=P]",
              help="Instead: distributed decode over each mesh given (repeat the option; `k3compile run` on this "
                   "machine), decode tokens/s and bytes per token; --decode-batches' first size is the batch.")
@click.option("--dispatch", "dispatches", default="all-reduce", show_default=True,
              help="With --mesh: comma-separated all-reduce, all-to-all; a mesh with ep > 1 runs once per dispatch.")
@click.option("--quiet", is_flag=True, help="No progress output.")
def command(source, backends, threads, repeats, decode_batches, decode_steps, prefill, target, json_path, png_path,
            meshes, dispatches, quiet):
    """Measure SOURCE (default k3-small) on eager torch, onnxruntime and TVM in one run: decode and prefill
    tokens/s (interleaved repetitions, medians, ratios to eager), the MXFP4 expert kernel against torch fp32, the KDA
    kernel as T doubles, the memory roofline, load time and peak memory. Builds into the cache on first use. Run it
    on a quiet machine: a second busy process halves every figure on two cores."""
    from pathlib import Path

    from k3compile.bench import BACKENDS, chart, run_bench
    from k3compile.errors import UserError

    names = tuple(b.strip() for b in backends.split(",") if b.strip())
    unknown = [b for b in names if b not in BACKENDS]
    if unknown or not names:
        raise click.BadParameter(f"{backends!r}: choose from {', '.join(BACKENDS)}", param_hint="--backends")
    batches, lengths = _ints(decode_batches), _ints(prefill)
    with user_errors():
        for path in (json_path, png_path):
            if path is not None and Path(path).exists():
                raise UserError(f"{path}: exists; give a new file")
        from k3compile.compile import check_target

        check_target(target)
        if meshes:
            from k3compile.bench import mesh_table, run_mesh_bench

            with status(f"benchmarking {source} over {len(meshes)} meshes", quiet) as step:
                modes = tuple(d.strip().replace("-", "_") for d in dispatches.split(",") if d.strip())
                if not modes or any(d not in ("all_reduce", "all_to_all") for d in modes):
                    raise click.BadParameter(f"{dispatches!r}: all-reduce, all-to-all", param_hint="--dispatch")
                result = run_mesh_bench(source, meshes, batches[0], decode_steps, repeats, step, modes)
            if json_path is not None:
                Path(json_path).write_text(dumps(result, indent=2) + "\n")
            click.echo(mesh_table(result))
            return
        with status(f"benchmarking {source}", quiet) as step:
            result = run_bench(source, names, threads, repeats, batches, decode_steps, lengths, target, step)
        if json_path is not None:
            Path(json_path).write_text(dumps(result, indent=2) + "\n")
        if png_path is not None:
            chart(result, png_path)
    click.echo(table(result))


def table(result: dict) -> str:
    """The README table: tokens/s per backend and phase, with the ratio to eager."""
    names = sorted({n for sec in ("decode", "prefill") for r in result[sec].values() for n in r["tokens_per_s"]},
                   key=["eager", "onnx", "tvm"].index)
    lines = ["| run | " + " | ".join(names) + " |", "|---|" + "---|" * len(names)]
    for sec, label in (("decode", "decode b{} (tok/s)"), ("prefill", "prefill T={} (tok/s)")):
        for key, r in result[sec].items():
            cells = []
            for n in names:
                med, ratio = r["tokens_per_s"][n]["median"], r["vs_eager"][n]
                cells.append(f"{med:.1f}" + (f" ({ratio:.2f}x)" if ratio is not None and n != "eager" else ""))
            lines.append(f"| {label.format(key)} | " + " | ".join(cells) + " |")
    for row in result.get("moe_kernel", []):
        lines.append(f"| MXFP4 experts, {row['tokens']} token(s) x top-{row['top_k']} (ms) | torch fp32 "
                     f"{row['torch_fp32_ms']:.3f} | | TVM {row['tvm_mxfp4_ms']:.3f} ({row['speedup']:.2f}x) |")
    kda = result.get("kda", [])
    if kda:
        lines.append("| KDA chunked kernel, us/token at T=" + ",".join(str(r["T"]) for r in kda) + " | | | "
                     + ", ".join(f"{r['us_per_token']:.1f}" for r in kda) + " |")
        lines.append("| KDA chunked vs token-by-token kernel at T=" + ",".join(str(r["T"]) for r in kda) + " | | | "
                     + ", ".join(f"{r['chunked_speedup']:.2f}x" for r in kda) + " |")
    roof = result.get("roofline")
    if roof:
        frac = roof["tvm_fraction"]
        lines.append(f"| decode roofline ({roof['bandwidth_gb_s']:.1f} GB/s, "
                     f"{roof['bytes_per_decode_token'] / 2**20:.0f} MiB/token) | | | "
                     f"{roof['ceiling_tokens_per_s']:.1f} tok/s" + (f", TVM at {frac:.0%}" if frac else "") + " |")
    for name, row in result.get("load", {}).items():
        if "load_s" in row:
            lines.append(f"| load {name} | {row['load_s']:.1f} s, peak RSS {row['peak_rss_bytes'] / 2**30:.2f} GiB |"
                         + " |" * (len(names) - 1))
    return "\n".join(lines)
