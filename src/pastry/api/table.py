"""The table of request kinds: every API call is one typed record, registered here.

A request kind is a class decorated with :func:`request`: its annotated fields are the
call's parameters (in order, defaults as usual), its docstring the call's documentation,
and the decorator says how it answers — ``now=`` a value at once, ``queued=`` an awaitable
resolving to one of the ``value`` cases of :data:`VALUES` (both: at once, and later) —
plus its group (the WIT section), its trait (the capability a model advertises) and
whether it can fail. From :data:`SPECS` every other form is derived:
``pastry.api.surface.InferletApi`` (the Python methods), ``wit/pastry.wit``
(:mod:`pastry.api.wit`), the sandbox's host dispatch (``pastry.runtime.wasm_imports``) and
the guest binding (``pastry.runtime.guest.pyrt_app``). ``tests/test_api_table.py`` fails
if any of them disagrees with this table.

An :func:`alias` is a second Python entry point to one record kind with another parameter
order (``forward_with_adapter`` is ``forward`` with ``adapter`` second); it has no WIT
function of its own.
"""

from __future__ import annotations

import dataclasses
import inspect
import re
import typing
from dataclasses import MISSING, dataclass
from typing import Any

from pastry.api.types import RECORDS, Tree, wit_type


class _Required:
    def __repr__(self) -> str:
        return "REQUIRED"


REQUIRED = _Required()  # Param.default of a parameter without one

# The cases of the WIT ``value`` variant: what a queued call resolves to. (case, type, doc)
VALUES: dict[str, tuple[Tree, str]] = {
    "none": (None, "no value"),
    "token": ("u32", "a token id; prefill: the tokens that came from the prefix cache"),
    "dist": (
        ("tuple", ("list", "u32"), ("list", "f32")),
        "token ids by decreasing probability, probabilities",
    ),
    "text": ("string", "a message"),
    "http": (("tuple", "u16", "string"), "(status, body)"),
    "sampled": (
        ("tuple", "u32", "f32", ("list", "u32"), ("list", "f32")),
        "with logprobs: (token, its log-probability, top ids, their log-probabilities)",
    ),
    "logprobs": (
        ("tuple", ("list", "f32"), ("list", ("list", "u32")), ("list", ("list", "f32"))),
        "per input (target log-probability, NaN for none; top ids; their log-probabilities)",
    ),
    "placed": (
        ("tuple", "u32", ("list", "u32")),
        "(begin, pages holding the K/V of prompt[:begin])",
    ),
    "received": (("tuple", "u32", "u32"), "(kv-addr-info, matched-len)"),
    "request": (
        ("tuple", "u32", "string", ("list", "u32"), "s64"),
        "(request, model, prompt, program)",
    ),
    "generated": (
        (
            "tuple",
            ("list", "u32"),
            ("list", "u32"),
            "string",
            "string",
            ("list", "f32"),
            ("list", ("list", "u32")),
            ("list", ("list", "f32")),
        ),
        "(tokens, new pages, finish, error, logprobs, top ids, top logprobs)",
    ),
}


@dataclass(frozen=True)
class Param:
    name: str
    annotation: Any
    tree: Tree
    default: Any = REQUIRED

    @property
    def required(self) -> bool:
        return self.default is REQUIRED


@dataclass(frozen=True)
class Spec:
    """One request kind: its record class and how it is called and answers."""

    cls: type
    name: str  # the Python function: "get_next_dist"
    group: str  # the WIT section it is listed in
    trait: str | None
    doc: str
    params: tuple[Param, ...]
    now: Any = None  # the annotation of the value returned at once (None: none)
    now_tree: Tree = None
    queued: tuple[str, ...] = ()  # the VALUES cases the awaitable resolves to ((): not queued)
    fallible: bool = True

    @property
    def wit(self) -> str:
        return self.name.replace("_", "-")

    @property
    def samples(self) -> bool:
        """Whether it takes a ``sampling`` record (and so its fields as keywords)."""
        return any(p.tree == ("option", ("record", "sampling")) for p in self.params)


@dataclass(frozen=True)
class Alias:
    """Another Python name for a request kind, taking its parameters in ``order``."""

    name: str
    target: Spec
    order: tuple[str, ...]
    trait: str | None
    doc: str


SPECS: dict[str, Spec] = {}  # by Python name, in definition order
BY_CLASS: dict[type, Spec] = {}
ALIASES: dict[str, Alias] = {}


def record(name: str):
    """Register a record type (a dataclass) as the WIT record ``name``."""

    def register(cls: type) -> type:
        RECORDS[cls] = name
        return cls

    return register


def request(
    group: str,
    *,
    trait: str | None = None,
    now: Any = None,
    queued: tuple[str, ...] = (),
    fallible: bool = True,
):
    """Make the decorated class a request kind (a slotted dataclass) and register it.
    ``now``: the annotation of what the call returns at once; ``queued``: the value cases
    of what it returns later (an awaitable); a call with neither returns nothing."""

    def register(cls: type) -> type:
        name = _snake(cls.__name__)
        if name in SPECS or name in ALIASES:
            raise ValueError(f"request {name!r} is defined twice")
        for case in queued:
            if case not in VALUES:
                raise ValueError(f"{name}: unknown value case {case!r} (VALUES)")
        cls = dataclass(slots=True, eq=True)(cls)
        hints = typing.get_type_hints(cls, include_extras=True)
        params = []
        for f in dataclasses.fields(cls):
            try:
                tree = wit_type(hints[f.name])
            except TypeError as e:
                raise TypeError(f"{name}.{f.name}: {e}") from None
            default = REQUIRED if f.default is MISSING else f.default
            params.append(Param(f.name, hints[f.name], tree, default))
        now_ann = now
        spec = Spec(
            cls,
            name,
            group,
            trait,
            inspect.cleandoc(cls.__doc__ or ""),
            tuple(params),
            now_ann,
            wit_type(now_ann),
            tuple(queued),
            fallible,
        )
        SPECS[name] = spec
        BY_CLASS[cls] = spec
        return cls

    return register


def alias(name: str, target: type, order: tuple[str, ...], trait: str | None, doc: str) -> None:
    spec = BY_CLASS[target]
    if sorted(order) != sorted(p.name for p in spec.params):
        raise ValueError(f"alias {name}: {order} are not the parameters of {spec.name}")
    ALIASES[name] = Alias(name, spec, order, trait, inspect.cleandoc(doc))


def traits() -> dict[str, tuple[str, ...]]:
    """Trait -> the API functions it groups (the table's ``trait`` of each request and
    alias, in definition order)."""
    out: dict[str, list[str]] = {}
    for name, trait in [(s.name, s.trait) for s in SPECS.values()] + [
        (a.name, a.trait) for a in ALIASES.values()
    ]:
        if trait is not None:
            out.setdefault(trait, []).append(name)
    return {t: tuple(names) for t, names in out.items()}


def _snake(camel: str) -> str:
    return re.sub(r"(?<!^)(?=[A-Z])", "_", camel).lower()
