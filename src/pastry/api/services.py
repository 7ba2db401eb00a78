"""Requests the host answers without the model: grammar constraints, messaging, the
key-value store and HTTP."""

from __future__ import annotations

from collections.abc import Sequence

from pastry.api.table import request
from pastry.api.types import Bitmask, Count, Handle, Token

# ---------------------------------------------------------------------------- grammar constraints


@request("grammar constraints", now=Handle)
class CreateConstraint:
    """A grammar constraint for one output on the queue's model, held by the host
    (immediate). ``grammar`` is JSON text: ``{"json_schema": {...}}``, ``{"regex":
    "..."}`` or ``{"lark": "..."}``. Pass the handle as ``Sampling.constraint``; free it
    when done: an instance may hold a limited number at once. JSON schemas give compact
    JSON (no optional whitespace) unless the schema's ``"x-guidance"`` asks otherwise."""

    q: Handle
    grammar: str


@request("grammar constraints", now=tuple[bool, bool, list[Token]])
class ConstraintState:
    """(complete: the output so far is a word of the grammar; stopped: nothing but
    end-of-sequence may follow; the tokens the grammar forces next, possibly none)."""

    c: Handle


@request("grammar constraints")
class ConstraintConsume:
    """Advance the grammar with ``tokens`` appended without sampling (forced ones, say);
    a token the grammar does not allow is an error."""

    c: Handle
    tokens: Sequence[Token]


@request("grammar constraints", now=Bitmask)
class ConstraintMask:
    """The tokens the grammar allows next as a packed bitmask (``Sampling.mask``'s format,
    one bit per output row)."""

    c: Handle


@request("grammar constraints")
class FreeConstraint:
    """Free a constraint (its handle is gone)."""

    c: Handle


# ---------------------------------------------------------------------------- messaging


@request("messaging", now=Count)
class Broadcast:
    """Deliver ``message`` to the subscribers of ``topic`` (this user's; another's is
    ``~OWNER/TOPIC``, which only ``subscribe`` may name); returns how many."""

    topic: str
    message: str


@request("messaging", now=Handle)
class Subscribe:
    """A subscription to ``topic``'s broadcasts."""

    topic: str


@request("messaging", queued=("text",))
class NextMessage:
    """The next message broadcast to the subscription."""

    sub: Handle


@request("messaging")
class Unsubscribe:
    """End a subscription."""

    sub: Handle


# ---------------------------------------------------------------------------- key-value store
# This user's keys; ``~OWNER/KEY`` reads another user's where granted (else it reads as
# unset), and is never written.


@request("key-value store", now=str | None, fallible=False)
class StoreGet:
    """The value of ``key`` (None: unset)."""

    key: str


@request("key-value store")
class StoreSet:
    """Set ``key`` to ``value`` (in this user's namespace)."""

    key: str
    value: str


@request("key-value store", now=bool, fallible=False)
class StoreDelete:
    """Delete ``key``; whether it existed."""

    key: str


@request("key-value store", now=bool, fallible=False)
class StoreExists:
    """Whether ``key`` is set."""

    key: str


@request("key-value store", now=list[str], fallible=False)
class StoreListKeys:
    """This user's keys starting with ``prefix``; for ``~OWNER/PREFIX``, the owner's
    (where granted), named as the caller reads them (``~OWNER/KEY``)."""

    prefix: str = ""


# ---------------------------------------------------------------------------- http


@request("http", queued=("http",), fallible=False)
class HttpGet:
    """GET an allowlisted URL: (status, body text)."""

    url: str


@request("http", queued=("http",), fallible=False)
class HttpPost:
    """POST ``body`` to an allowlisted URL: (status, body text)."""

    url: str
    body: str


# ---------------------------------------------------------------------------- mcp
# Tools of the Model Context Protocol servers the operator registered (``control/mcp.py``):
# the host holds the connections; an inferlet names a server. A server that is not
# registered, or not this user's, is an error, as is one that cannot be reached.


@request("mcp", now=list[str], fallible=False)
class McpListServers:
    """The MCP servers this user may use, by name."""


@request("mcp", queued=("text",))
class McpListTools:
    """The server's tools, as JSON: ``[{"name", "description", "input_schema"}]``."""

    server: str


@request("mcp", queued=("text",))
class McpCallTool:
    """Call ``tool`` with ``arguments`` (a JSON object as text); the result as JSON:
    ``{"text": its text content, "is_error": bool, "structured": JSON or null}``. A tool
    that fails answers ``is_error`` true (not an error of the call)."""

    server: str
    tool: str
    arguments: str


@request("mcp", queued=("text",))
class McpListResources:
    """The server's resources, as JSON: ``[{"uri", "name", "description", "mime_type"}]``."""

    server: str


@request("mcp", queued=("text",))
class McpReadResource:
    """The text of the resource ``uri`` (its text contents, joined)."""

    server: str
    uri: str
