"""Tree of thoughts (Yao et al. 2023), breadth-first: grow ``depth`` thoughts, keeping the
``keep`` best partial solutions at each level.

At each level every kept state proposes ``breadth`` thoughts: its next-token distribution
(``get_next_dist``) names the ``breadth`` most likely first tokens, one per thought, and each
thought continues greedily for up to ``thought_tokens`` tokens (ending early at the end of
its line or at end-of-sequence). Then the model evaluates every proposed state, as in the
paper's value prompt: on a fork of the state, ``value_prompt`` is appended and each label
of ``values`` (" sure", " likely", " impossible") is scored by its log-probability under the
model, as ``select`` scores choices (:func:`pastry.lang.scoring.score`); the state's value is
the expectation of the labels' weights (sure 20, likely 1, impossible 0.001, the paper's)
under those probabilities, normalised over the labels. The ``keep`` states of highest value
survive, the others are released. ``"score": "logprob"`` ranks by the thoughts' summed
log-probability instead (no evaluation). After the last level the best state may generate
an answer.

The proposals of a state are ``fork``s of its context: they share every full KV page of the
prompt and the thoughts before them by reference (only the partial last page is copied),
and the state's own context becomes its last proposal. All proposals of a level decode
together, each on its own queue, so their forwards run in one batch per token.

Args (one JSON object)::

    {"prompt": "text" or [ids]} or {"prompt_tokens": [ids]}, "model": null (the first),
    "breadth": 3, "keep": 2, "depth": 3, "thought_tokens": 8,
    "separator": "\\n" (text before each thought), "answer_prefix": "\\nAnswer:",
    "answer_tokens": 0 (no answer), "trace": false

Result (JSON)::

    {"best": {"thoughts": ["..."], "tokens": [[ids], ...], "score": its value (or
              log-probability), "answer": "..." (with answer_tokens), "answer_tokens": [ids]},
     "levels": [[{"parent": index of the state in the previous level (-1: the prompt),
                  "text": "...", "tokens": [ids], "score": ..., "logprob": ...,
                  "evaluation": {label: probability}, "kept": bool,
                  "context": [ids before the thought] (with trace)}, ...], ...],
     "evaluations": how many states the model evaluated}

A level's states are listed best first; ``parent`` indexes the previous level's list.
"""

from __future__ import annotations

import asyncio
import json
import math
from typing import NamedTuple

from pastry.lang.scoring import score
from pastry.sdk import Context, EosTokens, MaxTokens, Sampler
from pastry.sdk.args import options, prompt_tokens
from pastry.sdk.steps import next_dist

VALUE_PROMPT = (
    "\n\nQuestion: can the reasoning above reach a correct answer? "
    "Answer sure, likely or impossible.\nAnswer:"
)
VALUES = {" sure": 20.0, " likely": 1.0, " impossible": 0.001}

DEFAULTS = {
    "model": None,
    "breadth": 3,
    "keep": 2,
    "depth": 3,
    "thought_tokens": 8,
    "separator": "\n",
    "answer_prefix": "\nAnswer:",
    "answer_tokens": 0,
    "trace": False,
    "score": "value",
    "value_prompt": VALUE_PROMPT,
    "values": VALUES,
}


class State(NamedTuple):
    ctx: Context
    thoughts: list[list[int]]
    logprob: float  # summed log-probability of every thought token
    parent: int  # index of the parent state in the previous level (-1: the prompt)
    context: list[int]  # the tokens before the latest thought
    value: float = 0.0  # the model's evaluation (with "score": "value")
    evaluation: dict[str, float] | None = None  # label -> its probability

    @property
    def score(self) -> float:
        return self.logprob if self.evaluation is None else self.value


async def main(args: list[str]) -> str:
    opts = _options(args)
    breadth, keep, depth, n = (opts[k] for k in ("breadth", "keep", "depth", "thought_tokens"))
    root = Context(opts["model"])
    api = root.api
    q = api.create_queue(root.model)  # for tokenizing; outlives the states' contexts
    root.fill_tokens(prompt_tokens(root, opts))
    sep = api.tokenize(q, opts["separator"]) if opts["separator"] else []
    eos = set(root.eos_ids)
    frontier = [State(root, [], 0.0, -1, [])]
    levels = []
    evaluations = 0
    for _ in range(depth):
        for s in frontier:
            s.ctx.fill_tokens(sep)
        proposed = await asyncio.gather(
            *(_propose(s, i if levels else -1, breadth, n, eos) for i, s in enumerate(frontier))
        )
        states = [s for ss in proposed for s in ss]
        if opts["score"] == "value":
            states = await asyncio.gather(*(_evaluate(s, opts) for s in states))
            evaluations += len(states)
        states = sorted(states, key=lambda s: -s.score)
        await asyncio.gather(*(s.ctx.release() for s in states[keep:]))
        texts = [api.detokenize(q, s.thoughts[-1]) for s in states]
        levels.append(
            [
                _record(s, t, i < keep, opts["trace"])
                for i, (s, t) in enumerate(zip(states, texts, strict=True))
            ]
        )
        frontier = states[:keep]
    best = frontier[0]
    result = {
        "thoughts": [api.detokenize(q, t) for t in best.thoughts],
        "tokens": best.thoughts,
        "score": best.score,
    }
    if opts["answer_tokens"] > 0:
        best.ctx.fill(opts["answer_prefix"])
        start = len(best.ctx.tokens)
        stop = MaxTokens(opts["answer_tokens"]) | EosTokens(eos)
        result["answer"] = await best.ctx.generate(Sampler(), stop)
        result["answer_tokens"] = [t for t in best.ctx.tokens[start:] if t not in eos]
    await asyncio.gather(*(s.ctx.release() for s in frontier))
    return json.dumps({"best": result, "levels": levels, "evaluations": evaluations})


def _options(args: list[str]) -> dict:
    opts = options(args, DEFAULTS)
    sizes = [opts[k] for k in ("breadth", "keep", "depth", "thought_tokens")]
    if min(sizes) < 1:
        raise ValueError(
            "breadth, keep, depth and thought_tokens must be at least 1, got "
            + ", ".join(map(str, sizes))
        )
    if opts["score"] not in ("value", "logprob"):
        raise ValueError(f'"score" is "value" or "logprob", got {opts["score"]!r}')
    if not opts["values"] or not all(isinstance(w, int | float) for w in opts["values"].values()):
        raise ValueError(f'"values" maps labels to weights, got {opts["values"]!r}')
    return opts


def _record(s: State, text: str, kept: bool, trace: bool) -> dict:
    """A state as the result lists it (``text``: its latest thought)."""
    return {
        "parent": s.parent,
        "text": text,
        "tokens": s.thoughts[-1],
        "score": s.score,
        "logprob": s.logprob,
        **({"evaluation": s.evaluation} if s.evaluation is not None else {}),
        "kept": kept,
        **({"context": s.context} if trace else {}),
    }


async def _propose(state: State, index: int, breadth: int, n: int, eos: set[int]) -> list[State]:
    """``breadth`` thoughts after ``state``, one per most likely first token, each on a fork
    of the state's context (the last on the context itself)."""
    ids, probs = await next_dist(state.ctx, 4 * breadth + len(eos))
    text = state.ctx.api.detokenize
    firsts = [
        (t, p)
        for t, p in zip(ids, probs, strict=True)
        if t not in eos and p > 0 and text(state.ctx.queue, [t]).strip()  # not a blank line
    ]
    firsts = firsts[:breadth]
    context = list(state.ctx.tokens)
    forks = await asyncio.gather(*(state.ctx.fork() for _ in firsts[1:]))
    thoughts = await asyncio.gather(
        *(
            _continue_line(ctx, t, n, eos)
            for ctx, (t, _) in zip([*forks, state.ctx], firsts, strict=True)
        )
    )
    return [
        State(ctx, [*state.thoughts, tokens], state.logprob + math.log(p) + lp, index, context)
        for ctx, (_, p), (tokens, lp) in zip([*forks, state.ctx], firsts, thoughts, strict=True)
    ]


async def _continue_line(
    ctx: Context, first: int, n: int, eos: set[int]
) -> tuple[list[int], float]:
    """Append ``first`` and continue greedily up to ``n`` tokens in all, ending before an
    end-of-sequence token and after a token that ends the line; the tokens and the
    log-probability of those after ``first``."""
    tokens, logprob = [first], 0.0
    ctx.fill_tokens([first])
    while len(tokens) < n and "\n" not in ctx.api.detokenize(ctx.queue, tokens[-1:]):
        ids, probs = await next_dist(ctx, 1)
        if ids[0] in eos:
            break
        tokens.append(ids[0])
        logprob += math.log(probs[0])
        ctx.fill_tokens(ids[:1])
    return tokens, logprob


async def _evaluate(state: State, opts: dict) -> State:
    """The model's evaluation of ``state``: on a fork, ``value_prompt`` and each label
    scored (see the module docstring)."""
    base = await state.ctx.fork()
    try:
        base.fill(opts["value_prompt"], add_special_tokens=False)
        await base.flush()
        labels = list(opts["values"])

        async def one(label: str) -> float:
            fork = await base.fork()
            try:
                tokens = fork.api.tokenize(fork.queue, label, False)
                return sum(s.logprob for s in await score(fork, tokens))
            finally:
                await fork.release()

        logprobs = await asyncio.gather(*(one(label) for label in labels))
    finally:
        await base.release()
    top = max(logprobs)
    weights = [math.exp(lp - top) for lp in logprobs]
    probs = {label: w / sum(weights) for label, w in zip(labels, weights, strict=True)}
    value = sum(p * opts["values"][label] for label, p in probs.items())
    ctx, thoughts, logprob, parent, context = state[:5]
    return State(ctx, thoughts, logprob, parent, context, value, probs)
