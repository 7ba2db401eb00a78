"""Recursion of thought (Lee and Kim 2023): a problem is split into sub-problems, each solved
in a context of its own, and only their answers come back into the parent's context.

A problem's context is the shared instructions (the prompt) followed by the problem. Below
``depth``, the problem first poses ``branch`` sub-problems (each generated greedily after
``"\\nSub-problem i:"`` on a fork of the problem's context), solves them recursively, then
appends each sub-problem with its answer (``" = answer"``) and generates its own answer
after ``"\\nAnswer:"``; at ``depth`` it answers directly. With branch 2 and depth 5 that is
the paper's 2^5 = 32 leaf problems.

KV cache: every problem's context is a ``fork`` of one instructions context, so the
instructions' full pages are shared by all of them; a sub-problem's working (its own
sub-problems and their answers) lives in pages that are released once its answer is read,
and never enters the parent's context. Sibling sub-problems are solved concurrently, each on
its own queue, so their forwards run in one batch per token.

Args (one JSON object)::

    {"prompt": "instructions" or [ids]} or {"prompt_tokens": [ids]}, "model": null,
    "problem": "text" or [ids], "branch": 2, "depth": 2, "question_tokens": 6,
    "answer_tokens": 6, "trace": false

Result (JSON)::

    {"answer": "...", "problems": number of problems solved,
     "tree": {"question": "...", "question_tokens": [ids], "answer": "...",
              "answer_tokens": [ids], "subproblems": [tree, ...],
              "context": [ids before the answer], "question_context": [ids before the
              question] (with trace; the root's question is the given problem)}}
"""

from __future__ import annotations

import asyncio
import json

from pastry.sdk import Context, EosTokens, MaxTokens, Sampler
from pastry.sdk.args import options, prompt_tokens

DEFAULTS = {
    "model": None,
    "problem": None,
    "branch": 2,
    "depth": 2,
    "question_tokens": 6,
    "answer_tokens": 6,
    "trace": False,
}
GO = "\nProblem:"
SUB = "\nSub-problem {}:"
EQUALS = " ="
ANSWER = "\nAnswer:"


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
        subs: list[dict] = []
        if level < self.opts["depth"]:
            asked = await asyncio.gather(*(self._ask(ctx, i) for i in range(self.opts["branch"])))
            subs = await asyncio.gather(*(self.solve(tokens, level + 1) for tokens, _ in asked))
            for i, ((tokens, context), sub) in enumerate(zip(asked, subs, strict=True)):
                sub["question_context"] = context
                ctx.fill_tokens(
                    self._text(SUB.format(i + 1))
                    + tokens
                    + self._text(EQUALS)
                    + sub["answer_tokens"]
                )
        ctx.fill_tokens(self._text(ANSWER))
        context = list(ctx.tokens)
        answer = await self._generate(ctx, self.opts["answer_tokens"])
        await ctx.release()
        self.solved += 1
        return {
            "question": self.api.detokenize(self.q, question),
            "question_tokens": question,
            "answer": self.api.detokenize(self.q, answer),
            "answer_tokens": answer,
            "subproblems": subs,
            "context": context,
        }

    async def _ask(self, ctx: Context, i: int) -> tuple[list[int], list[int]]:
        """Sub-problem ``i`` of the problem in ``ctx`` (on a fork); (tokens, context)."""
        async with await ctx.fork() as sub:
            sub.fill_tokens(self._text(SUB.format(i + 1)))
            context = list(sub.tokens)
            return await self._generate(sub, self.opts["question_tokens"]), context

    async def _generate(self, ctx: Context, n: int) -> list[int]:
        start = len(ctx.tokens)
        await ctx.generate(Sampler(), MaxTokens(n) | EosTokens(self.eos))
        return [t for t in ctx.tokens[start:] if t not in self.eos]

    def _text(self, text: str) -> list[int]:
        return self.api.tokenize(self.q, text)


async def main(args: list[str]) -> str:
    opts = options(args, DEFAULTS)
    for key in ("branch", "question_tokens", "answer_tokens"):
        if opts[key] < 1:
            raise ValueError(f"{key} must be at least 1, got {opts[key]}")
    if opts["depth"] < 0:
        raise ValueError(f"depth must be at least 0, got {opts['depth']}")
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
    node.pop("question_context", None)
    for sub in node["subproblems"]:
        _strip(sub)
