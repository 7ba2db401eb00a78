"""The requests of the client protocol at ``/ws`` (``docs/protocol.md``): one frozen
dataclass per message ``type`` (:data:`REQUESTS`), and :func:`parse`, which checks a decoded
JSON message against its fields' types (a :class:`ProtocolError` names what is wrong).
"""

from __future__ import annotations

import types
import typing
from dataclasses import MISSING, dataclass, field, fields
from typing import Any, ClassVar


@dataclass(frozen=True)
class Auth:
    type: ClassVar[str] = "auth"
    token: str


@dataclass(frozen=True)
class Upload:
    type: ClassVar[str] = "upload"
    source: str
    name: str | None = None


@dataclass(frozen=True)
class Launch:
    type: ClassVar[str] = "launch"
    program: str
    args: list[str] = field(default_factory=list)
    detached: bool = False


@dataclass(frozen=True)
class Send:
    type: ClassVar[str] = "send"
    instance: int
    message: str


@dataclass(frozen=True)
class Terminate:
    type: ClassVar[str] = "terminate"
    instance: int
    reason: str | None = None


@dataclass(frozen=True)
class Attach:
    type: ClassVar[str] = "attach"
    instance: int


@dataclass(frozen=True)
class ListPrograms:
    type: ClassVar[str] = "list_programs"


@dataclass(frozen=True)
class ListInstances:
    type: ClassVar[str] = "list_instances"


@dataclass(frozen=True)
class DeleteProgram:
    type: ClassVar[str] = "delete_program"
    program: str


REQUESTS: dict[str, type] = {
    cls.type: cls
    for cls in (
        Auth, Upload, Launch, Send, Terminate, Attach, ListPrograms, ListInstances, DeleteProgram
    )
}  # fmt: skip


class ProtocolError(Exception):
    """A request that cannot be served; becomes an ``error`` reply with ``code``."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


def parse(raw: object) -> tuple[object, Any]:
    """``(request id, typed request)`` from a decoded JSON message, or ProtocolError.

    The id is returned even when the rest is bad, so that the error reply can carry it."""
    if not isinstance(raw, dict):
        raise ProtocolError("bad_request", "a message must be a JSON object")
    rid = raw.get("id")
    kind = raw.get("type")
    if kind is None:
        raise ProtocolError("bad_request", "missing field 'type'")
    cls = REQUESTS.get(kind) if isinstance(kind, str) else None
    if cls is None:
        known = ", ".join(REQUESTS)
        raise ProtocolError("unknown_type", f"unknown message type {kind!r} (known: {known})")
    hints = typing.get_type_hints(cls)
    values = {}
    for f in fields(cls):
        if f.name not in raw:
            if f.default is MISSING and f.default_factory is MISSING:
                raise ProtocolError("bad_request", f"{kind}: missing field '{f.name}'")
            continue
        if not _is(raw[f.name], hints[f.name]):
            raise ProtocolError(
                "bad_request", f"{kind}: field '{f.name}' must be {_describe(hints[f.name])}"
            )
        values[f.name] = raw[f.name]
    return rid, cls(**values)


def _is(value: object, tp: Any) -> bool:
    origin = typing.get_origin(tp)
    if origin in (types.UnionType, typing.Union):
        return any(_is(value, a) for a in typing.get_args(tp))
    if origin is list:
        (item,) = typing.get_args(tp)
        return isinstance(value, list) and all(_is(v, item) for v in value)
    if tp is type(None):
        return value is None
    if tp is int:
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(value, tp)


def _describe(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin in (types.UnionType, typing.Union):
        return " or ".join(_describe(a) for a in typing.get_args(tp))
    if origin is list:
        return "a list of " + {str: "strings", int: "integers"}[typing.get_args(tp)[0]]
    names = {str: "a string", int: "an integer", bool: "true or false", type(None): "null"}
    return names[tp]
