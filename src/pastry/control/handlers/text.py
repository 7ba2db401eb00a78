"""Handlers of the tokenizer's requests."""

from __future__ import annotations

import jinja2

from pastry import api
from pastry.api import ApiError
from pastry.control.handlers.caller import Caller
from pastry.control.handlers.registry import handles
from pastry.control.tokenization import TokenizeTooLarge


@handles(api.Tokenize)
def tokenize(s: Caller, r: api.Tokenize) -> list[int]:
    ref = s.queue(r.q)
    if not isinstance(r.text, str):
        raise ApiError(f"tokenize takes a string, got {type(r.text).__name__}")
    try:
        return ref.model.tokens.encode(r.text, bool(r.add_special_tokens))
    except TokenizeTooLarge as e:
        raise ApiError(str(e)) from None


async def tokenize_async(s: Caller, r: api.Tokenize) -> list[int]:
    """:func:`tokenize` off the event loop (the model's tokenizing thread), for a runner
    that can suspend its inferlet meanwhile (the sandbox does for long texts)."""
    ref = s.queue(r.q)
    if not isinstance(r.text, str):
        raise ApiError(f"tokenize takes a string, got {type(r.text).__name__}")
    try:
        return await ref.model.tokens.encode_async(r.text, bool(r.add_special_tokens))
    except TokenizeTooLarge as e:
        raise ApiError(str(e)) from None


@handles(api.Detokenize)
def detokenize(s: Caller, r: api.Detokenize) -> str:
    return s.queue(r.q).model.tokenizer.decode(list(r.tokens))


@handles(api.GetVocabs)
def get_vocabs(s: Caller, r: api.GetVocabs) -> list[bytes]:
    return s.queue(r.q).model.tokenizer.get_vocabs()


@handles(api.GetEosTokenIds)
def get_eos_token_ids(s: Caller, r: api.GetEosTokenIds) -> list[int]:
    return list(s.queue(r.q).model.info.eos_token_ids)


@handles(api.GetVocabSize)
def get_vocab_size(s: Caller, r: api.GetVocabSize) -> int:
    return s.queue(r.q).model.info.vocab_size


@handles(api.ApplyChatTemplate)
def apply_chat_template(s: Caller, r: api.ApplyChatTemplate) -> str:
    tok = s.queue(r.q).model.tokenizer
    msgs = []
    for m in r.messages:
        if len(m) != 2 or not all(isinstance(x, str) for x in m):
            raise ApiError(f"messages must be (role, content) string pairs, got {m!r}")
        msgs.append({"role": m[0], "content": m[1]})
    try:
        return tok.apply_chat_template(msgs, add_generation_prompt=r.add_generation_prompt)
    except (ValueError, jinja2.TemplateError) as e:
        raise ApiError(str(e)) from None
