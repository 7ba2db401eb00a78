"""Tool calling for the OpenAI chat endpoint: tool definitions, the grammars that force a
call, and the parsers that read calls out of a model's own output.

- ``tool_choice`` ``"required"`` or a named function: the output is constrained by a JSON
  schema (:func:`required_schema`, :func:`named_schema`), as vLLM does, and every output is
  a valid call.
- ``"auto"``: the model writes free text, in which a :class:`ToolCallFormat` finds the
  calls in the model's own format. :class:`HermesFormat` (``<tool_call>{"name": ...,
  "arguments": {...}}</tool_call>``, the format of Qwen2.5's and SmolLM2's chat templates)
  is the default; another model family is another object with the same two methods.
- A chat template that does not render ``tools`` gets the format's instructions as a
  system message, so the model still learns which tools exist and how to call them.
"""

from __future__ import annotations

import contextlib
import json
import re
import uuid
from dataclasses import dataclass
from typing import Any, Protocol


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # JSON text
    id: str = ""

    def to_openai(self, index: int | None = None) -> dict:
        body = {
            "id": self.id or new_call_id(),
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }
        return body if index is None else {"index": index, **body}


def new_call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


class ToolCallFormat(Protocol):
    """How one model family writes tool calls in plain output (swappable)."""

    def instructions(self, tools: list[dict]) -> str:
        """A system prompt that lists ``tools`` (OpenAI function objects) and says how to
        call them, for chat templates that do not render tools themselves."""

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """The content (None when only calls) and the calls found in a whole output."""

    def stream(self) -> ToolStream:
        """A parser for the same output arriving in pieces."""


class ToolStream(Protocol):
    def feed(self, delta: str) -> tuple[str, list[ToolCall]]:
        """Content that can be shown now, and calls completed by ``delta``."""

    def close(self) -> str:
        """What is left at the end (an unfinished call is shown as content)."""


class HermesFormat:
    """``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`` blocks."""

    OPEN, CLOSE = "<tool_call>", "</tool_call>"
    _BLOCK = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)

    def instructions(self, tools: list[dict]) -> str:
        listed = "\n".join(json.dumps(t) for t in tools)
        return (
            "You may call one or more functions to assist with the user query.\n\n"
            "You are provided with function signatures within <tools></tools> XML tags:\n"
            f"<tools>\n{listed}\n</tools>\n\n"
            "For each function call, return a json object with function name and arguments "
            "within <tool_call></tool_call> XML tags:\n"
            '<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n'
            "</tool_call>"
        )

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        calls = []
        for body in self._BLOCK.findall(text):
            call = self._call(body)
            if call is None:
                return text, []  # not valid calls: the text is the answer
            calls.append(call)
        if not calls:
            return text, []
        content = text[: text.find(self.OPEN)].strip()
        return content or None, calls

    @staticmethod
    def _call(body: str) -> ToolCall | None:
        try:
            obj = json.loads(body)
        except ValueError:
            return None
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            return None
        args = obj.get("arguments", obj.get("parameters", {}))
        if isinstance(args, str):
            try:
                json.loads(args)
            except ValueError:
                return None
            return ToolCall(obj["name"], args, new_call_id())
        return ToolCall(obj["name"], json.dumps(args), new_call_id())

    def stream(self) -> HermesStream:
        return HermesStream(self)


class HermesStream:
    """Shows content until a ``<tool_call>`` starts (holding back a possible start), then
    emits each call once its block closes."""

    def __init__(self, fmt: HermesFormat) -> None:
        self.fmt = fmt
        self.buf = ""
        self.in_calls = False

    def feed(self, delta: str) -> tuple[str, list[ToolCall]]:
        self.buf += delta
        shown, calls = "", []
        if not self.in_calls:
            at = self.buf.find(self.fmt.OPEN)
            if at < 0:
                keep = _partial_suffix(self.buf, self.fmt.OPEN)
                shown, self.buf = self.buf[: len(self.buf) - keep], self.buf[len(self.buf) - keep :]
                return shown, []
            shown, self.buf, self.in_calls = self.buf[:at], self.buf[at:], True
        while (end := self.buf.find(self.fmt.CLOSE)) >= 0:
            block, self.buf = (
                self.buf[: end + len(self.fmt.CLOSE)],
                self.buf[end + len(self.fmt.CLOSE) :],
            )
            _, found = self.fmt.parse(block)
            calls += found
        return shown, calls

    def close(self) -> str:
        rest, self.buf = self.buf, ""
        return rest if not rest.isspace() else ""


def _partial_suffix(text: str, marker: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``marker``."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:n]):
            return n
    return 0


# ---------------------------------------------------------------------- forced calls


def required_schema(tools: list[dict], parallel: bool) -> dict:
    """vLLM's schema for ``tool_choice: "required"``: a non-empty array of
    ``{"name", "parameters"}`` objects, one of the tools each (one item unless parallel).
    ``tools`` as :func:`check_tools` leaves them (a strict tool's schema closed)."""
    items = {
        "anyOf": [
            {
                "type": "object",
                "properties": {
                    "name": {"type": "string", "enum": [t["function"]["name"]]},
                    "parameters": named_schema(t),
                },
                "required": ["name", "parameters"],
                "additionalProperties": False,
            }
            for t in tools
        ]
    }
    schema: dict[str, Any] = {"type": "array", "items": items, "minItems": 1}
    if not parallel:
        schema["maxItems"] = 1
    return schema


def parse_required(text: str) -> list[ToolCall]:
    """The complete calls of an output constrained by :func:`required_schema`, also when it
    was cut short (by ``max_tokens``): a call still being written is left out."""
    reader = RequiredCalls()
    reader.feed(text)
    return reader.calls


class RequiredCalls:
    """Reads the JSON array of :func:`required_schema` as it arrives: each call once its
    object has closed (a JSON scanner over strings, escapes and nesting). A call equal to
    an earlier one (name and arguments) is not a new call: the ``chat`` inferlet ends the
    array there (``stop_repeated_item``), and it is left out."""

    def __init__(self) -> None:
        self.calls: list[ToolCall] = []
        self.closed = False  # the array has ended
        self._depth = 0
        self._string = self._escape = False
        self._item: list[str] = []  # the text of the call being read

    def feed(self, delta: str) -> list[ToolCall]:
        """The calls ``delta`` completes."""
        done: list[ToolCall] = []
        for ch in delta:
            if self.closed:
                break
            if self._depth >= 2:
                self._item.append(ch)
            if self._string:
                if self._escape:
                    self._escape = False
                elif ch == "\\":
                    self._escape = True
                elif ch == '"':
                    self._string = False
            elif ch == '"':
                self._string = True
            elif ch in "[{":
                self._depth += 1
                if self._depth == 2:
                    self._item = [ch]
            elif ch in "]}":
                self._depth -= 1
                if self._depth == 1:
                    call = self._call("".join(self._item))
                    if all((c.name, c.arguments) != (call.name, call.arguments) for c in self.calls):  # fmt: skip
                        self.calls.append(call)
                        done.append(call)
                elif self._depth == 0:
                    self.closed = True
        return done

    @staticmethod
    def _call(item: str) -> ToolCall:
        obj = json.loads(item)
        return ToolCall(obj["name"], json.dumps(obj["parameters"]), new_call_id())


def named_schema(tool: dict) -> dict:
    """The arguments schema of a forced call: the function's, closed (no property the
    schema does not name, unless it says so), strict or not, as vLLM's default grammar
    backend (xgrammar's strict mode) does: a small model otherwise invents arguments."""
    return closed_schema(tool["function"].get("parameters") or {"type": "object"})


def closed_schema(schema: Any) -> Any:
    """``schema`` with ``"additionalProperties": false`` on every object that does not say
    otherwise: what ``strict`` means (OpenAI's structured outputs; JSON Schema itself
    admits any property a schema does not name)."""
    if isinstance(schema, list):
        return [closed_schema(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {}
    for key, value in schema.items():
        if key in ("properties", "patternProperties", "$defs", "definitions"):
            out[key] = (
                {k: closed_schema(v) for k, v in value.items()}
                if isinstance(value, dict)
                else value
            )
        elif key in (
            "items",
            "prefixItems",
            "anyOf",
            "oneOf",
            "allOf",
            "not",
            "additionalProperties",
            "if",
            "then",
            "else",
            "contains",
        ):
            out[key] = closed_schema(value)
        else:
            out[key] = value
    is_object = (
        out.get("type") == "object"
        or (isinstance(out.get("type"), list) and "object" in out["type"])
        or "properties" in out
    )
    if is_object and "additionalProperties" not in out:
        out["additionalProperties"] = False
    return out


# ---------------------------------------------------------------------- the prompt


def template_messages(messages: list[dict]) -> list[dict]:
    """Messages as chat templates expect them: a tool call's ``arguments`` as an object
    (templates render it with ``tojson``), the rest as given."""
    out = []
    for m in messages:
        calls = m.get("tool_calls")
        if calls:
            m = {**m, "tool_calls": [_template_call(c) for c in calls]}
        out.append(m)
    return out


def _template_call(call: dict) -> dict:
    fn = dict(call.get("function") or {})
    args = fn.get("arguments")
    if isinstance(args, str):
        with contextlib.suppress(ValueError):
            fn["arguments"] = json.loads(args)
    return {**call, "function": fn}


def inline_tools(messages: list[dict], tools: list[dict], fmt: ToolCallFormat) -> list[dict]:
    """For a template that does not render tools: the format's instructions in the system
    message, assistant tool calls and tool results written out as text."""
    out = []
    for m in messages:
        content = m.get("content") or ""
        if m.get("tool_calls"):
            calls = [_template_call(c)["function"] for c in m["tool_calls"]]
            written = "\n".join(
                f"<tool_call>\n{json.dumps({'name': c.get('name'), 'arguments': c.get('arguments')})}\n</tool_call>"
                for c in calls
            )
            content = f"{content}\n{written}".strip()
        role = m["role"]
        if role == "tool":  # as a user turn: templates without tools know no tool role
            role, content = "user", f"<tool_response>\n{content}\n</tool_response>"
        out.append({"role": role, "content": content})
    text = fmt.instructions(tools)
    if out and out[0]["role"] == "system":
        out[0] = {"role": "system", "content": f"{out[0]['content']}\n\n{text}"}
    else:
        out.insert(0, {"role": "system", "content": text})
    return out
