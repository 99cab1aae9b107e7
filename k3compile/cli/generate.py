"""`k3compile generate`: tokens from an eager model or an export folder."""

from __future__ import annotations

from contextlib import nullcontext

import click

from k3compile.backends.choose import KINDS, open_backend
from k3compile.cli.common import (
    SEED,
    THREADS_HELP,
    WIRE_OPTION,
    FiniteFloat,
    IntRange,
    dumps,
    parse_ids,
    progress,
    status,
    user_errors,
)
from k3compile.config import EXPERT_CHOICES
from k3compile.presets import DEFAULT_PRESET


@click.command("generate")
@click.argument("source", default=DEFAULT_PRESET)
@click.option("--prompt-ids", "prompt_ids", multiple=True, default=("1,2,3",), show_default=True,
              help="Comma-separated token ids; repeat the option for a left-padded batch.")
@click.option("--prompt", "texts", multiple=True,
              help="A text prompt, encoded by SOURCE's tokenizer (repeat for a batch); the output is decoded too.")
@click.option("--chat", is_flag=True, help="Each --prompt is a user message, rendered by the chat template.")
@click.option("--messages", "messages_file", type=click.Path(dir_okay=False), default=None,
              help="A JSON file holding a conversation ([{\"role\": ..., \"content\": ...}]), rendered by the chat "
                   "template into one prompt.")
@click.option("--max-new-tokens", default=16, show_default=True, type=IntRange(min=0))
@click.option("--backend", type=click.Choice(KINDS), default="auto", show_default=True,
              help="auto: an artifact on its own target (llvm in TVM's VM, opencl on its OpenCL device), an export "
                   "folder in onnxruntime, a preset, config or checkpoint eager; eager: the PyTorch model; onnx: "
                   "onnxruntime; onnx-reference: onnx.reference (slow, small inputs); tvm: a compiled artifact (or an "
                   "export folder, compiled on each run). With a preset, config or checkpoint as SOURCE, onnx and "
                   "tvm build it into the cache (~/.cache/k3compile, or $K3COMPILE_CACHE) once and reuse it.")
@click.option("--device", type=IntRange(min=0), default=None,
              help="A GPU artifact's device: its index among the driver's devices (default: "
                   "$K3COMPILE_OPENCL_DEVICE, else 0).")
@click.option("--temperature", default=0.0, show_default=True, type=FiniteFloat(min=0.0),
              help="0 is greedy.")
@click.option("--top-p", default=1.0, show_default=True, type=FiniteFloat(min=0.0, max=1.0, min_open=True))
@click.option("--seed", default=0, show_default=True, type=SEED, help="Seed of the sampling.")
@click.option("--weight-seed", default=0, show_default=True, type=SEED,
              help="Seed of the random weights when SOURCE is a preset or a config.json.")
@click.option("--experts", type=click.Choice(EXPERT_CHOICES), default="auto", show_default=True,
              help="Routed-expert weights of SOURCE: as stored, dequantized to float, or quantized to MXFP4.")
@click.option("--prefill-chunk", default=None, type=IntRange(min=1),
              help="Tokens per prefill step, each fed the state the one before left (default: sized to the prompts "
                   "and this machine's free memory, at most 4096): a prompt of any length in the memory of a chunk.")
@click.option("--cache-block", default=None, type=IntRange(min=1),
              help="Prefill each prompt as its own row through a prefix-state cache that keeps the state every this "
                   "many tokens: prompts of the batch that share a prefix run it once.")
@click.option("--threads", type=IntRange(min=1), default=None, help=THREADS_HELP)
@WIRE_OPTION
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON.")
@click.option("--quiet", is_flag=True, help="No progress output.")
@click.pass_context
def command(ctx, source, prompt_ids, texts, chat, messages_file, max_new_tokens, backend, device, temperature, top_p,
            seed, weight_seed, experts, prefill_chunk, cache_block, threads, wire, as_json, quiet):
    """Generate tokens from SOURCE (default: the k3-tiny preset with seeded random weights): from token ids, or from
    text (--prompt, --chat, --messages) through SOURCE's tokenizer."""
    from k3compile.manifest import is_sharded
    from k3compile.source import ARTIFACT, EXPORT, kind_of
    from k3compile.threads import default_threads, use_threads

    text_mode = bool(texts) or messages_file is not None
    if text_mode and ctx.get_parameter_source("prompt_ids") != click.core.ParameterSource.DEFAULT:
        raise click.UsageError("give --prompt-ids or --prompt / --messages, not both")
    if chat and not texts:
        raise click.UsageError("--chat renders the --prompt texts as user messages: give --prompt")
    if messages_file is not None and texts:
        raise click.UsageError("--messages is the whole conversation: not with --prompt")
    tokenizer = None
    if text_mode:
        with user_errors():
            tokenizer, prompts = _encode_prompts(source, texts, chat, messages_file)
    else:
        prompts = [parse_ids(p) for p in prompt_ids]
    built = kind_of(source) in (EXPORT, ARTIFACT) or is_sharded(source)
    if backend != "eager" and built:
        for name in ("experts", "weight_seed"):
            if ctx.get_parameter_source(name) != click.core.ParameterSource.DEFAULT:
                raise click.UsageError(f"--{name.replace('_', '-')} does not apply to an export folder or artifact: "
                                       "it runs the weights it was built with")
    with user_errors():
        from k3compile.lean import LeanArtifact, eligible
        from k3compile.presets import load_config

        lean = eligible(source, backend, cache_block, device, wire)  # no torch in this process
        # before TVM's pool or a compile starts
        use_threads(threads or default_threads(load_config(source)), with_torch=not lean)
    if lean:
        with user_errors():
            with status(f"loading {source}", quiet):
                engine = LeanArtifact(source)
            bar, cb = progress("generating", quiet)
            with bar or nullcontext():
                result = engine.generate(prompts, max_new_tokens, temperature, top_p, seed,
                                         eos_token_id=engine.config.eos_token_id,
                                         prefill_chunk=prefill_chunk, progress=cb)
        cache = None
    else:
        engine, result, cache = _generate(source, prompts, max_new_tokens, backend, device, temperature, top_p, seed,
                                          weight_seed, experts, prefill_chunk, cache_block, threads, wire, quiet)
    doc = {
        "source": source, "backend": engine.name, "prompts": prompts, "tokens": result.tokens,
        **({"texts": [tokenizer.decode(t) for t in result.tokens]} if tokenizer is not None else {}),
        **({"device": engine.describe()} if hasattr(engine, "describe") else {}),
        **({"runtime": "torch-free"} if lean else {}),  # k3compile/lean.py
        "prefill_s": round(result.prefill_s, 6), "decode_s": round(result.decode_s, 6),
        "decode_tokens_per_s": round(result.decode_tokens_per_s, 3) if result.decode_steps else None,
        **({"prefix_cache": {"hits": cache.stats.hits, "hit_tokens": cache.stats.hit_tokens}} if cache else {}),
    }
    if as_json:
        click.echo(dumps(doc))
        return
    for i, (p, toks) in enumerate(zip(prompts, result.tokens)):
        if tokenizer is not None:
            click.echo(f"{doc['texts'][i]}")
            click.echo(f"  [{len(p)} prompt tokens -> {','.join(map(str, toks))}]", err=True)
        else:
            click.echo(f"{','.join(map(str, p))} -> {','.join(map(str, toks))}")
    if not quiet:
        rate = f", decode {doc['decode_tokens_per_s']} tok/s" if result.decode_steps else ""
        where = f" on {doc['device']}" if "device" in doc else ""
        click.echo(f"[{engine.name}{where}] prefill {result.prefill_s * 1e3:.1f} ms{rate}", err=True)


def _generate(source, prompts, max_new_tokens, backend, device, temperature, top_p, seed, weight_seed, experts,
              prefill_chunk, cache_block, threads, wire, quiet):
    """The torch path: SOURCE on the backend open_backend picks, through generate.generate. -> (engine, result,
    prefix cache or None)."""
    from k3compile.generate import generate as run
    from k3compile.lean import runtime_library_for

    with user_errors():
        with status(f"loading {source}", quiet) as step:
            runtime_library_for(source, backend)  # this process never compiles
            engine = open_backend(source, backend, seed=weight_seed, experts=experts, threads=threads, device=device,
                                  progress=step, wire=wire)
        try:
            cache = None
            if cache_block is not None:
                from k3compile.prefix_cache import PrefixCache

                cache = PrefixCache(engine.config, cache_block)
            bar, cb = progress("generating", quiet)
            with bar or nullcontext():
                result = run(engine, prompts, max_new_tokens, temperature=temperature, top_p=top_p,
                             seed=seed, eos_token_id=engine.config.eos_token_id, progress=cb,
                             prefill_chunk=prefill_chunk, cache=cache)
        finally:
            if hasattr(engine, "close"):  # a sharded OUT's ranks (backends/sharded.py)
                engine.close()
    return engine, result, cache


def _encode_prompts(source, texts, chat: bool, messages_file):
    """(tokenizer, prompts as ids) for the text options: SOURCE's tokenizer (k3compile/tokenizer.py)."""
    import json
    from pathlib import Path

    from k3compile.presets import load_config
    from k3compile.source import tokenizer_for
    from k3compile.tokenizer import TokenizerError

    tok = tokenizer_for(source, load_config(source))
    if tok is None:
        raise TokenizerError(f"{source} ships no tokenizer (tokenizer.json, or tiktoken.model with "
                             "tokenizer_config.json): give --prompt-ids")
    if messages_file is not None:
        try:
            messages = json.loads(Path(messages_file).read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise TokenizerError(f"{messages_file}: not a readable JSON file ({e})") from None
        prompts = [tok.encode_chat(messages)]
    elif chat:
        prompts = [tok.encode_chat([{"role": "user", "content": t}]) for t in texts]
    else:
        prompts = [tok.encode(t) for t in texts]
    if any(not p for p in prompts):
        raise TokenizerError("a prompt encodes to no tokens")
    return tok, prompts
