"""Text in, text out: the tokenizer and chat template a model ships (docs/architecture.md, "Tokenizers").

Two formats, each encoded by its own library:
- K2 / K3 style: `tiktoken.model` (base64 token and rank per line) with `tokenizer_config.json` (the special tokens in
  `added_tokens_decoder`, `bos_token` / `eos_token`, `chat_template`), encoded by `tiktoken` with Kimi's
  pre-tokenization pattern (`KIMI_PATTERN`); the rank file is parsed here (`_read_ranks` says why);
- Hugging Face `tokenizer.json`, through `tokenizers` (with its `tokenizer_config.json` when there is one).
A `chat_template.jinja` beside them takes precedence over the config's template. Templates render in jinja2's
immutable sandbox, as transformers renders them (a template is code from a download).

Presets (and a bare config.json) get a small real tokenizer built here with `tokenizers` (`preset_tokenizer`): the
256 byte tokens of a byte-level BPE, merges learned from a fixed text while the vocabulary has room, the config's
bos / eos ids as the special tokens `[BOS]` and `<|im_end|>`, and K2's role markers as special tokens when the
vocabulary has room (else they are plain text). Built the same way every time, so an export's copy is the same
bytes. A tokenizer whose ids reach past the model's vocabulary is refused.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from k3compile.errors import UserError
from k3compile.interface import (  # the file names (interface.py owns every file name of a folder)
    CHAT_TEMPLATE,
    TIKTOKEN_MODEL,
    TOKENIZER_CONFIG,
    TOKENIZER_FILES,
    TOKENIZER_JSON,
)

# Kimi's pre-tokenization (K2's tokenization_kimi.py): Han runs, words with their leading punctuation and English
# contractions, numbers in groups of up to three, punctuation runs, newlines, other whitespace.
KIMI_PATTERN = "|".join([
    r"""[\p{Han}]+""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+"""
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*"""
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""\p{N}{1,3}""",
    r""" ?[^\s\p{L}\p{N}]+[\r\n]*""",
    r"""\s*[\r\n]+""",
    r"""\s+(?!\S)""",
    r"""\s+""",
])

BOS, EOS = "[BOS]", "<|im_end|>"
ROLE_MARKERS = ("<|im_system|>", "<|im_user|>", "<|im_assistant|>", "<|im_middle|>")
# The presets' template: K2's turn layout (a role marker, the role's name, <|im_middle|>, the content, <|im_end|>).
PRESET_TEMPLATE = (
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'system' -%}<|im_system|>system<|im_middle|>"
    "{%- elif message['role'] == 'assistant' -%}<|im_assistant|>assistant<|im_middle|>"
    "{%- else -%}<|im_user|>{{ message['role'] }}<|im_middle|>{%- endif -%}"
    "{{ message['content'] }}<|im_end|>"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|im_assistant|>assistant<|im_middle|>{%- endif -%}"
)
# The text the presets' merges are learned from (any fixed text would do: it only has to be the same every time).
_CORPUS = (
    "Kimi K3 is an open-weight mixture of experts. It reads text as tokens, and each token is a number in its "
    "vocabulary. The quick brown fox jumps over the lazy dog. Hello, world! How are you today? I am fine, thank "
    "you. The model answers questions, writes code and explains what it does. def main():\n    print('hello')\n"
    "for i in range(10):\n    total += i * 2\nreturn total\n"
    "A compiler turns a program into code a machine runs; k3compile turns the model into kernels for a device. "
    "Numbers: 0 1 2 3 4 5 6 7 8 9 10 100 1000 3.14 2026. Questions and answers, users and assistants, systems.\n"
)
MAX_PRESET_MERGES = 2048
MIN_VOCAB = 64  # below this no byte-level tokenizer is built (a toy config): text commands say it has none


class TokenizerError(UserError):
    pass


@dataclass
class Tokenizer:
    """encode / decode / chat over one of the two libraries. `specials`: special token text -> id; `eos_ids`: the
    ids that end a generation; `files`: the files that make this tokenizer (name -> bytes), written by `save`."""

    kind: str
    impl: object
    specials: dict[str, int]
    bos_id: int | None
    eos_ids: tuple[int, ...]
    chat_template: str | None
    files: dict[str, bytes] = field(repr=False)

    def encode(self, text: str) -> list[int]:
        """Token ids of `text`; special tokens written in it (as a chat template writes them) are parsed."""
        if not isinstance(text, str):
            raise TokenizerError(f"a prompt must be text, got {type(text).__name__}")
        if self.kind == "tiktoken":
            return list(self.impl.encode(text, allowed_special="all"))
        return list(self.impl.encode(text, add_special_tokens=False).ids)

    def decode(self, ids, skip_special: bool = True) -> str:
        ids = [int(i) for i in ids]
        if skip_special:
            special = set(self.specials.values())
            ids = [i for i in ids if i not in special]
        if self.kind == "tiktoken":
            return self.impl.decode(ids)
        return self.impl.decode(ids, skip_special_tokens=False)

    def max_id(self) -> int:
        base = self.impl.max_token_value if self.kind == "tiktoken" else max(self.impl.get_vocab().values())
        return max([base, *self.specials.values()])

    def render_chat(self, messages, add_generation_prompt: bool = True) -> str:
        """`messages` ([{"role": ..., "content": ...}]) rendered by the chat template in jinja2's sandbox."""
        if self.chat_template is None:
            raise TokenizerError("this tokenizer has no chat template (tokenizer_config.json's chat_template or "
                                 f"{CHAT_TEMPLATE})")
        check_messages(messages)
        return render_template(self.chat_template, messages, add_generation_prompt,
                               bos_token=self._text(self.bos_id), eos_token=self._text(self.eos_ids[0])
                               if self.eos_ids else "")

    def encode_chat(self, messages, add_generation_prompt: bool = True) -> list[int]:
        return self.encode(self.render_chat(messages, add_generation_prompt))

    def _text(self, token_id) -> str:
        names = {v: k for k, v in self.specials.items()}
        return names.get(token_id, "") if token_id is not None else ""

    def save(self, folder: str | Path) -> list[str]:
        """Write this tokenizer's files into `folder`; returns their names."""
        folder = Path(folder)
        for name, data in self.files.items():
            (folder / name).write_bytes(data)
        return sorted(self.files)


def check_messages(messages) -> None:
    if not (isinstance(messages, list) and messages):
        raise TokenizerError("messages: expected a non-empty list of {\"role\": ..., \"content\": ...}")
    for i, m in enumerate(messages):
        if not (isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)):
            raise TokenizerError(f"messages[{i}]: expected {{\"role\": text, \"content\": text}}")


def render_template(template: str, messages, add_generation_prompt: bool, **extra) -> str:
    """A chat template rendered in jinja2's immutable sandbox (no attribute of Python objects beyond the safe ones,
    nothing it can change), with the helpers templates expect (`raise_exception`, `tojson`)."""
    from jinja2 import TemplateError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise TemplateError(message)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = raise_exception
    env.filters["tojson"] = lambda v, indent=None: json.dumps(v, ensure_ascii=False, indent=indent)
    try:
        return env.from_string(template).render(messages=messages, add_generation_prompt=add_generation_prompt,
                                                tools=None, **extra)
    except TemplateError as e:
        raise TokenizerError(f"the chat template failed: {e}") from None


def _read_config(folder: Path) -> dict:
    path = folder / TOKENIZER_CONFIG
    if not path.is_file():
        return {}
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise TokenizerError(f"{path}: unreadable ({e})") from None
    if not isinstance(doc, dict):
        raise TokenizerError(f"{path}: expected a JSON object")
    return doc


def _token_text(value) -> str | None:
    """A tokenizer_config.json token entry: a string, or an AddedToken object {"content": ...}."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def load_tokenizer(folder: str | Path, vocab_size: int | None = None, bos_id: int | None = None,
                   eos_id: int | None = None) -> Tokenizer | None:
    """The tokenizer a checkpoint (or export) folder ships, or None when it ships none. `vocab_size`: the model's,
    which no id may reach; `bos_id` / `eos_id`: the config's, used when the tokenizer names none."""
    folder = Path(folder)
    conf = _read_config(folder)
    template = conf.get("chat_template")
    if (folder / CHAT_TEMPLATE).is_file():
        template = (folder / CHAT_TEMPLATE).read_text(encoding="utf-8")
    if template is not None and not isinstance(template, str):
        template = None  # a list of named templates (tool use and the like): not read
    files = {n: (folder / n).read_bytes() for n in TOKENIZER_FILES if (folder / n).is_file()}
    try:
        if (folder / TOKENIZER_JSON).is_file():
            tok = _from_tokenizers(folder / TOKENIZER_JSON)
        elif (folder / TIKTOKEN_MODEL).is_file():
            tok = _from_tiktoken(folder / TIKTOKEN_MODEL, conf)
        else:
            return None
    except TokenizerError:
        raise
    except Exception as e:  # noqa: BLE001 - both libraries raise their own types on a damaged file
        raise TokenizerError(f"{folder}: its tokenizer cannot be read ({type(e).__name__}: {e})") from None
    kind, impl, specials = tok
    bos = specials.get(_token_text(conf.get("bos_token")) or "", bos_id)
    eos = specials.get(_token_text(conf.get("eos_token")) or "", eos_id)
    eos_ids = tuple(dict.fromkeys(i for i in (eos, eos_id) if i is not None))
    result = Tokenizer(kind, impl, specials, bos, eos_ids, template, files)
    _check_vocab(result, vocab_size, folder)
    return result


def _from_tokenizers(path: Path):
    from tokenizers import Tokenizer as HFTokenizer

    impl = HFTokenizer.from_file(str(path))
    specials = {t.content: i for i, t in impl.get_added_tokens_decoder().items() if t.special}
    return "tokenizers", impl, specials


def _from_tiktoken(path: Path, conf: dict):
    import tiktoken

    ranks = _read_ranks(path)
    specials = {}
    added = conf.get("added_tokens_decoder", {})
    if not isinstance(added, dict):
        raise TokenizerError(f"{TOKENIZER_CONFIG}: added_tokens_decoder must be an object")
    for key, entry in added.items():
        text = _token_text(entry)
        if text is None or not str(key).isdigit():
            raise TokenizerError(f"{TOKENIZER_CONFIG}: added_tokens_decoder[{key!r}] is not an id and a token")
        specials[text] = int(key)
    clash = sorted(set(specials.values()) & set(ranks.values()))
    if clash:
        raise TokenizerError(f"{TOKENIZER_CONFIG}: special token id {clash[0]} is also a token of {TIKTOKEN_MODEL}")
    impl = tiktoken.Encoding(name=path.parent.name or "k3", pat_str=KIMI_PATTERN, mergeable_ranks=ranks,
                             special_tokens=specials)
    return "tiktoken", impl, specials


def _read_ranks(path: Path) -> dict[bytes, int]:
    """tiktoken.model: one "base64(token) rank" line per token. Read here, not by tiktoken.load.load_tiktoken_bpe,
    which caches every file it reads by its path in a shared temporary folder: a file replaced in place would be
    read as its old content."""
    import base64
    import binascii

    ranks: dict[bytes, int] = {}
    for n, line in enumerate(path.read_bytes().splitlines(), start=1):
        if not line.strip():
            continue
        parts = line.split()
        try:
            if len(parts) != 2:
                raise ValueError("expected a token and a rank")
            token, rank = base64.b64decode(parts[0], validate=True), int(parts[1])
        except (ValueError, binascii.Error) as e:
            raise TokenizerError(f"{path}:{n}: not a tiktoken.model line ({e})") from None
        if token in ranks or rank < 0:
            raise TokenizerError(f"{path}:{n}: a token listed twice or a negative rank")
        ranks[token] = rank
    if len(set(ranks.values())) != len(ranks):
        raise TokenizerError(f"{path}: two tokens share a rank")
    return ranks


def _check_vocab(tok: Tokenizer, vocab_size: int | None, where) -> None:
    if vocab_size is not None and tok.max_id() >= vocab_size:
        raise TokenizerError(f"{where}: the tokenizer has ids up to {tok.max_id()}, past the model's vocabulary "
                             f"({vocab_size} ids)")


def preset_tokenizer(vocab_size: int, bos_id: int | None, eos_id: int | None) -> Tokenizer:
    """The tokenizer presets (and a bare config.json) get: a byte-level BPE built with `tokenizers` for a model of
    `vocab_size` ids, its specials at the config's ids (module docstring)."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, normalizers, pre_tokenizers, trainers

    if vocab_size < MIN_VOCAB:
        raise TokenizerError(f"vocab_size {vocab_size}: too small for a byte-level tokenizer")
    specials: dict[str, int] = {}
    for text, tid in ((BOS, bos_id), (EOS, eos_id)):
        if tid is not None and 0 <= tid < vocab_size and tid not in specials.values():
            specials[text] = tid
    # Role markers as single tokens at the top of the vocabulary when it has room beside the bytes.
    if vocab_size >= 512:
        top = [i for i in range(vocab_size - 1, -1, -1) if i not in specials.values()][:len(ROLE_MARKERS)]
        specials.update(zip(ROLE_MARKERS, top))
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    byte_chars = _byte_chars()
    taken = set(specials.values())
    free = (i for i in range(vocab_size) if i not in taken)
    vocab: dict[str, int] = {}
    # keep the bytes text uses most when the vocabulary cannot hold all 256: drop control bytes first
    order = sorted(range(256), key=lambda b: (b < 32 and chr(b) not in "\t\n\r" or b == 127, b))
    room = vocab_size - len(taken)
    kept = set(order[:room])
    for b in range(256):
        if b in kept:
            vocab[byte_chars[b]] = next(free)
    dropped = [b for b in range(256) if b not in kept]
    merges: list[tuple[str, str]] = []
    if vocab_size - len(vocab) - len(taken) > 0:
        probe = HFTokenizer(models.BPE())
        probe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        want = 256 + min(MAX_PRESET_MERGES, vocab_size - len(vocab) - len(taken))
        probe.train_from_iterator([_CORPUS], trainers.BpeTrainer(vocab_size=want, initial_alphabet=alphabet,
                                                                 show_progress=False, special_tokens=[]))
        learned = json.loads(probe.to_str())["model"]["merges"]
        for merge in learned:
            a, b = merge if isinstance(merge, list) else merge.split(" ")
            if a not in vocab or b not in vocab:
                continue
            tid = next(free, None)
            if tid is None:
                break
            vocab[a + b] = tid
            merges.append((a, b))
    for text, tid in specials.items():
        vocab[text] = tid
    impl = HFTokenizer(models.BPE(vocab=vocab, merges=merges))
    impl.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    impl.decoder = decoders.ByteLevel()
    if dropped:
        impl.normalizer = normalizers.Sequence([normalizers.Replace(chr(b), "") for b in dropped])
    doc = json.loads(impl.to_str())
    doc["added_tokens"] = [{"id": tid, "content": text, "single_word": False, "lstrip": False, "rstrip": False,
                            "normalized": False, "special": True} for text, tid in sorted(specials.items(),
                                                                                         key=lambda kv: kv[1])]
    impl = HFTokenizer.from_str(json.dumps(doc))
    conf = {"tokenizer_class": "PreTrainedTokenizerFast", "chat_template": PRESET_TEMPLATE,
            **({"bos_token": BOS} if BOS in specials else {}), **({"eos_token": EOS} if EOS in specials else {})}
    files = {TOKENIZER_JSON: impl.to_str().encode(), TOKENIZER_CONFIG: json.dumps(conf, indent=2).encode()}
    tok = Tokenizer("tokenizers", impl, specials, specials.get(BOS), (eos_id,) if EOS in specials else (),
                    PRESET_TEMPLATE, files)
    _check_vocab(tok, vocab_size, "the preset tokenizer")
    return tok


def _byte_chars() -> list[str]:
    """GPT-2's byte-to-unicode map, which tokenizers' ByteLevel uses: printable bytes stand for themselves, the
    others for the code points from 256 on, in byte order."""
    printable = {*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)}
    others = iter(range(256, 512))
    return [chr(b) if b in printable else chr(next(others)) for b in range(256)]
