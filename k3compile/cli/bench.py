"""`k3compile bench`: eager / onnxruntime / TVM side by side (k3compile.bench)."""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from pathlib import Path

import click

from k3compile.bench import BACKENDS, LLAMA, MAX_REPEATS
from k3compile.cli.common import DISPATCH_FLAGS, IntRange, dumps, name_list, status, user_errors
from k3compile.errors import UserError
from k3compile.targets import MATMUL_PRECISIONS

MAX_SIZE = 2**31 - 1  # every size (docs/architecture.md, "Errors")
_POSITIVE = re.compile(r"\s*0*[1-9][0-9]{0,9}\s*")  # ASCII digits only: int() would also take "1_0" and "２"


def _sizes(ctx, param, text: str) -> tuple[int, ...]:
    """A list like 1,8: distinct positive integers at most 2^31 - 1, no empty item."""
    items = text.split(",")
    values = tuple(int(t) for t in items if _POSITIVE.fullmatch(t))
    if len(values) != len(items) or len(set(values)) != len(values) or max(values) > MAX_SIZE:
        raise click.BadParameter(f"{text!r}: expected distinct positive integers such as 1,8 (at most {MAX_SIZE})")
    return values




def _meshes(ctx, param, texts: tuple[str, ...]) -> tuple[str, ...]:
    """Each --mesh parsed (sharding.Mesh.parse), none given twice (ep=2 and ep=2,pp=1 are one mesh)."""
    from k3compile.sharding import Mesh

    seen = {}
    for text in texts:
        try:
            mesh = Mesh.parse(text)
        except UserError as e:
            raise click.UsageError(str(e), ctx) from None  # the message names --mesh
        if mesh in seen:
            raise click.BadParameter(f"{text!r} is the mesh {seen[mesh]!r} again")
        seen[mesh] = text
    return texts


def _check_new_file(path: str | None, option: str) -> None:
    """Before any work: `path` does not exist and a file can be created beside it (probed by creating one)."""
    if path is None:
        return
    p = Path(path)
    if os.path.lexists(p) or path.endswith(os.sep):
        raise UserError(f"{option} {path}: exists or names a folder; give a new file")
    if not p.parent.is_dir():
        raise UserError(f"{option} {path}: there is no folder {p.parent}")
    probe = _temporary(p)
    try:
        probe.open("x").close()
        probe.unlink()
    except OSError as e:
        raise UserError(f"{option} {path}: cannot create a file in {p.parent} ({e.strerror})") from None


def _temporary(path: Path) -> Path:
    return path.with_name(f".{path.name}.{os.getpid()}.tmp")


def _write_new(path: str, write: Callable[[Path], None]) -> None:
    """`write` a temporary file beside `path`, renamed to it once complete: never a half-written file."""
    tmp = _temporary(Path(path))
    try:
        write(tmp)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


@click.command("bench")
@click.argument("source", default="k3-small")
@click.option("--backends", default="eager,onnx,tvm", show_default=True, callback=name_list(BACKENDS),
              help="Comma-separated: eager, onnx, tvm, tvm-mxfp8 (TVM with the dense matrices exported as MXFP8: "
                   "--dense-weights mxfp8), tvm-bf16 (TVM with bf16 dense matmuls: --matmul-precision bf16), "
                   "opencl (the OpenCL executor: SOURCE compiled for opencl), "
                   "opencl-kernels (that artifact kernel by kernel, as verify --kernels runs it: slow), webgpu "
                   "(the WebGPU executor: SOURCE compiled for webgpu).")
@click.option("--threads", type=IntRange(min=1), default=None,
              help="Threads of every backend (torch, onnxruntime, TVM) [default: every core].")
@click.option("--repeats", type=IntRange(1, MAX_REPEATS), default=5, show_default=True,
              help=f"Interleaved repetitions; figures are medians (at most {MAX_REPEATS}).")
@click.option("--decode-batches", default="1,8", show_default=True, callback=_sizes,
              help="Batch sizes of the decode runs (refused when a step would not fit in memory).")
@click.option("--decode-steps", type=IntRange(1, MAX_SIZE), default=8, show_default=True,
              help="Decode steps measured (refused past the model's max_position_embeddings).")
@click.option("--prefill", default="512,2048", show_default=True, callback=_sizes,
              help="Prompt lengths of the prefill runs (refused past the model's max_position_embeddings or this "
                   "machine's memory).")
@click.option("--decode-past", "decode_past", default=None, callback=lambda c, p, v: _sizes(c, p, v) if v else (),
              help="Also decode at batch 1 after prompts of these lengths, e.g. 64,8192 (TVM and llama.cpp only: "
                   "decode cost as the context grows).")
@click.option("--target", default="llvm", show_default=True)
@click.option("--json", "json_path", type=click.Path(dir_okay=False), default=None,
              help="Write the results as JSON to this file (a new file, in a folder that exists).")
@click.option("--png", "png_path", type=click.Path(dir_okay=False), default=None,
              help="Write a chart to this PNG file (a new file; needs matplotlib).")
@click.option("--mesh", "meshes", multiple=True, metavar="[tp=T,]ep=E[,pp=P]", callback=_meshes,
              help="Instead: distributed decode over each mesh given (repeat the option; `k3compile run` on this "
                   "machine), decode tokens/s and bytes per token; --decode-batches' first size is the batch.")
@click.option("--dispatch", "dispatches", default="all-reduce", show_default=True,
              callback=name_list(tuple(DISPATCH_FLAGS)),
              help="With --mesh: comma-separated all-reduce, all-to-all; a mesh with ep > 1 runs once per dispatch.")
@click.option("--micro-batches", "micro_batches", default="1", show_default=True, callback=_sizes,
              help="With --mesh: comma-separated micro-batch counts; a mesh with pp > 1 runs once per count (`run "
                   "--micro-batches`).")
@click.option("--wire-dtype", "wires", default="fp32", show_default=True, callback=name_list(("fp32", "bf16")),
              help="With --mesh: comma-separated fp32, bf16; an all-to-all run goes once per wire dtype (`run "
                   "--wire-dtype`).")
@click.option("--llama-bench", "llama_bench", type=click.Path(dir_okay=False), default=None, metavar="PATH",
              help="Also run llama.cpp: its llama-bench binary (llama-batched-bench beside it runs decode batches "
                   "above 1), interleaved with the backends' repetitions, same threads; needs --gguf.")
@click.option("--gguf", type=click.Path(dir_okay=False), default=None, metavar="FILE",
              help="With --llama-bench: the GGUF of SOURCE (llama.cpp's convert_hf_to_gguf.py of its checkpoint).")
@click.option("--allow-busy", "allow_busy", is_flag=True,
              help="Report even when other processes keep the machine busy (the figures are then marked); by "
                   "default the bench refuses past 0.25 busy cores before or after measuring.")
@click.option("--serve", "serve", is_flag=True,
              help="Instead: `k3compile serve` on SOURCE's llvm artifact (SOURCE an artifact or a sharded OUT: "
                   "itself; with one --mesh: SOURCE's sharded artifact), as clients see it over HTTP: time to first "
                   "token with a cached prefix against an uncached one, concurrent streams against the same requests "
                   "one by one, one client's decode against `generate`.")
@click.option("--serve-prefix", default=2048, show_default=True, type=IntRange(1, MAX_SIZE),
              help="With --serve: the shared prefix's tokens (a whole number of cache blocks, 256).")
@click.option("--serve-suffix", default=32, show_default=True, type=IntRange(1, MAX_SIZE),
              help="With --serve: the new tokens after the prefix.")
@click.option("--serve-clients", default=8, show_default=True, type=IntRange(1, 1024),
              help="With --serve: concurrent streaming clients (and the server's --max-batch).")
@click.option("--serve-tokens", default=64, show_default=True, type=IntRange(2, MAX_SIZE),
              help="With --serve: tokens each client's request generates.")
@click.option("--matmul-precision", "matmul_precision", type=click.Choice(MATMUL_PRECISIONS), default="fp32",
              show_default=True,
              help="With --serve: the llvm artifact built into the cache compiled with this precision (`compile "
                   "--matmul-precision`); elsewhere the backend tvm-bf16 is the bf16 build.")
@click.option("--quiet", is_flag=True, help="No progress output.")
def command(source, backends, threads, repeats, decode_batches, decode_steps, prefill, decode_past, target, json_path,
            png_path, meshes, dispatches, micro_batches, wires, llama_bench, gguf, allow_busy, serve, serve_prefix,
            serve_suffix, serve_clients, serve_tokens, matmul_precision, quiet):
    """Measure SOURCE (default k3-small) on eager torch, onnxruntime and TVM (and the OpenCL / WebGPU executors, when
    named)
    in one run: decode and prefill tokens/s (interleaved repetitions, medians, ratios to eager), the MXFP4 expert
    kernel against torch fp32, the KDA kernel as T doubles, the memory roofline, load time and peak memory, the
    OpenCL kernels' share of a decode step. Builds into the cache on first use. Run it
    on a quiet machine: a second busy process halves every figure on two cores."""
    import importlib.util

    from k3compile.bench import chart, run_bench

    if (llama_bench is None) != (gguf is None):
        raise click.UsageError("--llama-bench and --gguf go together")
    if meshes and llama_bench:
        raise click.UsageError("--llama-bench does not apply to --mesh")
    if matmul_precision != "fp32" and (not serve or meshes):
        raise click.UsageError("--matmul-precision applies to --serve on a single artifact (without --serve, the "
                               "backend tvm-bf16 is the bf16 build)")
    with user_errors():
        _check_new_file(json_path, "--json")
        _check_new_file(png_path, "--png")
        if json_path is not None and png_path is not None and Path(json_path).resolve() == Path(png_path).resolve():
            raise UserError(f"--json and --png name the same file ({json_path})")
        if png_path is not None and importlib.util.find_spec("matplotlib") is None:
            raise UserError("--png needs matplotlib (pip install 'k3compile[bench]')")
        from k3compile.targets import resolve

        target = resolve(target)  # once, here: the library takes the Target
        if serve:
            from k3compile.serving.bench import run_serve_bench, serve_table

            if len(meshes) > 1 or len(dispatches) > 1 or llama_bench or png_path:
                raise click.UsageError("--serve runs alone: one --mesh and one --dispatch at most, not with "
                                       "--llama-bench or --png")
            with status(f"benchmarking serve on {source}", quiet) as step:
                result = run_serve_bench(source, threads, repeats, serve_prefix, serve_suffix, serve_clients,
                                         serve_tokens, progress=step, allow_busy=allow_busy,
                                         mesh=meshes[0] if meshes else None,
                                         dispatch=DISPATCH_FLAGS[dispatches[0]], matmul_precision=matmul_precision)
            if json_path is not None:
                _write_new(json_path, lambda tmp: tmp.write_text(dumps(result, indent=2) + "\n"))
            click.echo(serve_table(result))
            return
        if meshes:
            from k3compile.bench import mesh_table, run_mesh_bench

            with status(f"benchmarking {source} over {len(meshes)} meshes", quiet) as step:
                result = run_mesh_bench(source, meshes, decode_batches[0], decode_steps, repeats, step,
                                        tuple(DISPATCH_FLAGS[d] for d in dispatches), micro_batches, wires)
            if json_path is not None:
                _write_new(json_path, lambda tmp: tmp.write_text(dumps(result, indent=2) + "\n"))
            click.echo(mesh_table(result))
            return
        with status(f"benchmarking {source}", quiet) as step:
            result = run_bench(source, backends, threads, repeats, decode_batches, decode_steps, prefill, target,
                               step, llama=(llama_bench, gguf) if llama_bench else None, allow_busy=allow_busy,
                               decode_past=decode_past)
        if json_path is not None:
            _write_new(json_path, lambda tmp: tmp.write_text(dumps(result, indent=2) + "\n"))
        if png_path is not None:
            _write_new(png_path, lambda tmp: chart(result, tmp))
    click.echo(table(result))


def table(result: dict) -> str:
    """The README table: tokens/s per backend and phase, with the ratio to eager (and to llama.cpp, when it ran)."""
    order = (*BACKENDS, LLAMA)
    names = sorted({n for sec in ("decode", "prefill") for r in result[sec].values() for n in r["tokens_per_s"]},
                   key=order.index)
    lines = ["| run | " + " | ".join(names) + " |", "|---|" + "---|" * len(names)]
    for sec, label in (("decode", "decode b{} (tok/s)"), ("prefill", "prefill T={} (tok/s)")):
        for key, r in result[sec].items():
            cells = []
            for n in names:
                if n not in r["tokens_per_s"]:
                    cells.append("–")
                    continue
                med, ratio = r["tokens_per_s"][n]["median"], r["vs_eager"].get(n)
                peer = r.get("vs_llama_cpp", {}).get(n)
                notes = []
                if ratio is not None and n not in ("eager", LLAMA):
                    notes.append(f"{ratio:.2f}x")
                if peer is not None and n != LLAMA:
                    notes.append(f"{peer:.2f}x llama.cpp")
                cells.append(f"{med:.1f}" + (f" ({', '.join(notes)})" if notes else ""))
            lines.append(f"| {label.format(key)} | " + " | ".join(cells) + " |")
    for past, r in result.get("decode_past", {}).items():
        cells = []
        for n in names:
            if n not in r["tokens_per_s"]:
                cells.append("")
                continue
            peer = r.get("vs_llama_cpp", {}).get(n)
            cells.append(f"{r['tokens_per_s'][n]['median']:.1f}"
                         + (f" ({peer:.2f}x llama.cpp)" if peer is not None and n != LLAMA else ""))
        lines.append(f"| decode b1 after {past} tokens (tok/s) | " + " | ".join(cells) + " |")
    for row in result.get("moe_kernel", []):
        lines.append(f"| MXFP4 experts, {row['tokens']} token(s) x top-{row['top_k']} (ms) | torch fp32 "
                     f"{row['torch_fp32_ms']:.3f} | | TVM {row['tvm_mxfp4_ms']:.3f} ({row['speedup']:.2f}x, "
                     f"{row.get('tvm_gb_s', 0):.1f} GB/s) |")
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
        if roof.get("tvm_mxfp8_fraction"):
            lines.append(f"| decode roofline, MXFP8 dense ({roof['mxfp8_bytes_per_decode_token'] / 2**20:.0f} "
                         f"MiB/token) | | | {roof['mxfp8_ceiling_tokens_per_s']:.1f} tok/s, TVM at "
                         f"{roof['tvm_mxfp8_fraction']:.0%} |")
    prof = result.get("opencl_profile")
    if prof:
        lines.append(f"| OpenCL decode b1, kernels' device time / step ({prof['device']}) | "
                     f"{prof['kernel_ms']:.2f} of {prof['step_ms']:.2f} ms ({prof['kernel_share']:.0%}), "
                     f"{prof['launches_per_step']} launches |" + " |" * (len(names) - 1))
    for name, row in result.get("load", {}).items():
        if "load_s" in row:
            lines.append(f"| load {name} | {row['load_s']:.1f} s, peak RSS {row['peak_rss_bytes'] / 2**30:.2f} GiB |"
                         + " |" * (len(names) - 1))
    return "\n".join(lines)
