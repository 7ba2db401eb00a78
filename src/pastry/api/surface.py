"""``InferletApi``: the Python methods of the API, derived from the request table.

Each request kind of :data:`pastry.api.table.SPECS` (and each alias) becomes one method
with the record's fields as parameters (same names, order and defaults) that builds the
record and hands it to :meth:`InferletApi.call`. A runner implements ``call`` only: the
host's :class:`~pastry.control.session.Session` answers the record, the sandbox guest's
``GuestApi`` sends it over the WIT import of the same name. Requests with a ``sampling``
field also take its fields as keywords (``sample(q, e, temperature=0.7)``).

The methods are generated once, at import, from the table (``exec`` of a plain ``def``
per request, so that a call costs one record and one ``call``, not a generic wrapper);
:func:`source` shows what was generated.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from pastry.api.sampling import Sampling, sampling_of
from pastry.api.table import ALIASES, SPECS, Alias, Param, Spec


class InferletApi:
    """The inferlet API as one instance sees it: one method per request kind (see the
    records in :mod:`pastry.api`). Subclasses implement :meth:`call`."""

    def call(self, request: Any) -> Any:
        """Answer one request record: its value, or for a queued request an awaitable of
        it (``prefill``: both, as a pair)."""
        raise NotImplementedError


_SOURCES: dict[str, str] = {}


def signature(params: list[Param], names: dict[str, Any], fn: str) -> str:
    """``self, a, b=_d_fn_b, ...``: the defaults are put in ``names`` under those keys."""
    out = ["self"]
    for p in params:
        if p.required:
            out.append(p.name)
        else:
            key = f"_d_{fn}_{p.name}"
            names[key] = p.default
            out.append(f"{p.name}={key}")
    return ", ".join(out)


def _method(name: str, spec: Spec, params: list[Param], doc: str, handler: Any = None) -> Any:
    """The method of request ``spec``; with ``handler``, one that answers the record with
    ``handler(self, record)`` itself instead of through ``self.call``."""
    names: dict[str, Any] = {
        "_R": spec.cls,
        "_S": Sampling,
        "sampling_of": sampling_of,
        "_H": handler,
    }
    sig = signature(params, names, name)
    fields = [p.name for p in spec.params]
    if spec.samples:
        sig += ", **options"
        # sampling_of's common answer inline: a record (or None) passed, no keywords
        fast = "sampling if not options and (sampling is None or type(sampling) is _S) else "
        fields = [f"{fast}sampling_of(sampling, options)" if f == "sampling" else f for f in fields]
    answer = "self.call(" if handler is None else "_H(self, "
    src = f"def {name}({sig}):\n    return {answer}_R({', '.join(fields)}))\n"
    exec(compile(src, f"<pastry.api {name}>", "exec"), names)
    fn = names[name]
    fn.__doc__ = doc
    fn.__qualname__ = f"InferletApi.{name}"
    fn.__module__ = __name__
    fn.__annotations__ = {p.name: p.annotation for p in params}
    fn.__annotations__["return"] = _returns(spec)
    if handler is None:
        _SOURCES[name] = src
    return fn


def _returns(spec: Spec) -> Any:
    from collections.abc import Awaitable

    if spec.queued and spec.now is not None:
        return tuple[spec.now, Awaitable]
    if spec.queued:
        return Awaitable
    return spec.now


def alias_params(a: Alias) -> list[Param]:
    by_name = {p.name: p for p in a.target.params}
    params = [by_name[n] for n in a.order]
    # A parameter before a required one is required too.
    last_required = max(i for i, p in enumerate(params) if p.required)
    return [
        Param(p.name, p.annotation, p.tree) if i < last_required else p
        for i, p in enumerate(params)
    ]


for _spec in SPECS.values():
    setattr(InferletApi, _spec.name, _method(_spec.name, _spec, list(_spec.params), _spec.doc))
for _a in ALIASES.values():
    setattr(InferletApi, _a.name, _method(_a.name, _a.target, alias_params(_a), _a.doc))

API_FUNCTIONS: tuple[str, ...] = (*SPECS, *ALIASES)


def answered_by(handlers: Mapping[type, Callable[[Any, Any], Any]]) -> dict[str, Any]:
    """Every API method, by name, for a class whose :meth:`InferletApi.call` is
    ``handlers[type(request)](self, request)``: the same signatures, each calling its
    kind's handler directly. The host's session sets them on its class: a request then
    costs the record and its handler, not a dispatch through ``call`` too (on the decode
    path that is one Python call in about 80 per step). ``handlers`` must cover every
    request kind."""
    missing = [s.cls.__name__ for s in SPECS.values() if s.cls not in handlers]
    if missing:
        raise ValueError(f"no handler for request kinds {', '.join(missing)}")
    methods = {
        s.name: _method(s.name, s, list(s.params), s.doc, handlers[s.cls]) for s in SPECS.values()
    }
    for a in ALIASES.values():
        methods[a.name] = _method(a.name, a.target, alias_params(a), a.doc, handlers[a.target.cls])
    return methods


def source(name: str) -> str:
    """The generated source of method ``name``."""
    return _SOURCES[name]
