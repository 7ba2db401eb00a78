"""Recursion of thought (Lee and Kim 2023): the model splits a problem into sub-problems of
its own, each is solved in a context of its own, and only their answers come back into the
parent's context.

A problem's context is the shared instructions (the prompt) followed by ``"\\nProblem:"``
and the problem. Below ``depth``, the model writes its plan after ``"\\nSub-problems:\\n"``
under a grammar that admits ``"none\\n"`` or a numbered list of ``min_branch`` to
``branch`` sub-problems (``"1. <question>\\n2. <question>\\n"``, at most ``question_chars``
characters each), so that even a small model writes one that parses. Each sub-problem it
wrote is solved recursively; then each answer is appended (``"\\nSub-answer <i>:"`` and its
tokens) and the problem's own answer is generated greedily after ``"\\nAnswer:"`` (at most
``answer_tokens``); at ``depth``, or when the model plans none, it answers directly. With
branch 2 and depth 5 the tree has up to the paper's 2^5 = 32 leaf problems.

KV cache: every problem's context is a ``fork`` of one instructions context, so the
instructions' full pages are shared by all of them; a sub-problem's working (its own plan,
sub-problems and their answers) lives in pages that are released once its answer is read,
and never enters the parent's context. Sibling sub-problems are solved concurrently, each on
its own queue, so their forwards run in one batch per token.

Args (one JSON object)::

    {"prompt": "instructions" or [ids]} or {"prompt_tokens": [ids]}, "model": null,
    "problem": "text" or [ids], "branch": 2, "min_branch": 0, "depth": 2,
    "question_chars": 80, "answer_tokens": 16, "trace": false

Result (JSON)::

    {"answer": "...", "problems": number of problems solved,
     "tree": {"question": "...", "question_tokens": [ids], "answer": "...",
              "answer_tokens": [ids], "subproblems": [tree, ...],
              "plan_tokens": [ids of the plan] (below depth), with trace also
              "plan_context": [ids before the model's plan], "context": [ids before the answer]}}
"""

from __future__ import annotations

import asyncio
import json
import re

from pastry.sdk import Context, EosTokens, MaxTokens, Sampler
from pastry.sdk.args import options, prompt_tokens
from pastry.sdk.grammar import Constraint, generate

DEFAULTS = {
    "model": None,
    "problem": None,
    "branch": 2,
    "min_branch": 0,
    "depth": 2,
    "question_chars": 80,
    "answer_tokens": 16,
    "trace": False,
}
GO = "\nProblem:"
PLAN = "\nSub-problems:\n"
NONE = "none\n"
SUB_ANSWER = "\nSub-answer {}:"
ANSWER = "\nAnswer:"
LINE = re.compile(r"(\d+)\. ([^\n]+)\n")


def plan_regex(branch: int, chars: int, least: int = 0) -> str:
    """``none\\n`` (when ``least`` is 0) or a numbered list of ``max(least, 1)`` to ``branch``
    questions, each a line of 1 to ``chars`` characters (the first not a space)."""
    out = ""
    for i in range(branch, 0, -1):
        item = f"{i}\\. [^\\n ][^\\n]{{0,{chars - 1}}}\\n"
        if not out:
            out = item
        elif i >= max(least, 1):  # the questions after this one may be left out
            out = f"{item}({out})?"
        else:
            out = item + out
    return f"none\\n|{out}" if least == 0 else out


def parse_plan(text: str) -> list[str]:
    """The sub-problems of a plan the grammar admitted (none for ``none``)."""
    questions = []
    for m in LINE.finditer(text):
        if int(m.group(1)) != len(questions) + 1:
            break
        questions.append(m.group(2).strip())
    return questions


class Solver:
    def __init__(self, base: Context, opts: dict) -> None:
        self.base = base  # the instructions, every problem's context forks from it
        self.api = base.api
        self.q = self.api.create_queue(base.model)  # for tokenizing
        self.eos = set(base.eos_ids)
        self.opts = opts
        self.solved = 0

    async def solve(self, question: list[int], level: int) -> dict:
        ctx = await self.base.fork()
        ctx.fill_tokens(self._text(GO) + question)
        node: dict = {"question": self.api.detokenize(self.q, question)}
        subs: list[dict] = []
        if level < self.opts["depth"]:
            ctx.fill_tokens(self._text(PLAN))
            node["plan_context"] = list(ctx.tokens)
            plan = await self._plan(ctx)
            node["plan_tokens"] = plan
            asked = parse_plan(self.api.detokenize(self.q, plan))
            subs = await asyncio.gather(*(self.solve(self._text(a), level + 1) for a in asked))
            for i, sub in enumerate(subs, start=1):
                ctx.fill_tokens(self._text(SUB_ANSWER.format(i)) + sub["answer_tokens"])
        ctx.fill_tokens(self._text(ANSWER))
        node["context"] = list(ctx.tokens)
        answer = await self._generate(ctx, self.opts["answer_tokens"])
        await ctx.release()
        self.solved += 1
        node.update(
            question_tokens=question,
            answer=self.api.detokenize(self.q, answer),
            answer_tokens=answer,
            subproblems=subs,
        )
        return node

    async def _plan(self, ctx: Context) -> list[int]:
        """The model's plan for the problem in ``ctx``, written under the plan grammar."""
        o = self.opts
        with Constraint(ctx, {"regex": plan_regex(o["branch"], o["question_chars"], o["min_branch"])}) as c:  # fmt: skip
            # a line takes at most a token per character
            return (await generate(ctx, c, o["branch"] * (o["question_chars"] + 4) + 2)).tokens

    async def _generate(self, ctx: Context, n: int) -> list[int]:
        start = len(ctx.tokens)
        await ctx.generate(Sampler(), MaxTokens(n) | EosTokens(self.eos))
        return [t for t in ctx.tokens[start:] if t not in self.eos]

    def _text(self, text: str) -> list[int]:
        return self.api.tokenize(self.q, text)


async def main(args: list[str]) -> str:
    opts = options(args, DEFAULTS)
    for key in ("branch", "question_chars", "answer_tokens"):
        if opts[key] < 1:
            raise ValueError(f"{key} must be at least 1, got {opts[key]}")
    for key in ("depth", "min_branch"):
        if opts[key] < 0:
            raise ValueError(f"{key} must be at least 0, got {opts[key]}")
    if opts["min_branch"] > opts["branch"] or opts["branch"] > 20:
        raise ValueError(
            f"need 0 <= min_branch <= branch <= 20, got {opts['min_branch']}, {opts['branch']}"
        )
    base = Context(opts["model"])
    base.fill_tokens(prompt_tokens(base, opts))
    await base.flush(keep_last=False)  # the forks append to it: nothing stays pending
    solver = Solver(base, opts)
    problem = opts["problem"]
    if isinstance(problem, str) and problem:
        problem = solver._text(problem)
    elif isinstance(problem, list) and problem:
        problem = [int(t) for t in problem]
    else:
        raise ValueError('give the problem as "problem": text or token ids')
    tree = await solver.solve(problem, 0)
    await base.release()
    if not opts["trace"]:
        _strip(tree)
    return json.dumps({"answer": tree["answer"], "problems": solver.solved, "tree": tree})


def _strip(node: dict) -> None:
    node.pop("context", None)
    node.pop("plan_context", None)
    for sub in node["subproblems"]:
        _strip(sub)
