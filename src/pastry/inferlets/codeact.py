"""CodeAct (Wang et al. 2024): an agent whose actions are Python programs the model
writes, run inside the inferlet by a restricted interpreter, their output fed back into
the same context (Pie §7.1).

Each step the line the model starts is chosen under a grammar: a code block
(```` ```python ````) or ``Final Answer:``. A code block is free text up to the closing
```` ``` ```` (or ``code_tokens``); it runs in :class:`pastry.sdk.interpreter.Interpreter`
(a tree-walking interpreter of a Python subset: no imports but ``math``, no files, no
attribute access but the pure methods of built-in values, limits on steps, seconds,
sizes and output; variables persist between steps), and what it printed — or the error
that stopped it, as a traceback's last line — is appended as ``Output:``; the model goes
on from there (after an error it usually writes the code again). The declared tools
(:mod:`pastry.sdk.tools`: OpenAI function schemas bound to HTTP or MCP) are functions of
the program: ``weather(city="Paris")`` returns the tool's text; nothing else leaves the
interpreter. The KV cache is kept across steps: only new tokens are forwarded.

It ends at the final answer (``"stop": "final_answer"``) or when the transcript reaches
``max_tokens``; the first step is a program (unless ``require_code`` is false), and after
``max_steps`` of them, or one that repeats an earlier program or its output (no progress),
only the final answer is allowed.

Args (one JSON object)::

    {"question": "..." (or "messages"), "tools": [...], "system": null,
     "max_steps": 4, "require_code": true (the first step is a program), "code_tokens": 256, "answer_tokens": 64, "max_tokens": 4096,
     "limits": {"steps": 200000, "seconds": 5.0, ...} (pastry.sdk.interp_values.Limits),
     "temperature": 0.0, "seed": null, "model": null}

Result (JSON)::

    {"answer": "..." or null, "stop": ..., "steps": [{"code", "output", "error"}],
     "variables": [names the programs defined], "text": ..., "tokens": ...,
     "cached_tokens": ...}
"""

from __future__ import annotations

import json
from typing import Any

import pastry.sdk as px
from pastry.sdk import Context, EosTokens, MaxTokens, Sampler, StopStrings
from pastry.sdk.args import options
from pastry.sdk.grammar import Constraint, generate
from pastry.sdk.interpreter import Interpreter, Limits
from pastry.sdk.steps import truncate
from pastry.sdk.tools import FINAL, Tool, call_tool, load_tools

CODE = "```python\n"
SYSTEM = (
    "You solve the user's task by writing Python code. Write each program in a block "
    "that starts with ```python and ends with ```; print what you want to see. Its "
    "output is shown to you after 'Output:'. If it fails, fix the code and try again. "
    "{tools}As soon as the output answers the task, write: Final Answer: the answer"
)
TOOLS = "Your code can call these functions, which return text:\n{}\n"

DEFAULTS: dict[str, Any] = {
    "question": None,
    "messages": None,
    "tools": [],
    "system": None,
    "max_steps": 4,
    "require_code": True,
    "code_tokens": 256,
    "answer_tokens": 64,
    "max_tokens": 4096,
    "limits": {},
    "temperature": 0.0,
    "seed": None,
    "model": None,
}


class CodeAgent:
    def __init__(self, ctx: Context, tools: list[Tool], opts: dict[str, Any]) -> None:
        self.ctx, self.opts = ctx, opts
        self.repeated = False  # the last program or its output repeats an earlier one
        self.sampler = Sampler(temperature=opts["temperature"], seed=opts["seed"])
        functions = {t.name: _tool_function(t) for t in tools}
        self.interp = Interpreter(functions, Limits(**opts["limits"]))
        self.start = len(ctx.tokens)
        self.steps: list[dict[str, Any]] = []

    async def run(self) -> dict[str, Any]:
        while True:
            code_allowed = len(self.steps) < self.opts["max_steps"] and not self.repeated
            code_first = self.opts["require_code"] and not self.steps
            starts = [CODE] if code_first else [CODE, FINAL] if code_allowed else [FINAL]
            grammar = "start: " + " | ".join(json.dumps(s) for s in starts)
            chosen = await self.constrained(grammar)
            if chosen is None:
                return self.result(None, "max_tokens")
            if chosen == FINAL:
                got = await self.free(self.opts["answer_tokens"], "\n")
                answer = None if got is None else got[0].strip()
                return self.result(answer, "final_answer" if got else "max_tokens")
            got = await self.free(self.opts["code_tokens"], "```")
            if got is None:
                return self.result(None, "max_tokens")
            code, written = got
            outcome = await self.interp.run(code)
            shown = (outcome.output + (outcome.error or "")).strip() or "(nothing printed)"
            close = "" if "```" in written else "\n```"  # the model's own fence, else ours
            newline = "" if (written + close).endswith("\n") else "\n"
            self.ctx.fill(f"{close}{newline}Output:\n{shown}\n", add_special_tokens=False)
            self.repeated = any(
                s["code"] == code or s["output"] in (outcome.output, code + "\n", code)
                for s in self.steps
            )
            self.steps.append({"code": code, "output": outcome.output, "error": outcome.error})

    async def constrained(self, grammar: str) -> str | None:
        if self.budget(16) < 16:
            return None
        n0 = len(self.ctx.tokens)
        with Constraint(self.ctx, grammar) as c:
            await generate(self.ctx, c, 16, self.opts["temperature"], self.opts["seed"])
        return px.detokenize(self.ctx.queue, self.ctx.tokens[n0:])

    async def free(self, n: int, until: str) -> tuple[str, str] | None:
        """Free text up to ``until`` (which stays in the context) or ``n`` tokens: (the
        text before ``until``, all that was written); None when the transcript is out of
        tokens first."""
        budget = self.budget(n)
        if budget < 1:
            return None
        n0, eos = len(self.ctx.tokens), self.ctx.eos_ids
        stop = MaxTokens(budget) | EosTokens(eos) | StopStrings([until])
        text = await self.ctx.generate(self.sampler, stop)
        if self.ctx.tokens[-1] in eos:  # not kept: what follows is the agent's
            await truncate(self.ctx, len(self.ctx.tokens) - 1)
        written = px.detokenize(self.ctx.queue, self.ctx.tokens[n0:])
        if until not in written and budget < n:
            return None
        return text, written

    def budget(self, want: int) -> int:
        return min(want, self.opts["max_tokens"] - len(self.ctx.tokens))

    def result(self, answer: str | None, stop: str) -> dict[str, Any]:
        ctx = self.ctx
        return {
            "answer": answer,
            "stop": stop,
            "steps": self.steps,
            "variables": sorted(self.interp.globals),
            "text": px.detokenize(ctx.queue, ctx.tokens[self.start :]),
            "tokens": len(ctx.tokens),
            "cached_tokens": ctx.cached_tokens,
        }


def _tool_function(tool: Tool):
    names = list(tool.parameters.get("properties", {}))

    async def run(*args: Any, **kwargs: Any) -> str:
        if len(args) > len(names):
            raise TypeError(f"{tool.name}() takes {len(names)} arguments ({', '.join(names)})")
        arguments = {**dict(zip(names, args, strict=False)), **kwargs}
        return (await call_tool(tool, arguments)).text

    return run


async def main(args: list[str]) -> str:
    opts = _options(args)
    tools = await load_tools(opts["tools"])
    ctx = Context(opts["model"])
    docs = TOOLS.format("\n".join(f"- {_signature(t)}" for t in tools)) if tools else ""
    system = (opts["system"] or SYSTEM).replace("{tools}", docs)
    if opts["messages"] is not None:
        messages = [(m["role"], m["content"]) for m in opts["messages"]]
        if not messages or messages[0][0] != "system":
            messages.insert(0, ("system", system))
    else:
        messages = [("system", system), ("user", opts["question"])]
    ctx.fill(px.apply_chat_template(ctx.queue, messages), add_special_tokens=False)
    try:
        return json.dumps(await CodeAgent(ctx, tools, opts).run())
    finally:
        await ctx.release()


def _signature(tool: Tool) -> str:
    params = ", ".join(tool.parameters.get("properties", {}))
    return f"{tool.name}({params}): {tool.description}"


def _options(args: list[str]) -> dict[str, Any]:
    opts = options(args, DEFAULTS, prompt_keys=())
    if opts["messages"] is None and not (isinstance(opts["question"], str) and opts["question"]):
        raise ValueError('give the task as "question" (text) or "messages"')
    for key in ("code_tokens", "answer_tokens", "max_tokens"):
        if not isinstance(opts[key], int) or opts[key] < 1:
            raise ValueError(f'"{key}" must be a positive integer, got {opts[key]!r}')
    if not isinstance(opts["max_steps"], int) or opts["max_steps"] < 0:
        raise ValueError(f'"max_steps" must be a non-negative integer, got {opts["max_steps"]!r}')
    if not isinstance(opts["limits"], dict) or set(opts["limits"]) - set(Limits.__annotations__):
        raise ValueError(
            f'"limits" takes {", ".join(Limits.__annotations__)}; got {opts["limits"]!r}'
        )
    return opts
