"""What a program of :mod:`pastry.sdk.interpreter` may call: the built-ins, the methods of
built-in values and the modules, each pure (no I/O, nothing outside the program's own
values), and the size checks that bound its memory. ``interp`` below is the running
:class:`~pastry.sdk.interpreter.Interpreter` (its ``call`` and ``limits``)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any


class CodeError(Exception):
    """A program was rejected (a construct that is not allowed), went over a limit, or
    failed; the message says which, with the line."""


@dataclass(frozen=True)
class Limits:
    steps: int = 200_000  # syntax nodes evaluated
    seconds: float = 5.0  # wall clock
    max_len: int = 100_000  # items of any string or collection
    max_int_bits: int = 4096
    max_depth: int = 50  # nested calls of the program's functions
    max_output: int = 20_000  # printed characters
    max_source: int = 20_000


def check_size(value: Any, limits: Limits) -> Any:
    if isinstance(value, str | bytes | list | tuple | dict | set | frozenset | range):
        if len(value) > limits.max_len:
            raise CodeError(f"a value of {len(value)} items (at most {limits.max_len})")
    elif isinstance(value, int) and value.bit_length() > limits.max_int_bits:
        raise CodeError(f"an integer of {value.bit_length()} bits (at most {limits.max_int_bits})")
    return value


_PURE = {
    "len": len, "abs": abs, "round": round, "int": int, "float": float, "str": str,
    "bool": bool, "list": list, "tuple": tuple, "set": set, "dict": dict, "range": range,
    "enumerate": lambda *a: list(enumerate(*a)), "zip": lambda *a: list(zip(*a, strict=False)),
    "reversed": lambda x: list(reversed(x)), "any": any, "all": all, "divmod": divmod,
    "chr": chr, "ord": ord, "hex": hex, "bin": bin, "oct": oct, "repr": repr,
    "isinstance": lambda x, t: isinstance(x, _TYPES[t.name] if isinstance(t, Builtin) else ()),
    "type": lambda x: Builtin(type(x).__name__), "frozenset": frozenset,
}  # fmt: skip
_TYPES = {"int": int, "float": float, "str": str, "bool": bool, "list": list, "tuple": tuple,
          "dict": dict, "set": set}  # fmt: skip
_KEYED = ("sorted", "min", "max", "sum", "map", "filter", "pow")
BUILTINS = frozenset([*_PURE, *_KEYED, "print"])

METHODS: dict[type, frozenset[str]] = {
    str: frozenset(
        [
            "upper",
            "lower",
            "strip",
            "lstrip",
            "rstrip",
            "split",
            "rsplit",
            "splitlines",
            "join",
            "replace",
            "startswith",
            "endswith",
            "find",
            "rfind",
            "index",
            "rindex",
            "count",
            "isdigit",
            "isalpha",
            "isalnum",
            "isspace",
            "isupper",
            "islower",
            "isnumeric",
            "isdecimal",
            "title",
            "capitalize",
            "swapcase",
            "zfill",
            "center",
            "ljust",
            "rjust",
            "partition",
            "rpartition",
            "casefold",
            "removeprefix",
            "removesuffix",
        ]
    ),
    list: frozenset(
        [
            "append",
            "extend",
            "pop",
            "insert",
            "remove",
            "index",
            "count",
            "sort",
            "reverse",
            "copy",
            "clear",
        ]
    ),
    dict: frozenset(
        ["keys", "values", "items", "get", "pop", "setdefault", "update", "copy", "clear"]
    ),
    set: frozenset(
        [
            "add",
            "remove",
            "discard",
            "pop",
            "union",
            "intersection",
            "difference",
            "symmetric_difference",
            "issubset",
            "issuperset",
            "copy",
            "clear",
            "update",
        ]
    ),
    tuple: frozenset(["index", "count"]),
    int: frozenset(["bit_length", "to_bytes"]) - {"to_bytes"},
    float: frozenset(["is_integer"]),
}
_WIDTH = {"zfill": 0, "center": 0, "ljust": 0, "rjust": 0}  # the width argument's index


@dataclass(frozen=True)
class Builtin:
    """A built-in function as a value of the program (called by the interpreter)."""

    name: str

    def __repr__(self) -> str:
        if self.name in _TYPES:
            return f"<class '{self.name}'>"
        return f"<built-in function {self.name}>"


@dataclass(frozen=True)
class Checked:
    """A module a program may import: the names it exposes."""

    name: str
    members: Mapping[str, Any]

    def get(self, attr: str) -> Any:
        if attr not in self.members:
            raise AttributeError(f"module {self.name!r} has no attribute {attr!r} here")
        return self.members[attr]

    def __repr__(self) -> str:
        return f"<module {self.name}>"


_MATH = {
    n: getattr(math, n)
    for n in [
        "sqrt",
        "floor",
        "ceil",
        "gcd",
        "lcm",
        "log",
        "log2",
        "log10",
        "exp",
        "sin",
        "cos",
        "tan",
        "asin",
        "acos",
        "atan",
        "atan2",
        "hypot",
        "fabs",
        "isqrt",
        "comb",
        "perm",
        "pi",
        "e",
        "tau",
        "inf",
        "nan",
        "isclose",
        "prod",
        "fsum",
        "degrees",
        "radians",
        "trunc",
    ]
}
MODULES = {"math": Checked("math", _MATH)}


async def call_method(interp: Any, obj: Any, name: str, args: list, kwargs: dict) -> Any:
    """``obj.name(*args, **kwargs)`` for an allowed method (or a module's function)."""
    if isinstance(obj, Checked):
        fn = obj.get(name)
        if name in ("factorial", "comb", "perm") and any(
            isinstance(a, int) and a > 5000 for a in args
        ):
            raise CodeError(f"math.{name} of a number over 5000")
        return fn(*args, **kwargs)
    allowed = next((m for t, m in METHODS.items() if type(obj) is t), None)
    if allowed is None and isinstance(obj, bool):
        allowed = METHODS[int]
    if allowed is None or name not in allowed:
        raise AttributeError(f"{type(obj).__name__!r} object has no method {name!r} here")
    lim = interp.limits.max_len
    if name in _WIDTH and args and isinstance(args[0], int) and args[0] > lim:
        raise CodeError(f"{name} to width {args[0]} (at most {lim})")
    if (
        name == "replace"
        and len(args) >= 2
        and isinstance(obj, str)
        and (obj.count(args[0]) * len(args[1]) + len(obj) > lim)
    ):
        raise CodeError(f"replace would make a string of over {lim} characters")
    if name == "sort" and "key" in kwargs:
        keys = [await interp.call(kwargs["key"], [x], {}) for x in obj]
        order = sorted(range(len(obj)), key=keys.__getitem__, reverse=bool(kwargs.get("reverse")))
        obj[:] = [obj[i] for i in order]
        return None
    return getattr(obj, name)(*args, **kwargs)


async def apply_builtin(interp: Any, name: str, args: list, kwargs: dict) -> Any:
    lim = interp.limits
    big = args and isinstance(args[0], range) and len(args[0]) > lim.max_len
    if name in ("list", "tuple", "set", "sorted", "sum", "frozenset") and big:
        raise CodeError(f"{name} of a range of {len(args[0])} (at most {lim.max_len})")
    if name in _PURE:
        return _PURE[name](*args, **kwargs)
    if name == "pow":
        ints = len(args) == 2 and all(isinstance(a, int) for a in args) and args[1] > 0
        if ints and abs(args[0]).bit_length() * args[1] > lim.max_int_bits:
            raise CodeError(f"pow({args[0]}, {args[1]}) is too large")
        return pow(*args)
    if name in ("map", "filter"):
        fn, items = args[0], list(args[1])
        results = [await interp.call(fn, [x], {}) for x in items] if fn is not None else items
        if name == "map":
            return results
        return [x for x, keep in zip(items, results, strict=True) if keep]
    return await _keyed(interp, name, args, kwargs)


async def _keyed(interp: Any, name: str, args: list, kwargs: dict) -> Any:
    """``sorted``, ``min``, ``max``, ``sum`` (with a ``key`` of the program's own)."""
    key = kwargs.pop("key", None)
    if name == "sum":
        return sum(*args, **kwargs)
    items = list(args[0]) if len(args) == 1 else list(args)
    if key is None:
        fn = {"sorted": sorted, "min": min, "max": max}[name]
        return fn(items, **kwargs)
    keys = [await interp.call(key, [x], {}) for x in items]
    order = sorted(range(len(items)), key=keys.__getitem__, reverse=bool(kwargs.get("reverse")))
    if name == "sorted":
        return [items[i] for i in order]
    if not items:
        raise ValueError(f"{name}() arg is an empty sequence")
    if name == "min":
        return items[order[0]]
    best = max(keys)
    return items[keys.index(best)]
