"""A Hugging Face tokenizer (``tokenizer.json`` + ``tokenizer_config.json``) and chat template.

:class:`Tokenizer` wraps ``tokenizers.Tokenizer`` with what the serving layers need: encode and
decode that agree with transformers' fast tokenizer, the byte string of every token (for
constrained decoding and incremental detokenization), the named special tokens, and the
checkpoint's jinja chat template rendered the way transformers renders it. It can be rebuilt
from strings (:meth:`Tokenizer.from_json`) so another process needs no checkpoint directory.
"""

from __future__ import annotations

import json
import re
from datetime import datetime
from functools import cached_property, lru_cache
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.parser
import jinja2.utils
import tokenizers
import tokenizers.processors
from jinja2.sandbox import ImmutableSandboxedEnvironment

from pastry.wire.config import CheckpointError

# The named special tokens transformers reads from tokenizer_config.json, in its order.
SPECIAL_TOKEN_NAMES = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
)


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible map from the 256 byte values to printable unicode characters."""
    bs = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1)]
    bs += range(ord("®"), ord("ÿ") + 1)
    cs = list(bs)
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs, strict=True)}


_UNICODE_TO_BYTE = {c: b for b, c in bytes_to_unicode().items()}
_BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")


class Tokenizer:
    """A checkpoint's tokenizer: ``tokenizer.json`` plus its named special tokens and chat template.

    ``special_tokens`` maps names from ``tokenizer_config.json`` (``bos_token``, ``eos_token``,
    ``pad_token``, ...) to token strings; only tokens that are set appear.
    """

    def __init__(
        self,
        tokenizer: tokenizers.Tokenizer,
        chat_template: str | None = None,
        special_tokens: dict[str, str] | None = None,
    ) -> None:
        self._tok = tokenizer
        self.chat_template = chat_template
        self.special_tokens = dict(special_tokens or {})
        vocab = tokenizer.get_vocab(with_added_tokens=True)
        self.vocab_size: int = max(vocab.values()) + 1 if vocab else 0
        """One past the largest token id (ids below it with no token are skipped by decode)."""

    # -- construction ------------------------------------------------------------------------

    @classmethod
    def from_dir(cls, path: str | Path) -> Tokenizer:
        """Load ``tokenizer.json`` (required) and ``tokenizer_config.json`` (optional) from a
        checkpoint directory; a ``chat_template.jinja`` there overrides the config's template."""
        path = Path(path)
        tok_file = path / "tokenizer.json"
        if not tok_file.is_file():
            raise CheckpointError(
                f"{tok_file}: file not found (only fast tokenizers, saved as tokenizer.json, "
                "are supported)"
            )
        try:
            tok = tokenizers.Tokenizer.from_file(str(tok_file))
        except Exception as e:  # tokenizers raises a bare Exception on malformed files
            raise CheckpointError(f"{tok_file}: cannot be loaded ({e})") from e
        cfg_file = path / "tokenizer_config.json"
        cfg = _read_json(cfg_file) if cfg_file.is_file() else {}
        special = {}
        for name in SPECIAL_TOKEN_NAMES:
            value = cfg.get(name)
            if isinstance(value, dict):  # a serialized AddedToken
                value = value.get("content")
            if value is None:
                continue
            if not isinstance(value, str):
                raise CheckpointError(f"{cfg_file}: field '{name}' must be a string or null")
            if tok.token_to_id(value) is not None:
                special[name] = value
            elif name in ("bos_token", "eos_token"):
                raise CheckpointError(
                    f"{cfg_file}: {name} '{value}' is not a token of {tok_file.name}"
                )
        flags = {k: cfg[k] for k in ("add_bos_token", "add_eos_token") if k in cfg}
        for name, value in flags.items():
            if not isinstance(value, bool):
                raise CheckpointError(f"{cfg_file}: field '{name}' must be true or false")
        if flags:  # explicit flags rewrite the post-processor, as transformers' Llama does
            set_special_post_processor(
                tok,
                special.get("bos_token") if flags.get("add_bos_token") else None,
                special.get("eos_token") if flags.get("add_eos_token") else None,
            )
        template = _chat_template(path, cfg)
        return cls(tok, template, special)

    @classmethod
    def from_json(
        cls,
        tokenizer_json: str,
        chat_template: str | None = None,
        special_tokens: dict[str, str] | None = None,
    ) -> Tokenizer:
        """Rebuild from :meth:`to_json`, :attr:`chat_template` and :attr:`special_tokens`."""
        return cls(tokenizers.Tokenizer.from_str(tokenizer_json), chat_template, special_tokens)

    def to_json(self) -> str:
        """The ``tokenizer.json`` text."""
        return self._tok.to_str()

    # -- tokens ------------------------------------------------------------------------------

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Token ids of ``text``; special-token strings in it become their ids.

        ``add_special_tokens`` applies the post-processor (e.g. a leading BOS): what a prompt
        that starts a sequence needs (:attr:`add_bos_token`). The post-processor is
        tokenizer.json's, rewritten when tokenizer_config.json sets ``add_bos_token`` or
        ``add_eos_token`` explicitly (transformers 4's Llama tokenizers did that;
        transformers 5 ignores the flags when there is a tokenizer.json)."""
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def encode_batch(self, texts: list[str], add_special_tokens: bool = False) -> list[list[int]]:
        """:meth:`encode` of each text. The encoding runs without Python's global lock, so a
        worker thread calling this does not stall the event loop (``encode`` does)."""
        batch = self._tok.encode_batch(list(texts), add_special_tokens=add_special_tokens)
        return [e.ids for e in batch]

    def decode(self, ids: Any, skip_special_tokens: bool = False) -> str:
        """Text of ``ids``; ids that name no token (e.g. embedding padding) are skipped."""
        n = self.vocab_size
        ids = [i for i in (int(i) for i in ids) if 0 <= i < n]
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        """The id of a token string (in the tokenizer's own spelling), or None."""
        return self._tok.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        """The token string (in the tokenizer's own spelling) of an id, or None."""
        return self._tok.id_to_token(token_id) if 0 <= token_id < self.vocab_size else None

    def get_vocabs(self) -> list[bytes]:
        """The raw bytes of every id below :attr:`vocab_size` (``b""`` where no token).

        Byte-level BPE tokens are mapped back through GPT-2's byte table, SentencePiece tokens
        get ``▁`` as a space and ``<0xNN>`` as that byte, added tokens are their utf-8."""
        return list(self._vocab_bytes)

    @cached_property
    def _vocab_bytes(self) -> tuple[bytes, ...]:
        out = [b""] * self.vocab_size
        added = {t.content for t in self._tok.get_added_tokens_decoder().values()}
        byte_level = "ByteLevel" in json.dumps(json.loads(self.to_json()).get("decoder"))
        for token, i in self._tok.get_vocab(with_added_tokens=True).items():
            if token in added:
                out[i] = token.encode()
            elif byte_level:
                try:
                    out[i] = bytes(_UNICODE_TO_BYTE[c] for c in token)
                except KeyError:  # not a byte-level spelling
                    out[i] = token.encode()
            elif m := _BYTE_FALLBACK.fullmatch(token):
                out[i] = bytes([int(m.group(1), 16)])
            else:
                out[i] = token.replace("▁", " ").encode()
        return tuple(out)

    # -- special tokens ----------------------------------------------------------------------

    @property
    def bos_token_id(self) -> int | None:
        """Id of ``bos_token``, or None when the tokenizer has none."""
        return self._special_id("bos_token")

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        """Id of ``eos_token`` as a 1-tuple, or ``()`` (the checkpoint may add more)."""
        i = self._special_id("eos_token")
        return () if i is None else (i,)

    @cached_property
    def add_bos_token(self) -> bool:
        """Whether a sequence starts with BOS: ``encode(text, add_special_tokens=True)``
        prepends :attr:`bos_token_id`."""
        bos = self.bos_token_id
        if bos is None:
            return False
        with_special = self._tok.encode("a", add_special_tokens=True).ids
        plain = self._tok.encode("a", add_special_tokens=False).ids
        return with_special[:1] == [bos] and plain[:1] != [bos]

    @property
    def pad_token_id(self) -> int | None:
        """Id of ``pad_token``, or None."""
        return self._special_id("pad_token")

    def _special_id(self, name: str) -> int | None:
        token = self.special_tokens.get(name)
        return None if token is None else self._tok.token_to_id(token)

    # -- chat --------------------------------------------------------------------------------

    def apply_chat_template(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, **kwargs: Any
    ) -> str:
        """Render ``messages`` with the checkpoint's chat template, as transformers does.

        The template sees ``messages``, ``add_generation_prompt``, ``tools`` and ``documents``
        (None unless given), the special tokens by name (``bos_token``, ...) and ``kwargs``."""
        if self.chat_template is None:
            raise ValueError(
                "this tokenizer has no chat template (tokenizer_config.json has no "
                "'chat_template' and there is no chat_template.jinja); format the prompt "
                "yourself or use a chat/instruct checkpoint"
            )
        tools = kwargs.pop("tools", None)
        documents = kwargs.pop("documents", None)
        return _compile(self.chat_template).render(
            messages=messages,
            tools=tools,
            documents=documents,
            add_generation_prompt=add_generation_prompt,
            **{**self.special_tokens, **kwargs},
        )

    def __repr__(self) -> str:
        return f"Tokenizer(vocab_size={self.vocab_size}, special_tokens={self.special_tokens})"


def set_special_post_processor(
    tok: tokenizers.Tokenizer, bos_token: str | None, eos_token: str | None
) -> None:
    """Make ``tok`` add ``bos_token`` before and ``eos_token`` after a sequence (either may be
    None) when encoding with special tokens, as transformers' ``update_post_processor``."""

    def around(seq: str, i: int) -> str:
        before = f"{bos_token}:{i} " if bos_token else ""
        return before + f"${seq}:{i}" + (f" {eos_token}:{i}" if eos_token else "")

    single, pair = around("A", 0), f"{around('A', 0)} {around('B', 1)}"
    names = dict.fromkeys(t for t in (bos_token, eos_token) if t)
    specials = [(t, tok.token_to_id(t)) for t in names]
    tok.post_processor = tokenizers.processors.TemplateProcessing(
        single=single, pair=pair, special_tokens=specials
    )


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{path}: not valid JSON ({e})") from e
    if not isinstance(data, dict):
        raise CheckpointError(f"{path}: expected a JSON object")
    return data


def _chat_template(path: Path, cfg: dict[str, Any]) -> str | None:
    """The default chat template: chat_template.jinja's, else tokenizer_config.json's."""
    if (path / "chat_template.jinja").is_file():
        return (path / "chat_template.jinja").read_text(encoding="utf-8")
    template = cfg.get("chat_template")
    if isinstance(template, list):  # named templates: [{"name": ..., "template": ...}]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    if template is not None and not isinstance(template, str):
        raise CheckpointError(
            f"{path / 'tokenizer_config.json'}: field 'chat_template' must be a string"
        )
    return template


# -- jinja, as transformers.utils.chat_template_utils sets it up ---------------------------


class _GenerationTag(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}`` (assistant-mask markers) renders its body."""

    tags = {"generation"}  # noqa: RUF012

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller: Any) -> str:
        return caller()


class _TemplateNamespace(jinja2.utils.Namespace):
    """A jinja ``namespace`` that refuses underscore attributes (as transformers')."""

    def __init__(*args: Any, **kwargs: Any) -> None:  # jinja's trick: `self` may be a key
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _TemplateNamespace._check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _TemplateNamespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(
                f"chat templates cannot set underscore attributes on a namespace ({name!r})"
            )


class _TemplateDict:
    def __call__(self, *args: Any, **kwargs: Any) -> dict:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict:
        return dict.fromkeys(*args, **kwargs)


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    x: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    return json.dumps(
        x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


_ENV = ImmutableSandboxedEnvironment(
    trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols]
)
_ENV.filters["tojson"] = _tojson
_ENV.globals["raise_exception"] = _raise_exception
_ENV.globals["strftime_now"] = _strftime_now
_ENV.globals["dict"] = _TemplateDict()
_ENV.globals["namespace"] = _TemplateNamespace


@lru_cache(maxsize=16)
def _compile(source: str) -> jinja2.Template:
    return _ENV.from_string(source)
