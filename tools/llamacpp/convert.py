#!/usr/bin/env python3
"""A k3compile checkpoint folder (`save_checkpoint`) to a GGUF with llama.cpp's own, unmodified
convert_hf_to_gguf.py, for `k3compile bench --llama-bench` (README, "Benchmark").

The converter reads k3compile's K3 layout as it is (the MXFP4 experts are repacked losslessly); only its vocabulary
step is replaced (written before save_checkpoint wrote the presets' tokenizer; the benchmark reads no text):
Kimi-Linear's `set_vocab` (K3 borrows it) becomes a byte-level "gpt2" vocabulary of `vocab_size` tokens (bytes
0..255 in GPT-2's byte-to-unicode mapping, then unused [PADi] tokens). No tensor and no other metadata is touched.

Run it with the converter venv of tools/llamacpp/build.sh: `LLAMA_SRC=<llama.cpp source> venv/bin/python
tools/llamacpp/convert.py CKPT --outtype bf16 --outfile k3-small.gguf`.
"""

import os
import runpy
import sys
from pathlib import Path

LLAMA = Path(os.environ.get("LLAMA_SRC", Path.home() / ".cache/k3-llamacpp/llama_cpp_python-0.3.36/vendor/llama.cpp"))


def byte_vocab(self) -> None:
    """The converter's set_vocab, replaced: a byte-level vocabulary of the config's size."""
    import gguf

    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    others = [b for b in range(256) if b not in printable]
    char = {b: chr(b) for b in printable} | {b: chr(256 + n) for n, b in enumerate(others)}
    n = self.hparams["vocab_size"]
    self.gguf_writer.add_tokenizer_model("gpt2")
    self.gguf_writer.add_tokenizer_pre("kimi-k2")  # what kimi-linear writes for the real vocabulary
    self.gguf_writer.add_token_list([char[i] if i < 256 else f"[PAD{i}]" for i in range(n)])
    self.gguf_writer.add_token_types([gguf.TokenType.NORMAL if i < 256 else gguf.TokenType.UNUSED for i in range(n)])
    self.gguf_writer.add_token_merges([])
    for key, add in (("bos_token_id", self.gguf_writer.add_bos_token_id),
                     ("eos_token_id", self.gguf_writer.add_eos_token_id),
                     ("pad_token_id", self.gguf_writer.add_pad_token_id)):
        if self.hparams.get(key) is not None:
            add(self.hparams[key])
    self.gguf_writer.add_add_bos_token(False)


def main() -> None:
    if not (LLAMA / "convert_hf_to_gguf.py").is_file():
        sys.exit(f"Error: no convert_hf_to_gguf.py in {LLAMA} (set LLAMA_SRC; tools/llamacpp/build.sh fetches it)")
    sys.path[:0] = [str(LLAMA), str(LLAMA / "gguf-py")]
    from conversion import kimi_linear

    kimi_linear.KimiLinearModel.set_vocab = byte_vocab  # KimiK3Model.set_vocab calls this one too
    sys.argv[0] = str(LLAMA / "convert_hf_to_gguf.py")
    runpy.run_path(sys.argv[0], run_name="__main__")


if __name__ == "__main__":
    main()
