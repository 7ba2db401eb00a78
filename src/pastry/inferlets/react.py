"""ReAct (Yao et al. 2023): an agent that thinks in text, calls tools and reads their
answers, in one context whose KV cache is kept across the calls (Pie §7.1).

The model writes, after the question::

    Thought: <free text, one line>
    Action: <a tool's name>
    Action Input: <the arguments as JSON>
    Observation: <the tool's answer, appended by the agent>
    Thought: ...
    Final Answer: <the answer, one line>

Thoughts are free (up to ``thought_tokens``, ending at the line's end). The line after a
thought is written under a grammar built from the tool list (:func:`pastry.sdk.tools.
action_grammar`): either ``Final Answer:`` or ``Action:`` with one of the tools' names and
JSON valid for that tool's argument schema, so that even a 135M model writes calls that
parse. The call starts as soon as its JSON is complete; while it runs the agent forwards
``Observation:`` (with ``early_call``, the default; else after the call returns). The
tool's answer is appended as text and the model goes on from it; only new tokens are ever
forwarded. After ``max_steps`` calls, or a call that repeats an earlier one (the same tool
and arguments: no progress), the grammar allows only the final answer.

It ends when the model writes its final answer (``"stop": "final_answer"``), or when the
transcript reaches ``max_tokens`` (``"max_tokens"``, no answer). ``tool_choice`` is
OpenAI's: ``"auto"`` (the model chooses), ``"required"`` (the first action is a call),
``"none"`` (answer without tools).

Tools are OpenAI function schemas bound to an allowlisted HTTP endpoint or an MCP server's
tool (:mod:`pastry.sdk.tools`). The instruction with the tool list comes first and is the
same for every agent with the same tools: the server's prefix cache computes its KV once
and shares it (``cached_tokens``; Pie's optimization 1). ``drop_results`` masks an
observation's KV once the thought after it is written (later tokens no longer attend to
it; Pie's optimization 3).

Args (one JSON object)::

    {"question": "..." (or "messages": [{"role", "content"}]), "tools": [...],
     "system": null (the default instruction, "{tools}" stands for the tool list),
     "max_steps": 4, "thought_tokens": 64, "answer_tokens": 64, "max_tokens": 2048,
     "tool_choice": "auto", "early_call": true, "drop_results": false,
     "max_observation_chars": 1000, "temperature": 0.0, "seed": null, "model": null}

Result (JSON)::

    {"answer": "..." or null, "stop": "final_answer" | "max_tokens",
     "steps": [{"thought", "tool", "arguments", "observation", "ok", "seconds"}],
     "final_thought": "...", "text": what the model and the tools wrote after the prompt,
     "tokens": transcript length, "cached_tokens": from the prefix cache,
     "forwarded": tokens this agent forwarded}
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pastry.sdk as px
from pastry.sdk import Context, EosTokens, MaxTokens, Sampler, StopStrings
from pastry.sdk.args import options
from pastry.sdk.grammar import Constraint, generate
from pastry.sdk.steps import own_page, truncate
from pastry.sdk.tools import (
    ACTION_INPUT,
    FINAL,
    Tool,
    action_grammar,
    call_tool,
    load_tools,
    tools_prompt,
)

SYSTEM = (
    "You answer the user's question. You can use these tools:\n{tools}\n\n"
    "Use this format:\n"
    "Thought: think about what to do\n"
    "Action: the tool to use\n"
    'Action Input: its arguments as JSON, e.g. {{"x": 1}}\n'
    "Observation: the tool's answer\n"
    "(Thought, Action, Action Input and Observation can repeat)\n"
    "Thought: I now know the answer\n"
    "Final Answer: the answer to the question\n\n"
    "Use the tools' answers: they are correct."
)
THOUGHT = "Thought:"

DEFAULTS: dict[str, Any] = {
    "question": None,
    "messages": None,
    "tools": [],
    "system": None,
    "max_steps": 4,
    "thought_tokens": 64,
    "answer_tokens": 64,
    "max_tokens": 2048,
    "tool_choice": "auto",
    "early_call": True,
    "drop_results": False,
    "max_observation_chars": 1000,
    "temperature": 0.0,
    "seed": None,
    "model": None,
}


class Agent:
    """One ReAct run on a context (see the module docstring)."""

    def __init__(self, ctx: Context, tools: list[Tool], opts: dict[str, Any]) -> None:
        self.ctx, self.tools, self.opts = ctx, tools, opts
        self.sampler = Sampler(temperature=opts["temperature"], seed=opts["seed"])
        self.start = len(ctx.tokens)  # where the agent's text begins
        self.steps: list[dict[str, Any]] = []
        self.masked: dict[int, list[bool]] = {}  # page index -> its slots drop_results hid
        self.pending_drop: tuple[int, int] | None = None
        self.inflight: list[asyncio.Future] = []
        self.repeated = False  # the last call repeated an earlier one (no progress)

    async def run(self) -> dict[str, Any]:
        ctx, opts = self.ctx, self.opts
        while True:
            ctx.fill(THOUGHT, add_special_tokens=False)
            thought = await self.thought()
            if thought is None:
                return self.result(None, "max_tokens", "")
            act = opts["tool_choice"] != "none" and len(self.steps) < opts["max_steps"]
            act = act and not self.repeated
            must = act and opts["tool_choice"] == "required" and not self.steps
            written = await self.constrained(action_grammar(self.tools, act=act, final=not must))
            if written is None:
                return self.result(None, "max_tokens", thought)
            if written.startswith(FINAL):
                answer = await self.answer()
                return self.result(
                    answer, "final_answer" if answer is not None else "max_tokens", thought
                )
            await self.act(thought, written)

    async def thought(self) -> str | None:
        """One line of free text after ``Thought:`` (its newline in the context)."""
        ctx, eos = self.ctx, self.ctx.eos_ids
        budget = self.budget(self.opts["thought_tokens"])
        if budget < 1:
            return None
        n0 = len(ctx.tokens)
        stop = MaxTokens(budget) | EosTokens(eos) | StopStrings(["\n"])
        text = await ctx.generate(self.sampler, stop)
        if ctx.tokens[-1] in eos:  # the model would end here: the grammar decides what follows
            await truncate(ctx, len(ctx.tokens) - 1)
        if not px.detokenize(ctx.queue, ctx.tokens[n0:]).endswith("\n"):
            ctx.fill("\n", add_special_tokens=False)
        if self.pending_drop:  # the thought after an observation is written: hide it
            self.drop(*self.pending_drop)
            self.pending_drop = None
        return text.strip()

    async def constrained(self, grammar: str) -> str | None:
        """The text written under ``grammar`` (None: out of tokens first)."""
        budget = self.budget(256)
        if budget < 1:
            return None
        n0 = len(self.ctx.tokens)
        with Constraint(self.ctx, grammar) as c:
            seed = self.opts["seed"]
            out = await generate(self.ctx, c, budget, self.opts["temperature"], seed)
        text = px.detokenize(self.ctx.queue, self.ctx.tokens[n0:])
        return text if out.complete else None

    async def act(self, thought: str, written: str) -> None:
        """Run the call ``written`` ("Action: name\\nAction Input: {...}\\n") and append
        its observation."""
        ctx, opts = self.ctx, self.opts
        name, _, args_text = written.removeprefix("Action: ").partition(ACTION_INPUT)
        tool = next(t for t in self.tools if t.name == name)
        arguments = json.loads(args_text)
        call = asyncio.ensure_future(call_tool(tool, arguments, opts["max_observation_chars"]))
        ctx.fill("Observation:", add_special_tokens=False)
        if opts["early_call"]:  # forward what we know while the tool runs
            await ctx.flush()
        obs = await call
        begin = len(ctx.tokens)
        ctx.fill(f" {obs.text}\n", add_special_tokens=False)
        if opts["drop_results"]:
            self.pending_drop = (begin, len(ctx.tokens))
        self.repeated = any(s["tool"] == name and s["arguments"] == arguments for s in self.steps)
        self.steps.append(
            {
                "thought": thought,
                "tool": name,
                "arguments": arguments,
                "observation": obs.text,
                "ok": obs.ok,
                "seconds": round(obs.seconds, 6),
            }
        )

    async def answer(self) -> str | None:
        """The rest of the final answer's line."""
        budget = self.budget(self.opts["answer_tokens"])
        if budget < 1:
            return None
        stop = MaxTokens(budget) | EosTokens(self.ctx.eos_ids) | StopStrings(["\n"])
        return (await self.ctx.generate(self.sampler, stop)).strip()

    def budget(self, want: int) -> int:
        return min(want, self.opts["max_tokens"] - len(self.ctx.tokens))

    def drop(self, begin: int, end: int) -> None:
        """Hide the tokens at positions ``begin..end-1`` (forwarded) from later tokens."""
        ctx = self.ctx
        ps = ctx.page_size
        for index in range(begin // ps, (end - 1) // ps + 1):
            # the observation's pages may have come from the prefix cache (another agent
            # read the same text): masking writes the page, so it must be this context's
            page, copying = own_page(ctx, index)
            mask = self.masked.setdefault(index, [False] * ps)
            for pos in range(max(begin, index * ps), min(end, (index + 1) * ps)):
                mask[pos - index * ps] = True
            self.inflight += [*copying, px.mask_kvpage(ctx.queue, page, list(mask))]

    def result(self, answer: str | None, stop: str, thought: str) -> dict[str, Any]:
        ctx = self.ctx
        return {
            "answer": answer,
            "stop": stop,
            "steps": self.steps,
            "final_thought": thought,
            "text": px.detokenize(ctx.queue, ctx.tokens[self.start :]),
            "tokens": len(ctx.tokens),
            "cached_tokens": ctx.cached_tokens,
            "forwarded": ctx.kv_len + len(ctx.pending) - ctx.cached_tokens,
        }


async def main(args: list[str]) -> str:
    opts = _options(args)
    tools = await load_tools(opts["tools"])
    if not tools and opts["tool_choice"] == "required":
        raise ValueError('"tool_choice": "required" needs at least one tool')
    ctx = Context(opts["model"])
    ctx.fill(px.apply_chat_template(ctx.queue, _messages(opts, tools)), add_special_tokens=False)
    agent = Agent(ctx, tools, opts)
    try:
        out = await agent.run()
        await asyncio.gather(*agent.inflight)
    finally:
        await ctx.release()
    return json.dumps(out)


def _messages(opts: dict[str, Any], tools: list[Tool]) -> list[tuple[str, str]]:
    system = (opts["system"] or SYSTEM).replace("{tools}", tools_prompt(tools) or "(none)")
    system = system.replace("{{", "{").replace("}}", "}")
    if opts["messages"] is not None:
        msgs = [(m["role"], m["content"]) for m in opts["messages"]]
        return msgs if msgs and msgs[0][0] == "system" else [("system", system), *msgs]
    return [("system", system), ("user", opts["question"])]


def _options(args: list[str]) -> dict[str, Any]:
    opts = options(args, DEFAULTS, prompt_keys=())
    if opts["messages"] is None and not (isinstance(opts["question"], str) and opts["question"]):
        raise ValueError('give the task as "question" (text) or "messages"')
    for key in ("max_steps", "thought_tokens", "answer_tokens", "max_tokens"):
        if not isinstance(opts[key], int) or opts[key] < (key != "max_steps"):
            raise ValueError(f'"{key}" must be a positive integer, got {opts[key]!r}')
    if opts["tool_choice"] not in ("auto", "required", "none"):
        raise ValueError(
            f'"tool_choice" is "auto", "required" or "none", got {opts["tool_choice"]!r}'
        )
    return opts
