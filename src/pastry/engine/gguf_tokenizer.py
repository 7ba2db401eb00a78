"""A GGUF file's tokenizer rebuilt as a ``tokenizers`` object from ``tokenizer.ggml.*``.

:func:`build_tokenizer` makes byte-level BPE (``gpt2``) with the file's merges and the
pre-tokenizer llama.cpp applies for ``tokenizer.ggml.pre`` (:data:`PRE_TOKENIZERS`), or
SentencePiece-style BPE (``llama``) whose merges follow the token scores, with byte fallback;
control tokens are special, BOS/EOS as the file says (``add_bos_token``, else llama.cpp's
default for the vocabulary), and the chat template goes into ``tokenizer_config.json``.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import tokenizers
from tokenizers import AddedToken, Regex, decoders, normalizers, pre_tokenizers

from pastry.engine.gguf_file import Metadata
from pastry.wire.config import CheckpointError
from pastry.wire.tokenizer import set_special_post_processor

log = logging.getLogger(__name__)

# token_type values of tokenizer.ggml.token_type (llama.cpp's llama_token_type)
_NORMAL, _UNKNOWN, _CONTROL, _USER_DEFINED, _UNUSED, _BYTE = 1, 2, 3, 4, 5, 6


# -- pre-tokenizers ----------------------------------------------------------------------------
# llama.cpp splits text with a list of regexes per `tokenizer.ggml.pre` (llama-vocab.cpp), each
# applied to the pieces of the previous one, matches and the text between them kept: a
# sequence of `Split(..., "isolated")` pre-tokenizers. Where llama.cpp spells a tokenizer.json
# regex differently for its own regex engine, the tokenizer.json spelling is used.
_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_LLAMA3 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN35 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
    r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_TEKKEN = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_GPT4O = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


@dataclass(frozen=True)
class PreTokenizer:
    """How llama.cpp splits text for a ``tokenizer.ggml.pre`` value: the regexes in order,
    whether whole words found in the vocabulary skip the merges, and whether a sequence
    starts with BOS when the file does not say (``tokenizer.ggml.add_bos_token``)."""

    regexes: tuple[str, ...]
    ignore_merges: bool = False
    add_bos: bool = False


def _pre(names: str, pre: PreTokenizer) -> dict[str, PreTokenizer]:
    return dict.fromkeys(names.split(), pre)


PRE_TOKENIZERS: dict[str, PreTokenizer] = {
    **_pre(
        "default",
        PreTokenizer((r"[\p{P}\$\+<=>\^~\|]+", _GPT2, r"\p{N}+", r"[0-9][0-9][0-9]")),
    ),
    **_pre(
        "llama3 llama-v3 llama-bpe falcon3 falcon-h1 pixtral midm-2.0 lfm2 jina-v5-nano",
        PreTokenizer((_LLAMA3,), ignore_merges=True, add_bos=True),
    ),
    **_pre("dbrx smaug-bpe", PreTokenizer((_LLAMA3,))),
    **_pre(
        "qwen2 deepseek-r1-qwen kormo f2llmv2 megrez stablelm2 hunyuan solar-open",
        PreTokenizer((_QWEN2,)),
    ),
    **_pre("qwen35", PreTokenizer((_QWEN35,))),
    **_pre(
        "smollm starcoder refact command-r codeshell exaone minerva-7b mellum2",
        PreTokenizer((r"\p{N}", _GPT2)),
    ),
    **_pre(
        "gpt-2 phi-2 jina-es jina-de gigachat jina-v2-es jina-v2-de a.x-4.0 mellum modern-bert "
        "mpt olmo jais trillion granite-docling exaone4",
        PreTokenizer((_GPT2,)),
    ),
    **_pre("falcon", PreTokenizer((r"[\p{P}\$\+<=>\^~\|`]+", _GPT2, r"[0-9][0-9][0-9]"))),
    **_pre("tekken", PreTokenizer((_TEKKEN,), ignore_merges=True, add_bos=True)),
    **_pre("gpt-4o llama4 kanana2 talkie minimax-m2", PreTokenizer((_GPT4O,))),
    **_pre(
        "deepseek-coder",
        PreTokenizer(("[\r\n]", r"\s?\p{L}+", r"\s?\p{P}+", "[一-龥ࠀ-一가-퟿]+", r"\p{N}")),
    ),
}


def build_tokenizer(meta: Metadata) -> tuple[tokenizers.Tokenizer, dict[str, Any]]:
    """The ``tokenizers`` object and the ``tokenizer_config.json`` the metadata describes."""
    path = meta.path
    model = meta.need("tokenizer.ggml.model", "the tokenizer")
    tokens = meta.need("tokenizer.ggml.tokens", "the vocabulary")
    types = meta.get("tokenizer.ggml.token_type") or [_NORMAL] * len(tokens)
    if len(types) != len(tokens):
        raise CheckpointError(
            f"{path}: tokenizer.ggml.token_type has {len(types)} entries for {len(tokens)} tokens"
        )
    if model == "gpt2":
        tok, default_bos = _byte_level_bpe(meta, tokens)
    elif model == "llama":
        tok, default_bos = _sentencepiece_bpe(meta, tokens, types), True
    else:
        raise CheckpointError(
            f"{path}: tokenizer.ggml.model is '{model}', which is not supported "
            "(supported: gpt2 (byte-level BPE), llama (SentencePiece-style BPE))"
        )
    tok.add_special_tokens(
        [AddedToken(t, special=True, normalized=False) for t, k in zip(tokens, types, strict=True)
         if k == _CONTROL]
    )  # fmt: skip
    tok.add_tokens(
        [AddedToken(t, special=False, normalized=False)
         for t, k in zip(tokens, types, strict=True) if k == _USER_DEFINED]
    )  # fmt: skip
    special = _special_tokens(meta, tokens)
    add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", default_bos))
    add_eos = bool(meta.get("tokenizer.ggml.add_eos_token", False))
    add_bos, add_eos = add_bos and "bos_token" in special, add_eos and "eos_token" in special
    set_special_post_processor(
        tok, special["bos_token"] if add_bos else None, special["eos_token"] if add_eos else None
    )
    config = {
        **special,
        "add_bos_token": add_bos,
        "add_eos_token": add_eos,
        "chat_template": meta.get("tokenizer.chat_template"),
        "clean_up_tokenization_spaces": False,
        "tokenizer_class": "PreTrainedTokenizerFast",
    }
    return tok, config


def _special_tokens(meta: Metadata, tokens: list[str]) -> dict[str, str]:
    """``bos_token``, ``eos_token``, ... (those the file names) by their text."""
    special = {}
    for name, k in (
        ("bos_token", "bos_token_id"),
        ("eos_token", "eos_token_id"),
        ("unk_token", "unknown_token_id"),
        ("sep_token", "seperator_token_id"),  # sic: llama.cpp's spelling
        ("pad_token", "padding_token_id"),
        ("cls_token", "cls_token_id"),
        ("mask_token", "mask_token_id"),
    ):
        i = meta.get(f"tokenizer.ggml.{k}")
        if i is None:
            continue
        if not 0 <= int(i) < len(tokens):
            raise CheckpointError(
                f"{meta.path}: tokenizer.ggml.{k} is {i}, not a token id (the vocabulary has "
                f"{len(tokens)} tokens)"
            )
        special[name] = tokens[int(i)]
    return special


def _byte_level_bpe(meta: Metadata, tokens: list[str]) -> tuple[tokenizers.Tokenizer, bool]:
    pre_name = meta.get("tokenizer.ggml.pre")
    if pre_name is None:
        log.warning(
            "%s: no tokenizer.ggml.pre; splitting text as llama.cpp's 'default' (generation "
            "quality may suffer; a newer conversion of the model names its pre-tokenizer)",
            meta.path,
        )
        pre_name = "default"
    pre = PRE_TOKENIZERS.get(pre_name)
    if pre is None:
        raise CheckpointError(
            f"{meta.path}: tokenizer.ggml.pre is '{pre_name}', a pre-tokenizer Pastry does not "
            f"know (known: {', '.join(sorted(PRE_TOKENIZERS))})"
        )
    merges = meta.need("tokenizer.ggml.merges", "byte-level BPE needs its merges")
    vocab = {t: i for i, t in enumerate(tokens)}
    pairs = []
    for m in merges:
        cut = m.find(" ", 1)  # llama.cpp's split: a piece may itself start with a space
        if cut < 0:
            raise CheckpointError(f"{meta.path}: tokenizer.ggml.merges has a malformed merge {m!r}")
        pairs.append((m[:cut], m[cut + 1 :]))
    tok = tokenizers.Tokenizer(
        tokenizers.models.BPE(vocab=vocab, merges=pairs, ignore_merges=pre.ignore_merges)
    )
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in pre.regexes]
        + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
    )
    tok.decoder = decoders.ByteLevel()
    return tok, pre.add_bos


def _sentencepiece_bpe(meta: Metadata, tokens: list[str], types: list[int]) -> tokenizers.Tokenizer:
    """SentencePiece BPE as llama.cpp runs it: the adjacent pair whose concatenation is the
    best-scored token merges first, i.e. BPE with merges ranked by the merged token's score."""
    vocab = {t: i for i, t in enumerate(tokens)}
    merges = meta.get("tokenizer.ggml.merges")
    if merges is not None:
        pairs = [tuple(m.split(" ", 1)) for m in merges]
    else:
        scores = meta.need("tokenizer.ggml.scores", "SentencePiece merges follow the scores")
        ranked = []
        for token, i in vocab.items():
            if types[i] not in (_NORMAL, _USER_DEFINED):
                continue
            for cut in range(1, len(token)):
                a, b = token[:cut], token[cut:]
                if a in vocab and b in vocab:
                    ranked.append((-scores[i], i, vocab[a], (a, b)))
        pairs = [pair for *_, pair in sorted(ranked)]
    unk_id = meta.get("tokenizer.ggml.unknown_token_id")
    tok = tokenizers.Tokenizer(
        tokenizers.models.BPE(
            vocab=vocab,
            merges=pairs,
            unk_token=None if unk_id is None else tokens[int(unk_id)],
            fuse_unk=True,
            byte_fallback=True,
        )
    )
    prefix = bool(meta.get("tokenizer.ggml.add_space_prefix", True))
    spaces = normalizers.Replace(" ", "▁")
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), spaces]) if prefix else spaces
    steps = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    tok.decoder = decoders.Sequence([*steps, decoders.Strip(" ", 1, 0)] if prefix else steps)
    return tok
