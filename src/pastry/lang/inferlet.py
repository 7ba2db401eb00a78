"""The inferlet side of a program shipped from a client (:mod:`pastry.lang.ship`).

The launch argument is one JSON object: ``function`` (its name in the shipped module),
``arguments``, ``sampling`` (the run's default sampling parameters), ``stream`` and
``adapter`` (a LoRA adapter's name, or null); bytes among the arguments (an image's)
travel as ``{"__pastry_bytes__": base64}`` (:func:`encode_arguments`). With
``stream``, every piece of the program's text is sent as a message ``{"text": piece}`` as
it is produced. The result is ``{"text", "variables", "meta_info", "messages"}`` as JSON.
"""

from __future__ import annotations

import base64
import json
from typing import Any

from pastry.lang.function import Function, plain

BYTES = "__pastry_bytes__"


def encode_arguments(value: Any) -> Any:
    """``value`` with every ``bytes`` in it made JSON (:data:`BYTES`)."""
    if isinstance(value, bytes | bytearray | memoryview):
        return {BYTES: base64.b64encode(bytes(value)).decode()}
    if isinstance(value, dict):
        return {k: encode_arguments(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [encode_arguments(v) for v in value]
    return value


def decode_arguments(value: Any) -> Any:
    """The inverse of :func:`encode_arguments` (tuples come back as lists, as JSON's)."""
    if isinstance(value, dict):
        if len(value) == 1 and BYTES in value:
            return base64.b64decode(value[BYTES])
        return {k: decode_arguments(v) for k, v in value.items()}
    if isinstance(value, list):
        return [decode_arguments(v) for v in value]
    return value


async def serve(namespace: dict[str, Any], args: list[str]) -> str:
    if len(args) != 1:
        raise ValueError("a shipped pastry.lang program takes one JSON argument")
    req = json.loads(args[0])
    fn = namespace.get(req["function"])
    if not isinstance(fn, Function):
        raise ValueError(f"no pastry.lang function {req['function']!r} in this program")
    on_text = None
    if req.get("stream"):
        import pastry.sdk as px

        def on_text(piece: str) -> None:
            px.send(json.dumps({"text": piece}))

    state = await fn.arun(
        on_text=on_text,
        adapter=req.get("adapter"),
        **req.get("sampling", {}),
        **decode_arguments(req.get("arguments", {})),
    )
    s = state.stream
    return json.dumps(
        {
            "text": s.text,
            "variables": plain(s.variables),
            "meta_info": plain(s.meta_info),
            "messages": [{"role": r, "content": c} for r, c in s.messages],
        }
    )
