"""The value types of the inferlet API, and what each one is in WIT.

A request's fields are annotated with ordinary Python types; the few that Python cannot
say precisely (how wide an integer is, a float's width, a packed bitmask) are
``Annotated`` with a :class:`Wit` marker. :func:`wit_type` turns an annotation into a
small type tree, the one form every binding is derived from:

- a string for a scalar: ``"u32"``, ``"s64"``, ``"f32"``, ``"bool"``, ``"string"``, ...,
  and ``"bitmask"`` (``bytes`` in Python, ``list<u32>`` words in WIT);
- ``("list", t)``, ``("option", t)``, ``("tuple", t1, t2, ...)``;
- ``("record", name)`` for a record of :data:`RECORDS` (:class:`~pastry.api.sampling.Sampling`).

:func:`wit_text` writes a tree as WIT. Python ``int`` must be annotated (``Handle``,
``Count``, ``Token``, ``I32``, ``I64``): a bare ``int`` is refused when the table is built.
"""

from __future__ import annotations

import types
import typing
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Annotated, Any, Union


@dataclass(frozen=True)
class Wit:
    """A WIT scalar that an ``Annotated[int | float | bytes, ...]`` field maps to."""

    name: str
    lo: int | None = None  # integers: the range the WIT type holds
    hi: int | None = None


U8 = Wit("u8", 0, 0xFF)
U16 = Wit("u16", 0, 0xFFFF)
U32 = Wit("u32", 0, 0xFFFF_FFFF)
U64 = Wit("u64", 0, 2**64 - 1)
S32 = Wit("s32", -(2**31), 2**31 - 1)
S64 = Wit("s64", -(2**63), 2**63 - 1)
F32 = Wit("f32")
F64 = Wit("f64")
BITMASK = Wit("bitmask")  # bytes in Python: little-endian 32-bit words; list<u32> in WIT

# The annotations requests use. Handles are small integers private to an instance.
Handle = Annotated[int, U32]  # a queue, KV page, embedding, subscription or constraint
Count = Annotated[int, U32]  # a number of things, an offset or a length
Token = Annotated[int, U32]  # a token id
I32 = Annotated[int, S32]
I64 = Annotated[int, S64]
Float32 = Annotated[float, F32]
Bitmask = Annotated[bytes, BITMASK]

RECORDS: dict[type, str] = {}  # record classes -> their WIT names (filled by api.table)

Tree = Any  # str | tuple: see the module docstring


def wit_type(annotation: Any) -> Tree:
    """The type tree of a (resolved) annotation; ``None`` for ``None`` (no value)."""
    if annotation is None or annotation is type(None):
        return None
    origin = typing.get_origin(annotation)
    if origin is Annotated:
        _, *marks = typing.get_args(annotation)
        mark = next(m for m in marks if isinstance(m, Wit))
        return mark.name
    if origin in (Union, types.UnionType):
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        if len(args) != 1 or len(typing.get_args(annotation)) != 2:
            raise TypeError(f"only `X | None` unions map to WIT (option<X>), got {annotation}")
        return ("option", wit_type(args[0]))
    if origin in (list, Sequence):
        (elem,) = typing.get_args(annotation)
        return ("list", wit_type(elem))
    if origin is tuple:
        return ("tuple", *(wit_type(a) for a in typing.get_args(annotation)))
    if annotation in RECORDS:
        return ("record", RECORDS[annotation])
    simple = {bool: "bool", str: "string", float: "f64", bytes: ("list", "u8")}
    if annotation in simple:
        return simple[annotation]
    if annotation is int:
        raise TypeError("a bare int has no WIT width: annotate it (Handle, Count, I32, I64, ...)")
    raise TypeError(f"no WIT type for {annotation!r}")


def wit_text(tree: Tree) -> str:
    """``tree`` written as WIT."""
    if isinstance(tree, str):
        return "list<u32>" if tree == "bitmask" else tree
    kind, *parts = tree
    if kind == "record":
        return parts[0]
    return f"{kind}<{', '.join(wit_text(p) for p in parts)}>"


BOUNDS = {w.name: (w.lo, w.hi) for w in (U8, U16, U32, U64, S32, S64)}
_SCALAR_TEXT = {
    "bool": ("a bool", "bools"),
    "string": ("a string", "strings"),
    "f32": ("a number", "numbers"),
    "f64": ("a number", "numbers"),
    "bitmask": ("bytes of whole 32-bit words (a packed bitmask)", "packed bitmasks"),
}


def describe(tree: Tree, plural: bool = False) -> str:
    """What a value of ``tree`` must be, for error messages ("an integer from 0 to ...")."""
    if isinstance(tree, str):
        if tree in BOUNDS:
            lo, hi = BOUNDS[tree]
            text = f"integer{'s' if plural else ''} from {_power(lo)} to {_power(hi)}"
            return text if plural else "an " + text
        one, many = _SCALAR_TEXT.get(tree, (tree, tree + "s"))
        return many if plural else one
    kind, *parts = tree
    if kind == "list":
        return ("lists of " if plural else "a list of ") + describe(parts[0], True)
    if kind == "option":
        return f"None or {describe(parts[0], plural)}"
    if kind == "record":
        return f"{parts[0]} records" if plural else f"a {parts[0]} record"
    inner = ", ".join(describe(p) for p in parts)
    return f"tuples ({inner})" if plural else f"a tuple ({inner})"


def _power(v: int) -> str:
    for base, off in ((2**64, -1), (2**63, -1), (2**32, -1), (2**31, -1)):
        if v == base + off:
            return f"2**{base.bit_length() - 1}-1"
        if v == -base:
            return f"-2**{base.bit_length() - 1}"
    return str(v)
