"""Handlers of the shared services: messaging, the key-value store, HTTP, MCP.

Another user's namespace without a grant reads as empty and cannot be deleted from (these
calls have no error result in the WIT); ``store_set`` says why it is refused.
"""

from __future__ import annotations

from pastry import api
from pastry.api import ApiError
from pastry.control.handlers.caller import Caller
from pastry.control.handlers.registry import handles
from pastry.control.users import split_scoped


@handles(api.Broadcast)
def broadcast(s: Caller, r: api.Broadcast) -> int:
    owner, topic = s.scoped(r.topic, write=True)
    return s.controller.bus.broadcast(str(s.instance), topic, r.message, owner)


@handles(api.Subscribe)
def subscribe(s: Caller, r: api.Subscribe) -> int:
    owner, topic = s.scoped(r.topic, write=False)
    sub = s.controller.bus.subscribe(str(s.instance), topic, owner)
    sid = s.new_handle()
    s.subscriptions[sid] = sub
    return sid


@handles(api.NextMessage)
def next_message(s: Caller, r: api.NextMessage):
    return s.subscription(r.sub).get()


@handles(api.Unsubscribe)
def unsubscribe(s: Caller, r: api.Unsubscribe) -> None:
    s.subscription(r.sub).close()
    del s.subscriptions[r.sub]


@handles(api.StoreGet)
def store_get(s: Caller, r: api.StoreGet) -> str | None:
    scoped = s.readable(r.key)
    return None if scoped is None else s.controller.store.get(scoped[1], scoped[0])


@handles(api.StoreSet)
def store_set(s: Caller, r: api.StoreSet) -> None:
    owner, key = s.scoped(r.key, write=True)
    s.controller.store.set(key, r.value, instance_id=str(s.instance), user=owner)


@handles(api.StoreDelete)
def store_delete(s: Caller, r: api.StoreDelete) -> bool:
    owner, rest = s.split(r.key)
    return owner == s.user and s.controller.store.delete(rest, owner)


@handles(api.StoreExists)
def store_exists(s: Caller, r: api.StoreExists) -> bool:
    scoped = s.readable(r.key)
    return scoped is not None and s.controller.store.exists(scoped[1], scoped[0])


@handles(api.StoreListKeys)
def store_list_keys(s: Caller, r: api.StoreListKeys) -> list[str]:
    """This user's keys starting with ``prefix``; for ``~OWNER/PREFIX``, the owner's
    (where granted) keys, named as the caller reads them (``~OWNER/KEY``)."""
    prefix = r.prefix
    if not isinstance(prefix, str):
        raise ApiError(f"store_list_keys takes a string prefix, got {type(prefix).__name__}")
    owner, rest = split_scoped(prefix, prefix=True)
    store = s.controller.store
    if owner is None or owner == s.user:
        return store.list_keys(rest, s.user)
    if not s.controller.grants.may_read(s.user, owner):
        return []
    return [f"~{owner}/{k}" for k in store.list_keys(rest, owner)]


@handles(api.HttpGet)
async def http_get(s: Caller, r: api.HttpGet) -> tuple[int, str]:
    resp = await s.controller.http.get(r.url)
    return resp.status, resp.text


@handles(api.HttpPost)
async def http_post(s: Caller, r: api.HttpPost) -> tuple[int, str]:
    resp = await s.controller.http.post(r.url, r.body)
    return resp.status, resp.text


@handles(api.McpListServers)
def mcp_list_servers(s: Caller, r: api.McpListServers) -> list[str]:
    return s.controller.mcp.names(s.user)


@handles(api.McpListTools)
async def mcp_list_tools(s: Caller, r: api.McpListTools) -> str:
    return await _mcp(s.controller.mcp.list_tools(s.user, r.server))


@handles(api.McpCallTool)
async def mcp_call_tool(s: Caller, r: api.McpCallTool) -> str:
    return await _mcp(s.controller.mcp.call_tool(s.user, r.server, r.tool, r.arguments))


@handles(api.McpListResources)
async def mcp_list_resources(s: Caller, r: api.McpListResources) -> str:
    return await _mcp(s.controller.mcp.list_resources(s.user, r.server))


@handles(api.McpReadResource)
async def mcp_read_resource(s: Caller, r: api.McpReadResource) -> str:
    return await _mcp(s.controller.mcp.read_resource(s.user, r.server, r.uri))


async def _mcp(call) -> str:
    """An MCP request's answer; what went wrong as an ApiError the inferlet can read."""
    try:
        return await call
    except (PermissionError, RuntimeError, ValueError) as e:
        raise ApiError(str(e)) from None
