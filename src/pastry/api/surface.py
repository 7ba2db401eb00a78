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

from typing import Any

from pastry.api.sampling import sampling_of
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


def _method(name: str, spec: Spec, params: list[Param], doc: str) -> Any:
    names: dict[str, Any] = {"_R": spec.cls, "sampling_of": sampling_of}
    sig = signature(params, names, name)
    fields = [p.name for p in spec.params]
    if spec.samples:
        sig += ", **options"
        fields = ["sampling_of(sampling, options)" if f == "sampling" else f for f in fields]
    src = f"def {name}({sig}):\n    return self.call(_R({', '.join(fields)}))\n"
    exec(compile(src, f"<pastry.api {name}>", "exec"), names)
    fn = names[name]
    fn.__doc__ = doc
    fn.__qualname__ = f"InferletApi.{name}"
    fn.__module__ = __name__
    fn.__annotations__ = {p.name: p.annotation for p in params}
    fn.__annotations__["return"] = _returns(spec)
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


def source(name: str) -> str:
    """The generated source of method ``name``."""
    return _SOURCES[name]
