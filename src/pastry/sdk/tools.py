"""Tools for agents: OpenAI-style function schemas bound to an HTTP endpoint or to a tool
of an MCP server, the grammar that makes a model write a well-formed call, a tolerant
parser for calls written without one, and running a call.

A tool is given as the ``tools`` entries of OpenAI's chat API, plus where it runs::

    {"type": "function",
     "function": {"name": "get_weather", "description": "...",
                  "parameters": {"type": "object", "properties": {...}, "required": [...]}},
     "http": {"url": "http://127.0.0.1:8000/weather", "method": "POST"}}   # or "GET"
    {"type": "function", "function": {...}, "mcp": {"server": "files", "tool": "read"}}
    {"mcp": {"server": "files"}}          # every tool the MCP server lists

An HTTP tool receives its arguments as a JSON body (``POST``) or as the query string
(``GET``); the URL must be on the server's allowlist (``pastry serve --http-allow``). An MCP
tool runs on a server the operator registered (``docs/inferlets.md``, "MCP"). The response
text (or the MCP result's text) is the observation; an HTTP status outside 2xx or an MCP
error result is an observation too, marked not ``ok``, so the agent can react to it.

:func:`action_grammar` is a Lark grammar (llguidance's dialect, ``%json`` for the
arguments) of one ReAct action: ``Action: <a tool's name>\\nAction Input: <JSON valid for
that tool's schema>\\n`` or ``Final Answer:``, so that even a small model's call parses.
:func:`parse_action` reads the same format from free text, tolerantly (what a client-side
agent, or a model without the grammar, writes).
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlencode

from pastry.sdk.current import api

ACTION = "Action: "
ACTION_INPUT = "\nAction Input: "
FINAL = "Final Answer:"
OBSERVATION = "Observation: "


@dataclass(frozen=True)
class Tool:
    """One tool: its OpenAI function schema and where it runs (``url`` or ``mcp_server``)."""

    name: str
    description: str = ""
    parameters: Mapping[str, Any] = field(default_factory=lambda: {"type": "object"})
    url: str | None = None
    method: str = "POST"
    mcp_server: str | None = None
    mcp_tool: str | None = None  # its name on the MCP server (default: ``name``)

    @classmethod
    def from_spec(cls, spec: Mapping[str, Any]) -> Tool:
        """A tool from one entry of ``tools`` (see the module docstring)."""
        if not isinstance(spec, Mapping):
            raise ValueError(f"a tool is a JSON object, got {spec!r:.200}")
        fn = spec.get("function", spec)
        name = fn.get("name")
        if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z0-9_.-]{1,64}", name):
            raise ValueError(f"a tool's name is 1-64 letters, digits, _ . or -; got {name!r}")
        params = fn.get("parameters") or {"type": "object", "properties": {}}
        if not isinstance(params, Mapping) or params.get("type", "object") != "object":
            raise ValueError(f"tool {name}: parameters must be a JSON schema of an object")
        http, mcp = spec.get("http"), spec.get("mcp")
        if (http is None) == (mcp is None):
            raise ValueError(
                f'tool {name}: say where it runs, with "http": {{"url": ...}} or '
                f'"mcp": {{"server": ...}} (exactly one)'
            )
        kw: dict[str, Any] = {}
        if http is not None:
            url = http.get("url") if isinstance(http, Mapping) else http
            method = (http.get("method", "POST") if isinstance(http, Mapping) else "POST").upper()
            if not isinstance(url, str) or not url.startswith(("http://", "https://")):
                raise ValueError(f"tool {name}: http.url must be an http(s) URL, got {url!r}")
            if method not in ("GET", "POST"):
                raise ValueError(f"tool {name}: http.method is GET or POST, got {method!r}")
            kw = {"url": url, "method": method}
        else:
            server = mcp.get("server") if isinstance(mcp, Mapping) else None
            if not isinstance(server, str) or not server:
                raise ValueError(f'tool {name}: "mcp" needs {{"server": NAME}}')
            kw = {"mcp_server": server, "mcp_tool": mcp.get("tool") or name}
        return cls(name, str(fn.get("description") or ""), dict(params), **kw)

    def doc(self) -> str:
        """The tool as the prompt describes it: name, description, argument schema."""
        props = self.parameters.get("properties", {})
        return f"{self.name}: {self.description}\n  Action Input: {json.dumps(props)}"

    def schema(self) -> dict[str, Any]:
        """The argument schema the grammar enforces: the given one, closed to unknown
        keys and requiring every property unless it says otherwise."""
        schema = dict(self.parameters)
        props = schema.get("properties", {})
        schema.setdefault("properties", {})
        schema.setdefault("required", list(props))
        schema.setdefault("additionalProperties", False)
        schema.setdefault(  # one line, spaced as people write it
            "x-guidance",
            {"whitespace_flexible": False, "key_separator": ": ", "item_separator": ", "},
        )
        return schema


async def load_tools(specs: Sequence[Mapping[str, Any]]) -> list[Tool]:
    """The tools of ``specs``; an ``{"mcp": {"server": S}}`` entry without ``function``
    stands for every tool server ``S`` lists (asked once, through the host)."""
    if not isinstance(specs, Sequence) or isinstance(specs, str):
        raise ValueError(f'"tools" must be a list of tool objects, got {specs!r:.200}')
    tools: list[Tool] = []
    for spec in specs:
        mcp = spec.get("mcp") if isinstance(spec, Mapping) else None
        if isinstance(mcp, Mapping) and "function" not in spec and "name" not in spec:
            listed = json.loads(await api().mcp_list_tools(str(mcp.get("server"))))
            tools += [
                Tool(
                    t["name"],
                    t.get("description") or "",
                    t.get("input_schema") or {"type": "object"},
                    mcp_server=mcp["server"],
                    mcp_tool=t["name"],
                )
                for t in listed
            ]
        else:
            tools.append(Tool.from_spec(spec))
    names = [t.name for t in tools]
    if len(set(names)) != len(names):
        raise ValueError(f"two tools share a name: {names}")
    return tools


@dataclass(frozen=True)
class Observation:
    text: str
    ok: bool
    seconds: float


async def call_tool(tool: Tool, arguments: Mapping[str, Any], max_chars: int = 2000) -> Observation:
    """Run ``tool`` with ``arguments``; its answer as text (at most ``max_chars``)."""
    a, t0 = api(), time.perf_counter()
    if tool.url is not None:
        if tool.method == "GET":
            sep = "&" if "?" in tool.url else "?"
            query = urlencode({k: _plain(v) for k, v in arguments.items()})
            status, body = await a.http_get(f"{tool.url}{sep}{query}" if query else tool.url)
        else:
            status, body = await a.http_post(tool.url, json.dumps(dict(arguments)))
        ok = 200 <= status < 300
        text = body if ok else f"HTTP {status}: {body}"
    else:
        out = json.loads(
            await a.mcp_call_tool(tool.mcp_server, tool.mcp_tool, json.dumps(arguments))
        )
        ok, text = not out["is_error"], out["text"]
    text = " ".join(text.split())  # one line: the observation ends at the newline
    if len(text) > max_chars:
        text = text[: max_chars - 3] + "..."
    return Observation(text, ok, time.perf_counter() - t0)


def _plain(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value)


def tools_prompt(tools: Sequence[Tool]) -> str:
    """The tools section of a ReAct instruction."""
    return "\n".join(f"- {t.doc()}" for t in tools)


def action_grammar(tools: Sequence[Tool], *, act: bool = True, final: bool = True) -> str:
    """The Lark grammar of one action (see the module docstring): a call of one of
    ``tools`` (``act``) or the start of a final answer (``final``)."""
    if not (act and tools) and not final:
        raise ValueError("an action grammar needs tools to call or a final answer")
    rules, calls = [], []
    for i, t in enumerate(tools if act else ()):
        calls.append(f"call{i}")
        rules.append(
            f"call{i}: {json.dumps(t.name)} {json.dumps(ACTION_INPUT)} args{i} {json.dumps(chr(10))}"
        )
        rules.append(f"args{i}: %json {json.dumps(t.schema())}")
    starts = []
    if calls:
        starts.append(f"{json.dumps(ACTION)} ({' | '.join(calls)})")
    if final:
        starts.append(json.dumps(FINAL))
    return "\n".join([f"start: {' | '.join(starts)}", *rules])


# ------------------------------------------------------------------------- parsing text


@dataclass(frozen=True)
class Action:
    """A call as written: the tool's name, its arguments (None: they did not parse), and
    why they did not."""

    tool: str
    arguments: dict[str, Any] | None
    error: str | None = None


@dataclass(frozen=True)
class FinalAnswer:
    answer: str


_ACTION_RE = re.compile(r"Action\s*:\s*[`\"']?([A-Za-z0-9_.-]+)[`\"']?", re.I)
_INPUT_RE = re.compile(r"Action\s*Input\s*:\s*", re.I)
_FINAL_RE = re.compile(r"Final\s*Answer\s*:\s*", re.I)


def parse_action(text: str, tools: Sequence[Tool] = ()) -> Action | FinalAnswer | None:
    """The first action or final answer in ``text``, read tolerantly: any case and
    spacing, a quoted tool name matched case-insensitively to ``tools``, arguments as the
    first JSON object after ``Action Input:`` (single quotes and trailing commas forgiven;
    a bare value for a tool of one parameter). None when there is neither."""
    action, final = _ACTION_RE.search(text), _FINAL_RE.search(text)
    if final and (not action or final.start() < action.start()):
        return FinalAnswer(text[final.end() :].split("\n")[0].strip())
    if not action:
        return None
    name = action.group(1)
    tool = next((t for t in tools if t.name.lower() == name.lower()), None)
    if tool is not None:
        name = tool.name
    elif tools:
        return Action(name, None, f"no tool named {name!r}; tools: {[t.name for t in tools]}")
    rest = text[action.end() :]
    inp = _INPUT_RE.search(rest)
    if not inp:
        return Action(name, None, "no 'Action Input:' after the action")
    args, error = _json_object(rest[inp.end() :], tool)
    return Action(name, args, error)


def _json_object(text: str, tool: Tool | None) -> tuple[dict | None, str | None]:
    start = text.find("{")
    if start < 0:
        value = text.split("\n")[0].strip().strip("`\"'")
        props = list((tool.parameters.get("properties") or {}) if tool else {})
        if len(props) == 1 and value:
            return {props[0]: value}, None
        return None, f"Action Input is not a JSON object: {value!r:.80}"
    depth, end, quote = 0, -1, None
    for i, ch in enumerate(text[start:], start):
        if quote:
            quote = None if ch == quote and text[i - 1] != "\\" else quote
        elif ch in "\"'":
            quote = ch
        elif ch == "{":
            depth += 1
        elif ch == "}":
            depth -= 1
            if depth == 0:
                end = i + 1
                break
    raw = text[start:end] if end > 0 else text[start:].split("\n")[0]
    for candidate in (raw, _forgiving(raw)):
        try:
            value = json.loads(candidate)
        except ValueError:
            continue
        if isinstance(value, dict):
            return value, None
    return None, f"Action Input is not valid JSON: {raw!r:.80}"


def _forgiving(raw: str) -> str:
    fixed = re.sub(r"'([^']*)'", lambda m: json.dumps(m.group(1)), raw)
    fixed = re.sub(r",\s*([}\]])", r"\1", fixed)
    return fixed + "}" * max(0, fixed.count("{") - fixed.count("}"))
