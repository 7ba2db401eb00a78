"""What a program appends to its prompt state: text, generations, selections, role markers.

``s += "text" + gen("x") + "\\n"`` builds an :class:`ExprList` (``+`` between an expression
and a string concatenates, as in SGLang) and submits it to the state's stream; the stream
executes its items in order. Expressions are plain immutable values: building one never
touches the model.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, fields, replace
from typing import Any

from pastry.lang.choices import ChoicesMethod, token_length_normalized

# The regular expressions SGLang uses for typed generation (gen_int, gen_string, dtype=).
REGEX_INT = r"[-+]?[0-9]+[ \n]*"
REGEX_FLOAT = r"[-+]?[0-9]*\.?[0-9]+[ \n]*"
REGEX_BOOL = r"(True|False)"
REGEX_STR = r"\"[\w\d\s]*\""


@dataclass(frozen=True)
class SamplingParams:
    """How one ``gen`` samples and stops; SGLang's sampling parameters and defaults.

    ``top_k`` -1 means off; ``stop`` is a string or strings (the output ends before the
    first one, which is not part of it); ``stop_token_ids`` end the output like an
    end-of-sequence token (not part of it either); ``ignore_eos`` keeps generating past the
    model's end-of-sequence tokens. ``regex`` / ``json_schema`` constrain the output to a
    grammar. ``logit_bias`` ({token id: bias}, as SGLang's native API takes it) is added to
    the logits. ``return_logprob`` adds the output tokens' log-probabilities (and
    ``top_logprobs_num`` alternatives) to the variable's meta info.
    """

    max_new_tokens: int = 128
    min_new_tokens: int = 0
    n: int = 1
    stop: str | tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    ignore_eos: bool = False
    seed: int | None = None
    logit_bias: tuple[tuple[int, float], ...] = ()
    regex: str | None = None
    json_schema: str | None = None
    return_logprob: bool = False
    logprob_start_len: int | None = None
    top_logprobs_num: int = 0
    return_text_in_logprobs: bool = False

    @property
    def stops(self) -> tuple[str, ...]:
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)

    def override(self, given: dict[str, Any]) -> SamplingParams:
        """These parameters with every non-None value of ``given`` taking precedence."""
        names = {f.name for f in fields(self)}
        unknown = sorted(set(given) - names)
        if unknown:
            raise TypeError(f"unknown sampling parameters {unknown}; known: {sorted(names)}")
        return replace(self, **{k: _normal(k, v) for k, v in given.items() if v is not None})

    def to_json(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


def _normal(name: str, value: Any) -> Any:
    if name in ("stop",) and not isinstance(value, str):
        return tuple(value)
    if name == "stop_token_ids":
        return tuple(int(t) for t in value)
    if name == "logit_bias":
        pairs = value.items() if isinstance(value, dict) else value
        return tuple(sorted((int(t), float(b)) for t, b in pairs))
    if name == "json_schema" and not isinstance(value, str):
        import json

        return json.dumps(value)
    return value


class Expr:
    """Something a prompt state can be extended with; ``+`` concatenates."""

    def __add__(self, other: Expr | str) -> ExprList:
        return ExprList((*_items(self), *_items(_expr(other))))

    def __radd__(self, other: Expr | str) -> ExprList:
        return ExprList((*_items(_expr(other)), *_items(self)))


@dataclass(frozen=True, eq=False)
class ExprList(Expr):
    items: tuple[Expr, ...]


@dataclass(frozen=True, eq=False)
class Text(Expr):
    value: str


@dataclass(frozen=True, eq=False)
class Gen(Expr):
    """Generate into variable ``name`` (``params``: only the values given to ``gen``; the
    program's defaults fill the rest when it runs). ``dtype`` is ``int``, ``float``,
    ``str`` or ``bool`` (or their names) for typed output, as in SGLang."""

    name: str | None
    params: dict[str, Any] = field(default_factory=dict)
    dtype: Any = None


@dataclass(frozen=True, eq=False)
class Select(Expr):
    """Append the most likely of ``choices`` and store it in ``name``."""

    name: str | None
    choices: tuple[str, ...]
    temperature: float = 0.0
    method: ChoicesMethod = token_length_normalized


@dataclass(frozen=True, eq=False)
class Image(Expr):
    """An image in the prompt (its encoded bytes: PNG, JPEG, WebP or GIF): the model's
    image token in the text, the image's embeddings in the context."""

    data: bytes

    def __repr__(self) -> str:
        return f"Image({len(self.data)} bytes)"


@dataclass(frozen=True, eq=False)
class RoleBegin(Expr):
    role: str


@dataclass(frozen=True, eq=False)
class RoleEnd(Expr):
    role: str


def _expr(x: Expr | str) -> Expr:
    if isinstance(x, Expr):
        return x
    if isinstance(x, str):
        return Text(x)
    raise TypeError(
        f"a prompt state can be extended with text or pastry.lang expressions (gen, select, "
        f"image, roles), not {type(x).__name__}: convert it with str() first"
    )


def _items(x: Expr) -> tuple[Expr, ...]:
    return x.items if isinstance(x, ExprList) else (x,)


def flatten(x: Expr | str) -> list[Expr]:
    """The leaves of ``x`` in order (nested lists flattened)."""
    out: list[Expr] = []
    stack: list[Expr] = [_expr(x)]
    while stack:
        e = stack.pop()
        if isinstance(e, ExprList):
            stack.extend(reversed(e.items))
        else:
            out.append(e)
    return out


def names(x: Expr | str) -> list[str]:
    """The variables ``x`` will define."""
    return [e.name for e in flatten(x) if isinstance(e, Gen | Select) and e.name is not None]


def typed_params(gen: Gen) -> dict[str, Any]:
    """``gen.params`` with ``dtype`` turned into SGLang's regular expression (and, for
    numbers, its extra stop strings)."""
    params = dict(gen.params)
    if gen.dtype is None:
        return params
    kinds = {int: REGEX_INT, "int": REGEX_INT, float: REGEX_FLOAT, "float": REGEX_FLOAT,
             str: REGEX_STR, "str": REGEX_STR, bool: REGEX_BOOL, "bool": REGEX_BOOL}  # fmt: skip
    if gen.dtype not in kinds:
        raise ValueError(f"dtype must be int, float, str or bool, got {gen.dtype!r}")
    params["regex"] = kinds[gen.dtype]
    if gen.dtype in (int, "int", float, "float"):
        stop = params.get("stop") or ()
        stop = [stop] if isinstance(stop, str) else list(stop)
        params["stop"] = [*stop, " ", "\n"]
    return params


def as_choices(choices: Sequence[str]) -> tuple[str, ...]:
    if isinstance(choices, str) or not choices or not all(isinstance(c, str) for c in choices):
        raise ValueError(f"choices must be a non-empty list of strings, got {choices!r}")
    return tuple(choices)
