"""Text completion: a prompt in, ``n`` continuations out — the program behind
``POST /v1/completions``, and an example of streaming, stop strings and ``fork``.

    pastry run text-completion -- "Once upon a time"
    pastry run text-completion -- '{"prompt": "Once upon a time", "n": 2, "stream": true}'

Plain words are the prompt, decoded greedily for 32 tokens and sent as raw text messages
(no result). A JSON object sets the options in :data:`OPTIONS` (``prompt`` may also be a
list of token ids); the result is ``{"choices": [{"index", "text", "finish_reason"}], "usage": {...}}`` as JSON and,
with ``"stream": true``, each piece of text is first sent as a message
``{"index": i, "delta": text}``.
"""

from __future__ import annotations

import asyncio
import json

import pastry.sdk as px
from pastry.sdk import Context, EosTokens, MaxTokens, Sampler, StopCondition, StopStrings

OPTIONS = {
    "model": None,  # None: the first model
    "prompt": "",
    "max_tokens": 16,
    "temperature": 1.0,  # 0: greedy
    "top_p": 1.0,
    "seed": None,  # choice i samples with its own seed derived from (seed, i)
    "stop": [],  # stop strings (a string is one)
    "n": 1,
    "stream": False,
}


async def main(args: list[str]) -> str | None:
    opts = parse(args, OPTIONS)
    plain = opts is None
    if plain:
        opts = {**OPTIONS, "prompt": " ".join(args), "max_tokens": 32, "temperature": 0.0}
    ctx = Context(opts["model"])
    if isinstance(opts["prompt"], str):
        ctx.fill(opts["prompt"])
    else:
        ctx.fill_tokens(opts["prompt"])
    result = await complete(ctx, opts, plain)
    return None if plain else json.dumps(result)


def parse(args: list[str], options: dict) -> dict | None:
    """``options`` updated from a single JSON object argument; None for plain words."""
    try:
        given = json.loads(args[0]) if len(args) == 1 else None
    except ValueError:
        given = None
    if not isinstance(given, dict):
        return None
    unknown = sorted(set(given) - set(options))
    if unknown:
        raise ValueError(f"unknown options {unknown}; the options are {sorted(options)}")
    opts = {**options, **given}
    if isinstance(opts["stop"], str):
        opts["stop"] = [opts["stop"]]
    return opts


async def complete(ctx: Context, opts: dict, plain: bool = False) -> dict:
    """Generate ``opts["n"]`` continuations of ``ctx`` concurrently; the result object.

    The branches are forks of ``ctx``: they share the prompt's KV pages, and their steps
    batch together because they run at the same time.
    """
    prompt_tokens = len(ctx.tokens)
    branches = [ctx] + [await ctx.fork() for _ in range(opts["n"] - 1)]
    choices = await asyncio.gather(
        *(generate(branch, i, opts, plain) for i, branch in enumerate(branches))
    )
    completion_tokens = sum(len(b.tokens) - prompt_tokens for b in branches)
    await asyncio.gather(*(b.release() for b in branches[1:]))  # ctx is the caller's
    usage = {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }
    return {"choices": choices, "usage": usage}


async def generate(ctx: Context, index: int, opts: dict, plain: bool) -> dict:
    """One choice: generate, streaming the text if asked; its index, text and finish reason."""
    start = len(ctx.tokens)
    stops = [s for s in opts["stop"] if s]
    seed = opts["seed"]
    if seed is not None:  # each choice its own draws: far from the others' seed + step
        seed = (seed + index * 0x9E3779B9) % (1 << 62)
    sampler = Sampler(temperature=opts["temperature"], top_p=opts["top_p"], seed=seed)
    stop = MaxTokens(opts["max_tokens"]) | EosTokens(ctx.eos_ids) | StopStrings(stops)
    deltas = None
    if plain or opts["stream"]:
        send = px.send if plain else lambda d: px.send(json.dumps({"index": index, "delta": d}))
        deltas = Deltas(send, lambda t: px.detokenize(ctx.queue, t), ctx.eos_ids, stops)
        stop = deltas | stop  # first, so that it sees every step
    text = await ctx.generate(sampler, stop)
    if deltas:
        deltas.flush(text)
    out = ctx.tokens[start:]
    stopped = out[-1] in ctx.eos_ids or any(s in px.detokenize(ctx.queue, out) for s in stops)
    return {"index": index, "text": text, "finish_reason": "stop" if stopped else "length"}


class Deltas(StopCondition):
    """Sends the generated text as it grows; never stops generation itself.

    Each step decodes only the newest tokens, after the previous step's for context, and
    sends the new text that can no longer change: not a trailing incomplete UTF-8 character
    (decoded as U+FFFD), not an end-of-sequence token, and not the last
    ``len(longest stop string) - 1`` characters, which a stop string may still cover.
    """

    def __init__(self, send, detokenize, eos_ids: list[int], stops: list[str]) -> None:
        self.send, self.detokenize = send, detokenize
        self.eos = set(eos_ids)
        self.stops = stops
        self.hold = max(map(len, stops), default=1) - 1
        self.text = ""  # the text of tokens[:read]
        self.prefix = self.read = 0  # tokens[prefix:read] are decoded again before new ones
        self.sent = 0  # characters of the text sent

    def should_stop(self, tokens: list[int], text: str) -> bool:
        if tokens[-1] in self.eos:
            return False
        before = self.detokenize(tokens[self.prefix : self.read])
        after = self.detokenize(tokens[self.prefix :])
        if after.endswith("\ufffd") or not after.startswith(before):
            return False  # the last character is not complete yet
        new = after[len(before) :]
        self.text += new
        self.prefix, self.read = self.read, len(tokens)
        if not any(s in self.text[-len(new) - self.hold :] for s in self.stops):
            self.flush(self.text[: max(0, len(self.text) - self.hold)])
        return False

    def flush(self, text: str) -> None:
        """Send what ``text`` (the text so far, or the final text) adds to what was sent."""
        if len(text) > self.sent:
            self.send(text[self.sent :])
            self.sent = len(text)
