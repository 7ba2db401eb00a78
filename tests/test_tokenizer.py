"""Tokenizer: encode/decode, byte vocab and chat template against transformers."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import jinja2
import pytest
import tokenizers
import transformers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from pastry.wire.config import CheckpointError
from pastry.wire.tokenizer import Tokenizer, bytes_to_unicode

TEXTS = [
    "Hello, world!",
    "",
    " ",
    "   leading and trailing spaces   ",
    "line one\nline two\r\n\n\ttabbed\tline\n",
    "The year 2024 had 366 days; 3.14159 is pi, and 1,000,000 is a million.",
    "naïve café, Straße, ĳ, façade — “quotes” and ‘apostrophes’… ½ × ² ≤ ∞",
    "日本語のテキストと中文文本，한국어 텍스트, русский текст, ελληνικά, עברית, العربية",
    "emoji 🙂🎉🚀 with ZWJ 👩‍👩‍👧 and flags 🇫🇷 and skin tone 👍🏽",
    "def f(x: int) -> int:\n    return x ** 2 + 0x1F  # comment\n\nclass A:\n\tpass\n",
    "for (let i = 0; i < n; i++) { console.log(`${i}`); }",
    "SELECT * FROM t WHERE a <> 'b' AND c >= 10;",
    "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n",
    "<|endoftext|>text after<|endoftext|>",
    "he said \"don't\" and she'll, they've, I'm, we'd",
    "e\u0301 (combining accent) vs é; Å vs A\u030a",  # NFC matters for qwen
    "\x00\x01 control \x7f bytes \u200b zero width",
    "aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa",
    "     \n\n\n      indented\n" * 3,
]

CONVERSATIONS = [
    [{"role": "user", "content": "Hi"}],
    [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "What is 2+2?"},
        {"role": "assistant", "content": "4"},
        {"role": "user", "content": "Ünïcödé 🙂 and\nnewlines  "},
    ],
]

# A template using what Hub templates use: namespace, tojson, loop controls, generation tags,
# raise_exception, tools and extra keyword arguments.
RICH_TEMPLATE = """\
{%- set ns = namespace(system=none, n=0) %}
{%- for m in messages %}
    {%- if m.role == 'system' %}{% set ns.system = m.content %}{% continue %}{% endif %}
    {%- set ns.n = ns.n + 1 %}
{%- endfor %}
{{- bos_token if bos_token is defined else '' }}
{%- if tools %}
<tools>{{ tools | tojson }}</tools>
{%- for t in tools %}{{ '\\n' + (t | tojson(indent=2)) }}{% endfor %}
{%- endif %}
{%- if ns.system is not none %}[SYS]{{ ns.system }}[/SYS]
{% endif %}
{%- for m in messages if m.role != 'system' %}
    {%- if m.role not in ['user', 'assistant'] %}{{ raise_exception('bad role ' + m.role) }}{% endif %}
    {%- if m.role == 'assistant' %}
{% generation %}<A>{{ m.content }}</A>{% endgeneration %}
    {%- else %}
<U n="{{ loop.index }}/{{ ns.n }}">{{ m.content | trim }}</U>
    {%- endif %}
    {%- if loop.index > 10 %}{% break %}{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}
<A>{% if enable_thinking is defined and not enable_thinking %}<think></think>{% endif %}
{%- endif %}
{{- eos_token }}
"""

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather for a city — in °C",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]


@pytest.fixture(scope="module")
def pair(tiny_ckpt: Path) -> tuple[Tokenizer, transformers.PreTrainedTokenizerBase]:
    """Ours and transformers' (as AutoTokenizer picks it for the model type)."""
    return Tokenizer.from_dir(tiny_ckpt), AutoTokenizer.from_pretrained(tiny_ckpt)


@pytest.mark.parametrize("add_special_tokens", [False, True])
def test_encode_matches_transformers(pair, add_special_tokens: bool) -> None:
    ours, hf = pair
    for text in TEXTS:
        expected = hf.encode(text, add_special_tokens=add_special_tokens)
        assert ours.encode(text, add_special_tokens=add_special_tokens) == expected, text


def test_encode_matches_plain_fast_tokenizer(tiny_ckpt: Path) -> None:
    ours = Tokenizer.from_dir(tiny_ckpt)
    hf = PreTrainedTokenizerFast(tokenizer_file=str(tiny_ckpt / "tokenizer.json"))
    for text in TEXTS:
        assert ours.encode(text) == hf.encode(text, add_special_tokens=False), text


@pytest.mark.parametrize("skip_special_tokens", [False, True])
def test_decode_matches_transformers(pair, skip_special_tokens: bool) -> None:
    ours, hf = pair
    for text in TEXTS:
        ids = hf.encode(text, add_special_tokens=True)
        expected = hf.decode(ids, skip_special_tokens=skip_special_tokens)
        assert ours.decode(ids, skip_special_tokens=skip_special_tokens) == expected, text
    every_id = list(range(ours.vocab_size))
    assert ours.decode(every_id) == hf.decode(every_id)


def test_decode_skips_ids_outside_the_vocab(pair) -> None:
    ours, _ = pair
    ids = ours.encode("padded embedding rows")
    noisy = [ours.vocab_size, *ids[:2], ours.vocab_size + 100, -1, *ids[2:], 31999]
    assert ours.decode(noisy) == ours.decode(ids) == "padded embedding rows"
    assert ours.id_to_token(ours.vocab_size) is None
    assert ours.id_to_token(-1) is None


def test_vocab_size_and_special_tokens(pair, tiny_ckpt: Path) -> None:
    ours, hf = pair
    assert ours.vocab_size == len(hf)
    assert ours.eos_token_ids == (hf.eos_token_id,) == (2,)
    assert ours.pad_token_id == hf.pad_token_id == 0
    assert ours.token_to_id("<|im_start|>") == 1
    assert ours.token_to_id("no such token") is None
    if json.loads((tiny_ckpt / "config.json").read_text())["model_type"] == "llama":
        assert ours.bos_token_id == hf.bos_token_id == 0
        assert ours.special_tokens == {
            "bos_token": "<|endoftext|>",
            "eos_token": "<|im_end|>",
            "pad_token": "<|endoftext|>",
        }
    else:
        assert ours.bos_token_id is None
        assert ours.special_tokens == {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}


def test_bytes_to_unicode_matches_transformers() -> None:
    from transformers.convert_slow_tokenizer import bytes_to_unicode as hf_bytes_to_unicode

    assert bytes_to_unicode() == hf_bytes_to_unicode()
    assert sorted(bytes_to_unicode()) == list(range(256))


def test_get_vocabs_are_the_raw_bytes(pair) -> None:
    ours, _ = pair
    vocabs = ours.get_vocabs()
    assert len(vocabs) == ours.vocab_size
    assert vocabs[:3] == [b"<|endoftext|>", b"<|im_start|>", b"<|im_end|>"]
    assert {bytes([b]) for b in range(256)} <= set(vocabs)  # every byte is one token
    assert all(vocabs[3:]), "only special tokens may be empty"
    for text in TEXTS:
        ids = ours.encode(text, add_special_tokens=True)
        raw = b"".join(vocabs[i] for i in ids)
        assert raw.decode("utf-8", errors="replace") == ours.decode(ids), text
    vocabs[0] = b"mutated"
    assert ours.get_vocabs()[0] == b"<|endoftext|>"


def test_from_json_round_trip(pair) -> None:
    ours, _ = pair
    again = Tokenizer.from_json(ours.to_json(), ours.chat_template, ours.special_tokens)
    assert again.to_json() == ours.to_json()
    assert again.special_tokens == ours.special_tokens
    assert again.vocab_size == ours.vocab_size
    assert again.get_vocabs() == ours.get_vocabs()
    for text in TEXTS:
        assert again.encode(text, add_special_tokens=True) == ours.encode(text, True)
    for messages in CONVERSATIONS:
        assert again.apply_chat_template(messages) == ours.apply_chat_template(messages)


@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_matches_transformers(pair, add_generation_prompt: bool) -> None:
    ours, hf = pair
    for messages in CONVERSATIONS:
        expected = hf.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=add_generation_prompt
        )
        got = ours.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
        assert got == expected
        assert ours.encode(got) == hf.encode(expected, add_special_tokens=False)
    assert ours.apply_chat_template(CONVERSATIONS[0]).endswith("<|im_start|>assistant\n")


def test_chat_template_raise_exception(pair) -> None:
    ours, hf = pair
    messages = [{"role": "wizard", "content": "hi"}]
    with pytest.raises(jinja2.TemplateError, match="Unknown role: wizard"):
        ours.apply_chat_template(messages)
    with pytest.raises(jinja2.TemplateError, match="Unknown role: wizard"):
        hf.apply_chat_template(messages, tokenize=False)


def _copy_tokenizer(src: Path, dst: Path, **config_changes) -> Path:
    dst.mkdir()
    for name in ("tokenizer.json", "config.json"):
        shutil.copy(src / name, dst / name)
    cfg = json.loads((src / "tokenizer_config.json").read_text())
    cfg.update(config_changes)
    cfg = {k: v for k, v in cfg.items() if v is not ...}
    (dst / "tokenizer_config.json").write_text(json.dumps(cfg))
    return dst


def test_rich_chat_template_matches_transformers(make_tiny, tmp_path: Path) -> None:
    d = _copy_tokenizer(make_tiny("llama"), tmp_path / "tok", chat_template=RICH_TEMPLATE)
    ours, hf = Tokenizer.from_dir(d), AutoTokenizer.from_pretrained(d)
    for messages in CONVERSATIONS:
        for kw in ({}, {"tools": TOOLS}, {"enable_thinking": False}, {"tools": TOOLS, "x": 1}):
            for gen in (True, False):
                expected = hf.apply_chat_template(
                    messages, tokenize=False, add_generation_prompt=gen, **kw
                )
                assert ours.apply_chat_template(messages, add_generation_prompt=gen, **kw) == (
                    expected
                )
    assert "get_weather" in ours.apply_chat_template(CONVERSATIONS[1], tools=TOOLS)
    assert "°C" in ours.apply_chat_template(CONVERSATIONS[1], tools=TOOLS)  # not \\u00b0


def test_template_sandbox_blocks_unsafe_access(make_tiny, tmp_path: Path) -> None:
    unsafe = "{{ messages.__class__.__mro__ }}"
    d = _copy_tokenizer(make_tiny("llama"), tmp_path / "tok", chat_template=unsafe)
    with pytest.raises(jinja2.exceptions.SecurityError):
        Tokenizer.from_dir(d).apply_chat_template([{"role": "user", "content": "x"}])
    mutate = "{% set ns = namespace(_x=1) %}"
    d2 = _copy_tokenizer(make_tiny("llama"), tmp_path / "tok2", chat_template=mutate)
    with pytest.raises(jinja2.exceptions.SecurityError):
        Tokenizer.from_dir(d2).apply_chat_template([])


def test_chat_template_from_jinja_file_and_named_list(make_tiny, tmp_path: Path) -> None:
    src = make_tiny("qwen3")
    d = _copy_tokenizer(src, tmp_path / "jinja")
    (d / "chat_template.jinja").write_text("{{ messages[0]['content'] }}!")  # wins, as in HF
    messages = [{"role": "user", "content": "a"}]
    assert Tokenizer.from_dir(d).apply_chat_template(messages) == "a!"
    assert AutoTokenizer.from_pretrained(d).apply_chat_template(messages, tokenize=False) == "a!"
    named = [{"name": "tool_use", "template": "T"}, {"name": "default", "template": "D"}]
    d2 = _copy_tokenizer(src, tmp_path / "named", chat_template=named)
    assert Tokenizer.from_dir(d2).apply_chat_template([]) == "D"


def test_no_chat_template_is_a_clear_error(make_tiny, tmp_path: Path) -> None:
    d = _copy_tokenizer(make_tiny("llama"), tmp_path / "tok", chat_template=...)
    tok = Tokenizer.from_dir(d)
    assert tok.chat_template is None
    with pytest.raises(ValueError, match="no chat template"):
        tok.apply_chat_template([{"role": "user", "content": "hi"}])


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize(("add_bos", "add_eos"), [(False, True), (True, False), (False, False)])
def test_add_bos_eos_flags_set_the_special_tokens(make_tiny, tmp_path, arch, add_bos, add_eos):
    # Explicit flags in tokenizer_config.json decide (as transformers 4 and llama.cpp's
    # converter read them; transformers 5 ignores them when there is a tokenizer.json). The
    # llama tokenizer.json adds <|endoftext|> as BOS itself; qwen2's adds nothing.
    d = _copy_tokenizer(
        make_tiny(arch), tmp_path / "tok", add_bos_token=add_bos, add_eos_token=add_eos,
        bos_token="<|endoftext|>",
    )  # fmt: skip
    tok = Tokenizer.from_dir(d)
    assert tok.add_bos_token is add_bos
    for text in TEXTS[:6]:
        plain = tok.encode(text)
        expected = [0] * add_bos + plain + [2] * add_eos  # <|endoftext|>=0, <|im_end|>=2
        assert tok.encode(text, add_special_tokens=True) == expected
    # without the flags, tokenizer.json's post-processor decides
    d = _copy_tokenizer(make_tiny(arch), tmp_path / "plain")
    hf = AutoTokenizer.from_pretrained(d)
    tok = Tokenizer.from_dir(d)
    assert tok.add_bos_token is (arch == "llama")
    for text in TEXTS[:6]:
        assert tok.encode(text, add_special_tokens=True) == hf.encode(text)


def test_add_bos_token_must_be_a_bool(make_tiny, tmp_path: Path) -> None:
    d = _copy_tokenizer(make_tiny("llama"), tmp_path / "tok", add_bos_token="yes")
    with pytest.raises(CheckpointError, match="add_bos_token' must be true or false"):
        Tokenizer.from_dir(d)


def test_special_tokens_as_added_token_dicts(make_tiny, tmp_path: Path) -> None:
    eos = {"__type": "AddedToken", "content": "<|im_end|>", "special": True}
    d = _copy_tokenizer(make_tiny("llama"), tmp_path / "tok", eos_token=eos, unk_token="<unk>")
    tok = Tokenizer.from_dir(d)
    assert tok.eos_token_ids == (2,)
    assert "unk_token" not in tok.special_tokens  # not a token of this vocabulary: dropped


def test_missing_tokenizer_json(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match=r"tokenizer\.json: file not found"):
        Tokenizer.from_dir(tmp_path)


def test_bad_tokenizer_config(make_tiny, tmp_path: Path) -> None:
    d = _copy_tokenizer(make_tiny("llama"), tmp_path / "tok", eos_token="<|nope|>")
    with pytest.raises(CheckpointError, match=r"tokenizer_config\.json: eos_token '<\|nope\|>'"):
        Tokenizer.from_dir(d)
    (d / "tokenizer_config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match=r"tokenizer_config\.json: not valid JSON"):
        Tokenizer.from_dir(d)
    (d / "tokenizer.json").write_text("{}")
    with pytest.raises(CheckpointError, match=r"tokenizer\.json: cannot be loaded"):
        Tokenizer.from_dir(d)


def test_get_vocabs_of_a_sentencepiece_style_tokenizer() -> None:
    from tokenizers import decoders, models, normalizers

    specials = ["<unk>", "<s>", "</s>"]
    pieces = [f"<0x{b:02X}>" for b in range(256)] + ["▁", "h", "i", "▁h", "▁hi", "é"]
    vocab = {t: i for i, t in enumerate(specials + pieces)}
    bpe = models.BPE(vocab, [("▁", "h"), ("▁h", "i")], unk_token="<unk>", byte_fallback=True)
    raw = tokenizers.Tokenizer(bpe)
    raw.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    raw.decoder = decoders.Sequence(
        [
            decoders.Replace("▁", " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
            decoders.Strip(" ", 1, 0),
        ]
    )
    raw.add_special_tokens(specials)
    tok = Tokenizer(raw, special_tokens={"bos_token": "<s>", "eos_token": "</s>"})
    vocabs = tok.get_vocabs()
    assert vocabs[:3] == [b"<unk>", b"<s>", b"</s>"]
    assert vocabs[3 + 0x41] == b"A" and vocabs[3 + 0xFF] == b"\xff"
    assert vocabs[vocab["▁hi"]] == b" hi" and vocabs[vocab["é"]] == "é".encode()
    ids = tok.encode("hi hi ü")
    assert tok.decode(ids) == "hi hi ü"
    assert b"".join(vocabs[i] for i in ids) == " hi hi ü".encode()  # SentencePiece's prefix space
    assert (tok.bos_token_id, tok.eos_token_ids) == (1, (2,))
