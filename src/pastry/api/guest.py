"""The guest side of the API: :class:`InferletApi` over the WIT imports, from the table.

Inside the WebAssembly guest (``pastry.runtime.guest.pyrt_app``), :func:`binding` makes the
``GuestApi`` class from the request table and the component's generated import module
(``wit_world.imports.api``): one method per request kind, with the record's parameters,
that checks each argument against its WIT type (a value the import cannot take — a
negative handle, a number over 32 bits, a string for a number — is an :class:`ApiError`
naming it, not a trap of the whole instance), converts it (sequences to lists, a bitmask
to its words, a :class:`~pastry.api.sampling.Sampling` to the WIT record), calls the import
of the same name and converts its result back. Queued calls return a future of the loop
(``loop.track(pending)``), resolved with :func:`unwrap` of the ``value`` case the host sends.

Pure Python over any object with the imports as attributes, so the tests run it on the host
against a recording fake (``tests/test_api_table.py``).
"""

from __future__ import annotations

import array
import dataclasses
import typing
from collections.abc import Callable
from typing import Any

from pastry.api.errors import ApiError
from pastry.api.sampling import Sampling, sampling_of
from pastry.api.surface import InferletApi, alias_params, signature
from pastry.api.table import ALIASES, SPECS, Param, Spec
from pastry.api.types import BOUNDS, describe, wit_type

assert array.array("I").itemsize == 4


# ---------------------------------------------------------------------------- checks


def _u32_list(v) -> list[int] | None:
    """``v`` as a list of Python ints from 0 to 2**32-1, or None (checked in C)."""
    if type(v) is not list and type(v) is not tuple and type(v) is not range:
        return None
    try:
        return array.array("I", v).tolist()
    except (TypeError, OverflowError):
        return None


def converter(tree) -> Callable[[Any], Any]:
    """A function returning the WIT form of a Python value of ``tree`` (sequences as
    lists, floats as floats, bitmasks as words), or raising ``TypeError`` for a value the
    binding would not take. Records go through :func:`record_converter`."""
    if isinstance(tree, str):
        return _scalar(tree)
    kind, *parts = tree
    if kind == "list":
        return _list(parts[0])
    if kind == "option":
        inner = (
            record_converter(Sampling)
            if parts[0] == ("record", "sampling")
            else converter(parts[0])
        )
        return lambda v: None if v is None else inner(v)
    if kind == "tuple":
        conv = [converter(p) for p in parts]

        def tup(v):
            if not isinstance(v, tuple | list) or len(v) != len(conv):
                raise TypeError
            return tuple(c(x) for c, x in zip(conv, v, strict=True))

        return tup
    raise ValueError(f"no converter for {tree!r}")


def _scalar(tree: str) -> Callable[[Any], Any]:
    if tree in BOUNDS:
        lo, hi = BOUNDS[tree]

        def integer(v):
            if type(v) is not int:
                if type(v) is bool or not hasattr(v, "__index__"):
                    raise TypeError
                v = v.__index__()
            if not lo <= v <= hi:
                raise TypeError
            return v

        return integer
    if tree in ("f32", "f64"):
        return _number
    if tree == "bool":
        return _bool
    if tree == "string":
        return lambda v: v if type(v) is str else _fail()
    if tree == "bitmask":
        return _words
    raise ValueError(f"no converter for {tree!r}")


def _number(v):
    if type(v) is float:
        return v
    if type(v) is bool or not isinstance(v, int | float):
        raise TypeError
    return float(v)


def _list(item) -> Callable[[Any], Any]:
    if item == "u32":  # handles and tokens: one pass in C
        return _u32s
    if item == "u8":
        return lambda v: bytes(v) if isinstance(v, bytes | bytearray | memoryview) else _fail()
    each = converter(item)

    def items(v):
        if isinstance(v, str | bytes | dict) or not hasattr(v, "__iter__"):
            raise TypeError
        return [each(x) for x in v]

    return items


def _u32s(v):
    out = _u32_list(v)
    if out is None:
        raise TypeError
    return out


class FieldError(TypeError):
    """A record field the binding would not take (its name, for the message)."""


def record_converter(cls: type) -> Callable[[Any], tuple]:
    """A record's fields in WIT form, as a tuple in declaration order (the binding's
    dataclass takes them positionally)."""
    hints = typing.get_type_hints(cls, include_extras=True)
    fields = []
    for f in dataclasses.fields(cls):
        tree = wit_type(hints[f.name])
        fields.append((f.name, converter(tree), isinstance(tree, tuple) and tree[0] == "list"))

    def convert(v):
        if type(v) is not cls:
            raise TypeError
        out = []
        for name, conv, is_list in fields:
            value = getattr(v, name)
            if value is None and is_list:  # an unset list
                value = ()
            try:
                out.append(conv(value))
            except TypeError:
                raise FieldError(name) from None
        return tuple(out)

    return convert


def _fail():
    raise TypeError


def _bool(v) -> bool:
    """A bool, or 0 / 1 (what array code often holds) as one."""
    if type(v) is bool:
        return v
    if type(v) is int and v in (0, 1):
        return bool(v)
    raise TypeError


def _words(mask) -> list[int]:
    if not isinstance(mask, bytes | bytearray | memoryview) or len(mask) % 4:
        raise TypeError
    return memoryview(bytes(mask)).cast("I").tolist()  # wasm32 is little-endian


def _short(v) -> str:
    r = repr(v)
    return r if len(r) <= 60 else r[:57] + "..."


def _bad(fn: str, p: Param, v: Any, field: str | None) -> ApiError:
    if field is not None:
        hints = typing.get_type_hints(Sampling, include_extras=True)
        what = describe(wit_type(hints[field]))
        return ApiError(f"{fn}: {p.name}.{field} must be {what}, got {_short(getattr(v, field))}")
    return ApiError(f"{fn}: {p.name} must be {describe(p.tree)}, got {_short(v)}")


# ---------------------------------------------------------------------------- results


def result_converter(tree) -> Callable[[Any], Any] | None:
    """The Python form of a value the binding returns; None: the binding's is it already
    (lists, tuples, bytes, options map one to one). Only a bitmask differs: words there,
    bytes here."""
    if tree == "bitmask":
        return lambda words: array.array("I", words).tobytes()
    return None


def unwrap(v: Any) -> Any:
    """The Python value of a ``value`` case the host sent (``Value_Dist(...)`` -> its
    ``(ids, probs)``, ``Value_None_()`` -> None)."""
    return getattr(v, "value", None)


# ---------------------------------------------------------------------------- the binding


def binding(host: Any, err: type[BaseException]) -> type[InferletApi]:
    """``GuestApi``: :class:`InferletApi` over ``host``'s imports (errors raised as
    ``err``, whose ``value`` is the message). ``GuestApi(loop)`` answers queued calls with
    ``loop.track(pending)`` futures."""
    ns: dict[str, Any] = {
        "host": host, "Err": err, "ApiError": ApiError, "sampling_of": sampling_of,
        "FieldError": FieldError, "_bad": _bad,
    }  # fmt: skip
    methods: dict[str, Any] = {"__init__": _init, "call": _call}
    for spec in SPECS.values():
        methods[spec.name] = _method(spec.name, spec, list(spec.params), ns, host)
    for a in ALIASES.values():
        methods[a.name] = _method(a.name, a.target, alias_params(a), ns, host)
    return type("GuestApi", (InferletApi,), methods)


def _init(self, loop) -> None:
    self.loop = loop


def _call(self, request: Any) -> Any:
    """A request record, sent as the method of its kind."""
    spec = SPECS_BY_CLASS[type(request)]
    return getattr(self, spec.name)(*(getattr(request, p.name) for p in spec.params))


SPECS_BY_CLASS = {s.cls: s for s in SPECS.values()}


def _method(name: str, spec: Spec, params: list[Param], ns: dict, host: Any):
    """One generated method: check and convert the arguments, call the import, convert
    the answer."""
    fn = getattr(host, spec.name)
    sig = signature(params, ns, name)
    if spec.samples:
        sig += ", **options"
    lines = [f"def {name}({sig}):"]
    if spec.samples:
        lines.append("    sampling = sampling_of(sampling, options)")
    args = []
    for p in spec.params:
        key = f"_c_{name}_{p.name}"
        ns[key] = converter(p.tree)
        ns[f"_p_{name}_{p.name}"] = p
        lines += [
            "    try:",
            f"        w_{p.name} = {key}({p.name})",
            "    except FieldError as e:",
            f"        raise _bad({name!r}, _p_{name}_{p.name}, {p.name}, e.args[0]) from None",
            "    except TypeError:",
            f"        raise _bad({name!r}, _p_{name}_{p.name}, {p.name}, None) from None",
        ]
        if p.tree == ("option", ("record", "sampling")):
            lines.append(f"    if w_{p.name} is not None: w_{p.name} = host.Sampling(*w_{p.name})")
        args.append(f"w_{p.name}")
    ns[f"_f_{name}"] = fn
    lines += [
        "    try:",
        f"        r = _f_{name}({', '.join(args)})",
        "    except Err as e:",
        "        raise ApiError(e.value) from None",
    ]
    conv = result_converter(spec.now_tree)
    now = "r"
    if conv is not None:
        ns[f"_r_{name}"] = conv
        now = f"_r_{name}(r)"
    if spec.queued and spec.now is not None:  # prefill: (pages now, pending)
        lines += ["    now, pending = r", "    return now, self.loop.track(pending)"]
    elif spec.queued:
        lines.append("    return self.loop.track(r)")
    elif spec.now is not None:
        lines.append(f"    return {now}")
    src = "\n".join(lines) + "\n"
    exec(compile(src, f"<pastry.api.guest {name}>", "exec"), ns)
    method = ns[name]
    method.__doc__ = spec.doc
    method.__qualname__ = f"GuestApi.{name}"
    return method
