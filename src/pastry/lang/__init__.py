"""``pastry.lang``: SGLang's frontend language on Pastry.

A program is a Python function over a prompt state ``s``::

    from pastry.lang import function, gen, select

    @function
    def qa(s, question):
        s += "Q: " + question + "\\nA:" + gen("answer", max_tokens=32, stop="\\n")
        s += "\\nCorrect? " + select("ok", choices=["yes", "no"])

Appending (``s += ...``) never blocks: each state is a stream whose items run in order
on a KV context inside the server; ``s["answer"]`` waits for the value. ``s.fork(n)``
makes states that share the prefix's KV pages (computed once, before they run); calling
another ``@function`` from a body runs it as a concurrent nested program; ``s.user(...)``
and friends render role blocks with the model's chat template.

Run a program inside an inferlet (``await qa.arun(question=...)``, or
``async def main(args): return await qa.main(args)`` in its file and
``pastry run file.py -- question=...``) or from a client, where each run
is shipped to the server as one inferlet::

    import pastry.lang as sgl
    sgl.set_default_backend(sgl.Endpoint("http://127.0.0.1:8080"))
    state = qa.run(question="What is 2 + 2?", temperature=0)
    print(state["answer"], state.text())

See ``docs/lang.md``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from pastry.lang.choices import (
    ChoicesMethod,
    greedy_token_selection,
    token_length_normalized,
    unconditional_likelihood_normalized,
)
from pastry.lang.expr import (
    Expr,
    ExprList,
    Gen,
    Image,
    RoleBegin,
    RoleEnd,
    Select,
    Text,
    as_choices,
)
from pastry.lang.function import Function, function, get_default_backend, set_default_backend
from pastry.lang.state import ProgramState, ProgramStateGroup
from pastry.lang.stream import ProgramError


def gen(
    name: str | None = None,
    max_tokens: int | None = None,
    min_tokens: int | None = None,
    n: int | None = None,
    stop: str | Sequence[str] | None = None,
    stop_token_ids: Sequence[int] | None = None,
    temperature: float | None = None,
    top_p: float | None = None,
    top_k: int | None = None,
    min_p: float | None = None,
    frequency_penalty: float | None = None,
    presence_penalty: float | None = None,
    ignore_eos: bool | None = None,
    return_logprob: bool | None = None,
    logprob_start_len: int | None = None,
    top_logprobs_num: int | None = None,
    return_text_in_logprobs: bool | None = None,
    dtype: Any = None,
    choices: Sequence[str] | None = None,
    choices_method: ChoicesMethod | None = None,
    regex: str | None = None,
    json_schema: str | dict | None = None,
) -> Expr:
    """Generate into variable ``name``. Unset parameters take the run's defaults
    (``f.run(temperature=0, max_new_tokens=64)``; SGLang's defaults otherwise). With
    ``choices``, this is :func:`select`."""
    if choices:
        return select(name, choices, 0.0 if temperature is None else temperature,
                      choices_method or token_length_normalized)  # fmt: skip
    if regex is not None:
        import re

        re.compile(regex)  # a bad pattern fails here, where it was written
    given = {
        "max_new_tokens": max_tokens, "min_new_tokens": min_tokens, "n": n, "stop": stop,
        "stop_token_ids": stop_token_ids, "temperature": temperature, "top_p": top_p,
        "top_k": top_k, "min_p": min_p, "frequency_penalty": frequency_penalty,
        "presence_penalty": presence_penalty, "ignore_eos": ignore_eos,
        "return_logprob": return_logprob, "logprob_start_len": logprob_start_len,
        "top_logprobs_num": top_logprobs_num,
        "return_text_in_logprobs": return_text_in_logprobs, "regex": regex,
        "json_schema": json_schema,
    }  # fmt: skip
    return Gen(name, {k: v for k, v in given.items() if v is not None}, dtype)


def gen_int(name: str | None = None, **kw: Any) -> Expr:
    """``gen`` constrained to an integer."""
    return gen(name, dtype=int, **kw)


def gen_string(name: str | None = None, **kw: Any) -> Expr:
    """``gen`` constrained to a double-quoted string of word characters and spaces."""
    return gen(name, dtype=str, **kw)


def select(
    name: str | None = None,
    choices: Sequence[str] | None = None,
    temperature: float = 0.0,
    choices_method: ChoicesMethod = token_length_normalized,
) -> Expr:
    """Append the most likely of ``choices`` (each scored by forward passes that share the
    prompt's KV) and store it in ``name``."""
    return Select(name, as_choices(choices or ()), float(temperature), choices_method)


def image(source: bytes | str) -> Expr:
    """An image for the prompt (SGLang's ``sgl.image``): its encoded bytes (PNG, JPEG, WebP
    or GIF), a ``data:`` URL, or the path of a file, read where the program runs (inside
    the server for a program run through an :class:`Endpoint`: pass a client's image as
    bytes, an argument of the run). The state's text gets the model's image token; the
    image's embeddings take its place in the context. On a model without images the
    program fails with the server's error."""
    if isinstance(source, bytes | bytearray | memoryview):
        return Image(bytes(source))
    if not isinstance(source, str):
        raise TypeError(f"image() takes bytes, a data: URL or a path, not {type(source).__name__}")
    if source.startswith("data:"):
        import base64
        import binascii

        head, _, data = source.partition(",")
        if not head.endswith(";base64"):
            raise ValueError("image(): a data: URL must be base64 (data:image/...;base64,...)")
        try:
            return Image(base64.b64decode(data, validate=True))
        except binascii.Error as e:
            raise ValueError(f"image(): the data: URL's base64 is not valid: {e}") from None
    if source.startswith(("http://", "https://")):
        raise ValueError("image(): pastry.lang does not fetch URLs; pass the image's bytes")
    with open(source, "rb") as f:
        return Image(f.read())


def _role(role: str, expr: Expr | str | None) -> Expr:
    if expr is None:
        return ExprList((RoleBegin(role), RoleEnd(role)))
    inner = expr if isinstance(expr, Expr) else Text(str(expr))
    items = inner.items if isinstance(inner, ExprList) else (inner,)
    return ExprList((RoleBegin(role), *items, RoleEnd(role)))


def system(expr: Expr | str | None = None) -> Expr:
    return _role("system", expr)


def user(expr: Expr | str | None = None) -> Expr:
    return _role("user", expr)


def assistant(expr: Expr | str | None = None) -> Expr:
    return _role("assistant", expr)


def system_begin() -> Expr:
    return RoleBegin("system")


def system_end() -> Expr:
    return RoleEnd("system")


def user_begin() -> Expr:
    return RoleBegin("user")


def user_end() -> Expr:
    return RoleEnd("user")


def assistant_begin() -> Expr:
    return RoleBegin("assistant")


def assistant_end() -> Expr:
    return RoleEnd("assistant")


def __getattr__(name: str) -> Any:
    # The client side (websockets) loads only when a client uses it.
    if name in ("Endpoint", "RuntimeEndpoint"):
        from pastry.lang.endpoint import Endpoint

        return Endpoint
    raise AttributeError(f"module 'pastry.lang' has no attribute {name!r}")


__all__ = [
    "ChoicesMethod",
    "Endpoint",
    "Function",
    "ProgramError",
    "ProgramState",
    "ProgramStateGroup",
    "RuntimeEndpoint",
    "assistant",
    "assistant_begin",
    "assistant_end",
    "function",
    "gen",
    "gen_int",
    "gen_string",
    "get_default_backend",
    "greedy_token_selection",
    "image",
    "select",
    "set_default_backend",
    "system",
    "system_begin",
    "system_end",
    "token_length_normalized",
    "unconditional_likelihood_normalized",
    "user",
    "user_begin",
    "user_end",
]

from pastry.lang import inferlet as inferlet  # noqa: E402  (the entry of shipped programs)
from pastry.lang import library  # noqa: E402

library.register(globals())  # a shipped program names these as pastry.lang.NAME
