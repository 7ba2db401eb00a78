"""The wire protocol between an engine client (:mod:`pastry.engine.remote`) and server
(:mod:`pastry.engine.serve`), over ZeroMQ DEALER (client) -> ROUTER (server).

Every message is a list of frames:

- request: ``[msgpack([op, request_id]), *payload]`` with ``op`` an :class:`Op`;
  the payload of ``EXECUTE`` is :func:`~pastry.engine.codec.encode_batch`, others have none.
- reply: ``[msgpack([status, request_id, error_text | None]), *payload]``; the payload of
  ``INFO`` is :func:`~pastry.engine.codec.encode_info`, of ``EXECUTE``
  :func:`~pastry.engine.codec.encode_results`.

The payloads are :mod:`pastry.engine.codec`'s; this module owns only the headers.
"""

from __future__ import annotations

from collections.abc import Sequence
from enum import IntEnum
from typing import Any

import msgpack

from pastry.engine.codec import CodecError, Frames


class Op(IntEnum):
    INFO = 1
    EXECUTE = 2
    PING = 3
    SHUTDOWN = 4
    LOAD_ADAPTER = 5  # payload: msgpack [name, PEFT directory]; replies the new info
    UNLOAD_ADAPTER = 6  # payload: msgpack [name]; replies the new info


class Status(IntEnum):
    OK = 0
    ERROR = 1


OPS = frozenset(o.value for o in Op)


def request(op: Op, req_id: int, payload: Sequence[Any] = ()) -> Frames:
    """The frames of one request."""
    return [msgpack.packb([op, req_id]), *payload]


def reply(
    status: Status, req_id: int | None, message: str | None, payload: Sequence[Any] = ()
) -> Frames:
    """The frames of one reply (``message`` is the error text of an ``ERROR``)."""
    return [msgpack.packb([status, req_id, message]), *payload]


def parse_header(frame: Any, size: int) -> list:
    """``[op, request_id]`` (size 2) or ``[status, request_id, message]`` (size 3);
    :class:`CodecError` if the frame is not one."""
    try:
        header = msgpack.unpackb(frame, raw=False)
    except (ValueError, TypeError, msgpack.UnpackException) as e:
        raise CodecError(f"header is not valid msgpack ({e})") from e
    if type(header) is not list or len(header) != size or type(header[1]) is not int:
        raise CodecError(f"header must be a list of {size} with an int request id")
    return header


def strings(frame: Any, n: int) -> list[str]:
    """A payload frame of ``n`` strings (msgpack); :class:`CodecError` if it is not one."""
    try:
        value = msgpack.unpackb(frame, raw=False)
    except (ValueError, TypeError, msgpack.UnpackException) as e:
        raise CodecError(f"payload is not valid msgpack ({e})") from e
    if type(value) is not list or len(value) != n or not all(type(v) is str for v in value):
        raise CodecError(f"payload must be a list of {n} strings")
    return value


def no_payload(frames: Frames) -> None:
    """Decoder of the replies that carry nothing (``PING``, ``SHUTDOWN``)."""
    if frames:
        raise CodecError(f"expected no payload, got {len(frames)} frame(s)")
