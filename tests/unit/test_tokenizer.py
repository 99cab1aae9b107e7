"""Text in, text out (issue #20, items 1-2): the presets' tokenizers, a checkpoint's tokenizer.json (tokenizers) or
tiktoken.model (tiktoken), both built here with the libraries themselves, the chat template in jinja2's sandbox, and
`generate --prompt / --chat / --messages`."""

from __future__ import annotations

import base64
import json

import pytest
from hardening import one_line_error, run
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers

from k3compile.presets import PRESETS, load_config
from k3compile.source import tokenizer_for
from k3compile.tokenizer import (
    EOS,
    ROLE_MARKERS,
    TokenizerError,
    load_tokenizer,
    preset_tokenizer,
    render_template,
)

TEXTS = ["hello", "Hello, world!\n\tdef f(x):\n        return x ** 2  # 42", "Grüße, 世界 — ½ ≤ ∞ 🙂",
         " lead and trail "]


@pytest.mark.parametrize("preset", list(PRESETS))
def test_every_preset_tokenizer_round_trips(preset):
    cfg = load_config(preset)
    tok = tokenizer_for(preset, cfg)
    for text in TEXTS:
        ids = tok.encode(text)
        assert ids and all(0 <= i < cfg.vocab_size for i in ids)
        assert tok.decode(ids) == text
    assert tok.max_id() < cfg.vocab_size
    assert tok.specials[EOS] == cfg.eos_token_id and tok.eos_ids == (cfg.eos_token_id,)
    assert tok.files == preset_tokenizer(cfg.vocab_size, cfg.bos_token_id, cfg.eos_token_id).files  # deterministic
    chat = tok.encode_chat([{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}])
    assert tok.decode(chat, skip_special=False) == ("<|im_system|>system<|im_middle|>be brief<|im_end|>"
                                                    "<|im_user|>user<|im_middle|>hi<|im_end|>"
                                                    "<|im_assistant|>assistant<|im_middle|>")
    assert chat.count(cfg.eos_token_id) == 2  # the turn ends are the eos token, one id each
    if cfg.vocab_size >= 512:  # room for the role markers as single tokens
        assert all(tok.specials[m] in chat or m == "<|im_system|>" for m in ROLE_MARKERS[1:])


def _hf_tokenizer_json(folder, vocab_size=300):
    tok = HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(["the cat sat on the mat; the dog sat on the log"] * 4, trainers.BpeTrainer(
        vocab_size=vocab_size, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), special_tokens=["<eos>"],
        show_progress=False))
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<eos>", "chat_template":
                                                              "{% for m in messages %}{{ m['content'] }}<eos>"
                                                              "{% endfor %}"}))
    return tok


def test_a_checkpoint_tokenizer_json_is_used(tmp_path):
    lib = _hf_tokenizer_json(tmp_path)
    tok = load_tokenizer(tmp_path, vocab_size=512)
    for text in TEXTS:
        assert tok.encode(text) == lib.encode(text).ids and tok.decode(tok.encode(text)) == text
    assert len(tok.encode("the cat sat")) < len("the cat sat".encode())  # the learned merges apply
    assert tok.eos_ids == (lib.token_to_id("<eos>"),)
    assert tok.encode_chat([{"role": "user", "content": "hi"}]) == tok.encode("hi") + [lib.token_to_id("<eos>")]
    with pytest.raises(TokenizerError, match="past the model's vocabulary"):
        load_tokenizer(tmp_path, vocab_size=100)


def test_a_kimi_tiktoken_model_is_used(tmp_path):
    """K2 / K3 layout: tiktoken.model (ranks learned by tiktoken's own trainer) and the specials in
    tokenizer_config.json."""
    import tiktoken
    from tiktoken._educational import bpe_train

    from k3compile.tokenizer import KIMI_PATTERN

    # trained with a simple word pattern (the educational trainer runs Python's `regex`, which reads Kimi's class
    # intersections otherwise than tiktoken's Rust engine does); the file is loaded with Kimi's pattern
    ranks = bpe_train("the cat sat on the mat. the dog sat on the log. 猫坐. " * 8, 270,
                      r""" ?\p{L}+| ?[^\s\p{L}]+|\s+""", visualise=None)
    # the file format (tiktoken's dump_tiktoken_bpe writes the same lines, through blobfile, not installed here)
    (tmp_path / "tiktoken.model").write_text("".join(f"{base64.b64encode(t).decode()} {r}\n"
                                                     for t, r in sorted(ranks.items(), key=lambda kv: kv[1])))
    n = len(ranks)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({
        "added_tokens_decoder": {str(n): {"content": "[BOS]", "special": True},
                                 str(n + 1): {"content": "<|im_end|>", "special": True}},
        "bos_token": "[BOS]", "eos_token": "<|im_end|>"}))
    tok = load_tokenizer(tmp_path, vocab_size=n + 8)
    ref = tiktoken.Encoding("ref", pat_str=KIMI_PATTERN, mergeable_ranks=ranks,
                            special_tokens={"[BOS]": n, "<|im_end|>": n + 1})
    for text in TEXTS:
        assert tok.encode(text) == ref.encode(text) and tok.decode(tok.encode(text)) == text
    assert tok.encode("the cat<|im_end|>")[-1] == n + 1 and tok.bos_id == n and tok.eos_ids == (n + 1,)
    assert tok.decode([*tok.encode("cat"), n + 1]) == "cat"  # specials left out of the text
    assert len(tok.encode("the cat sat")) < len("the cat sat".encode())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"added_tokens_decoder": {"5": {"content": "x"}}}))
    with pytest.raises(TokenizerError, match="also a token"):
        load_tokenizer(tmp_path)
    (tmp_path / "tokenizer_config.json").write_text("{}")
    (tmp_path / "tiktoken.model").write_text("not base64 at all\n")
    with pytest.raises(TokenizerError, match="not a tiktoken.model line"):
        load_tokenizer(tmp_path)


@pytest.mark.parametrize("template", [
    "{{ messages.__class__.__mro__ }}",
    "{{ ''.__class__.__subclasses__() }}",
    "{% set _ = messages.append(1) %}",
    "{{ raise_exception('no system role') }}",
    "{% for %}",
])
def test_templates_render_in_the_sandbox(template):
    with pytest.raises(TokenizerError, match="chat template"):
        render_template(template, [{"role": "user", "content": "x"}], True)


def test_generate_text_in_text_out(tmp_path):
    r = run("generate", "k3-tiny", "--prompt", "hello", "--prompt", "hi there", "--max-new-tokens", "6", "--json",
            "--quiet")
    assert r.exit_code == 0, r.output
    doc = json.loads(r.output)
    tok = tokenizer_for("k3-tiny", load_config("k3-tiny"))
    assert doc["prompts"] == [tok.encode("hello"), tok.encode("hi there")]
    assert doc["texts"] == [tok.decode(t) for t in doc["tokens"]]
    ids = run("generate", "k3-tiny", "--prompt-ids", ",".join(map(str, tok.encode("hello"))), "--prompt-ids",
              ",".join(map(str, tok.encode("hi there"))), "--max-new-tokens", "6", "--json", "--quiet")
    assert json.loads(ids.output)["tokens"] == doc["tokens"]  # the same greedy tokens as the ids give
    chat = run("generate", "k3-tiny", "--chat", "--prompt", "hello", "--max-new-tokens", "2", "--json", "--quiet")
    assert json.loads(chat.output)["prompts"] == [tok.encode_chat([{"role": "user", "content": "hello"}])]
    (tmp_path / "m.json").write_text(json.dumps([{"role": "user", "content": "hello"}]))
    msgs = run("generate", "k3-tiny", "--messages", tmp_path / "m.json", "--max-new-tokens", "2", "--json", "--quiet")
    assert json.loads(msgs.output)["prompts"] == json.loads(chat.output)["prompts"]


def test_generate_text_refusals(tmp_path):
    one_line_error(run("generate", "k3-tiny", "--prompt", ""), "encodes to no tokens")
    (tmp_path / "bad.json").write_text("[{\"role\": 1}]")
    one_line_error(run("generate", "k3-tiny", "--messages", tmp_path / "bad.json"), "messages[0]")
    (tmp_path / "broken.json").write_text("{")
    one_line_error(run("generate", "k3-tiny", "--messages", tmp_path / "broken.json"), "not a readable JSON")
    assert run("generate", "k3-tiny", "--prompt", "x", "--prompt-ids", "1").exit_code == 2
    assert run("generate", "k3-tiny", "--chat").exit_code == 2


def test_a_saved_checkpoint_ships_the_tokenizer_and_keeps_a_users(tmp_path):
    from k3compile.checkpoint import save_checkpoint
    from k3compile.source import load_model

    model = load_model("k3-tiny")
    save_checkpoint(model, tmp_path / "ckpt")
    cfg = load_config("k3-tiny")
    tok = tokenizer_for(str(tmp_path / "ckpt"), cfg)
    assert tok.files == tokenizer_for("k3-tiny", cfg).files
    (tmp_path / "mine").mkdir()
    _hf_tokenizer_json(tmp_path / "mine")  # a user's tokenizer already in the folder: kept as it is
    before = {p.name: p.read_bytes() for p in (tmp_path / "mine").iterdir()}
    save_checkpoint(model, tmp_path / "mine", overwrite=True)
    assert all((tmp_path / "mine" / n).read_bytes() == b for n, b in before.items())
    save_checkpoint(model, tmp_path / "none", tokenizer=None)
    assert tokenizer_for(str(tmp_path / "none"), cfg) is None
