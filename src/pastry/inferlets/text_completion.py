"""Text completion: a prompt in, ``n`` continuations out — the program behind
``POST /v1/completions``, and an example of streaming, stop strings, ``fork``, logit
processing on the device and log-probabilities.

    pastry run text-completion -- "Once upon a time"
    pastry run text-completion -- '{"prompt": "Once upon a time", "n": 2, "stream": true}'

Plain words are the prompt, decoded greedily for 32 tokens and sent as raw text messages
(no result). A JSON object sets the options in :data:`OPTIONS` (``prompt`` may also be a
list of token ids). The result is JSON::

    {"choices": [{"index", "text", "finish_reason": "stop" | "length", "tokens": [ids],
                  "logprobs": null | [[token, logprob, [[id, logprob], ...]], ...],
                  "cumulative_logprob": null | float}],
     "prompt": {"tokens": [ids], "logprobs": null | [null | [token, logprob, top], ...]},
     "usage": {"prompt_tokens", "completion_tokens", "total_tokens"}}

With ``"stream": true`` each piece of text is first sent as a message ``{"index": i,
"delta": text, "logprobs": [entries of the tokens since the last message]}`` (and, with
``echo``, the ``"prompt"`` object first as ``{"prompt": {...}}``). Sampling
options follow vLLM's ``SamplingParams``: ``logit_bias`` ({token id: bias}),
``repetition_penalty`` (over prompt and output), ``frequency_penalty`` /
``presence_penalty`` (over the output), ``stop_token_ids``, ``ignore_eos`` (do not stop at
end-of-sequence), ``min_tokens`` (end-of-sequence and stop tokens forbidden before),
``best_of`` (sample that many, return the ``n`` with the highest cumulative
log-probability), ``logprobs`` (the sampled token's log-probability and that many top ones,
raw: before processing), ``echo`` (the prompt comes back with the text, and its
log-probabilities when ``logprobs`` is set) and ``grammar`` ({"json_schema": ...} |
{"regex": ...} | {"lark": ...}: the output is a word of it; see :mod:`pastry.sdk.grammar`).
``stop_repeated_item``: for an output that is a JSON array (a grammar's), stop as soon as an
item equals an earlier one (``finish_reason`` "stop"): what ends a small model's forced tool
calls, which greedy decoding otherwise repeats until ``max_tokens``.
"""

from __future__ import annotations

import asyncio
import json
import math
from dataclasses import replace

import pastry.sdk as px
from pastry.api import Sampling
from pastry.sdk import Context, StopCondition, StopStrings
from pastry.sdk.steps import prompt_logprobs, sample_next, truncate

OPTIONS = {
    "model": None,  # None: the first model
    "prompt": "",
    "max_tokens": 16,
    "temperature": 1.0,  # 0: greedy
    "top_p": 1.0,
    "top_k": 0,
    "min_p": 0.0,
    "seed": None,  # choice i samples with its own seed derived from (seed, i)
    "stop": [],  # stop strings (a string is one)
    "stop_token_ids": [],
    "ignore_eos": False,
    "min_tokens": 0,
    "n": 1,
    "best_of": None,
    "stream": False,
    "logprobs": None,  # None or 0..20
    "echo": False,
    "logit_bias": {},
    "repetition_penalty": 1.0,
    "frequency_penalty": 0.0,
    "presence_penalty": 0.0,
    "grammar": None,
    "stop_repeated_item": False,
    "adapter": None,  # a LoRA adapter of the model, applied to every forward
}


async def main(args: list[str]) -> str | None:
    opts = parse(args, OPTIONS)
    plain = opts is None
    if plain:
        opts = {**OPTIONS, "prompt": " ".join(args), "max_tokens": 32, "temperature": 0.0}
    ctx = Context(opts["model"], adapter=opts["adapter"])
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


async def complete(ctx: Context, opts: dict, plain: bool = False, run_ahead: bool = True) -> dict:
    """Generate ``opts["n"]`` continuations of ``ctx`` concurrently; the result object.

    The branches are forks of ``ctx``: they share the prompt's KV pages, and their steps
    batch together because they run at the same time. ``run_ahead`` False samples every
    token with its own call (the reference the run-ahead loop is tested against).
    """
    prompt = list(ctx.tokens)
    echo = {"tokens": prompt, "logprobs": None}
    if opts["echo"] and opts["logprobs"] is not None:
        lps, ids, tops = await prompt_logprobs(ctx, int(opts["logprobs"]))
        echo["logprobs"] = [
            None if lp is None else [t, lp, [list(p) for p in zip(i, v, strict=True)]]
            for t, lp, i, v in zip(prompt, lps, ids, tops, strict=True)
        ]
    if opts["echo"] and opts["stream"] and not plain:  # the echo streams first
        px.send(json.dumps({"prompt": echo}))
    n = opts["n"]
    best_of = opts["best_of"] or n
    choices: list[dict] = []
    if opts["max_tokens"] > 0:
        branches = [ctx] + [await ctx.fork() for _ in range(best_of - 1)]
        choices = await asyncio.gather(
            *(
                generate(b, i, opts, prompt, plain, best_of > n, run_ahead)
                for i, b in enumerate(branches)
            )
        )
        await asyncio.gather(*(b.release() for b in branches[1:]))  # ctx is the caller's
    else:  # echo only: the prompt scored, nothing generated
        choices = [_choice(i, [], "length", [], None) for i in range(n)]
    completion_tokens = sum(len(c["tokens"]) for c in choices)
    if best_of > n:
        choices = sorted(choices, key=lambda c: -c["cumulative_logprob"])[:n]
        for i, c in enumerate(choices):
            c["index"] = i
            if opts["logprobs"] is None:
                c["logprobs"] = None
    usage = {
        "prompt_tokens": len(prompt),
        "completion_tokens": completion_tokens,
        "total_tokens": len(prompt) + completion_tokens,
        # prompt tokens the automatic prefix cache supplied (not computed again)
        "prompt_tokens_details": {"cached_tokens": ctx.cached_tokens},
    }
    return {"choices": choices, "prompt": echo, "usage": usage}


def _choice(index, tokens, finish, entries, cumulative) -> dict:
    return {
        "index": index,
        "text": "",
        "finish_reason": finish,
        "tokens": tokens,
        "logprobs": entries,
        "cumulative_logprob": cumulative,
    }


async def generate(
    ctx: Context,
    index: int,
    opts: dict,
    prompt: list[int],
    plain: bool,
    rank: bool,
    run_ahead: bool = True,
) -> dict:
    """One choice, streaming the text if asked: its index, text, tokens,
    log-probabilities and finish reason. The first token is sampled with the prompt's
    forward; the rest run ahead in the control layer (one ``generate`` request; the
    program hears the tokens only to stream them or to watch for a repeated item), or,
    with an adapter (or ``run_ahead`` False), one ``sample`` per token."""
    c = Choice(ctx, index, opts, prompt, plain, rank)
    try:
        if c.constraint is not None and c.constraint.done:
            c.finish = "stop"
        while c.finish is None and (len(c.out) == 0 or ctx.adapter or not run_ahead):
            got = await sample_next(ctx, sampling=c.sampling_at(len(c.out)))
            tok, *lp = got if c.want is not None else (got,)
            ctx.fill_tokens([tok])
            if c.constraint is not None:
                c.constraint.sampled()
            c.take(tok, *lp)
            c.stream()
            if c.finish is None and c.constraint is not None and c.constraint.done:
                c.finish = "stop"
        if c.finish is None:
            await c.run_ahead()
    finally:
        if c.constraint is not None:
            c.constraint.free()
    return c.result()


class Choice:
    """One choice's options and what it generated; :meth:`take` applies the stop rules
    per token, as the control layer's loop does."""

    def __init__(
        self, ctx: Context, index: int, opts: dict, prompt: list[int], plain: bool, rank: bool
    ) -> None:
        self.ctx, self.index, self.plain = ctx, index, plain
        self.prompt_len = len(ctx.tokens)
        self.a, self.q = ctx.api, ctx.queue
        stop_ids = set(map(int, opts["stop_token_ids"]))
        self.stop_ids = stop_ids | (set() if opts["ignore_eos"] else set(ctx.eos_ids))
        self.stops = [s for s in opts["stop"] if s]
        self.strings = StopStrings(self.stops)
        self.max_tokens, self.min_tokens = opts["max_tokens"], opts["min_tokens"]
        self.top = opts["logprobs"]
        self.want = self.top if self.top is not None else (0 if rank else None)
        self.constraint = None
        if opts["grammar"] is not None:
            from pastry.sdk.grammar import Constraint

            self.constraint = Constraint(ctx, opts["grammar"])
        self.sampling = base_sampling(opts, index, prompt, self.want, self.constraint)
        self.repeated = RepeatedItem() if opts["stop_repeated_item"] else None
        self.out: list[int] = []
        self.entries: list = []
        self.cumulative = 0.0
        self.finish: str | None = None
        self.deltas = None
        if plain or opts["stream"]:
            self.sent = 0
            detokenize = lambda t: self.a.detokenize(self.q, t)  # noqa: E731
            self.deltas = Deltas(self.send, detokenize, sorted(self.stop_ids), self.stops)

    def send(self, delta: str) -> None:
        if self.plain:
            px.send(delta)
            return
        entries = self.entries[self.sent :]
        px.send(json.dumps({"index": self.index, "delta": delta, "logprobs": entries}))
        self.sent = len(self.entries)

    def sampling_at(self, n: int, ban: bool = True) -> Sampling:
        """The sampling of token ``n`` (what the control layer's loop derives per token);
        ``ban``: with the stop tokens banned before ``min_tokens`` (the loop bans them
        itself)."""
        s = self.sampling
        changes: dict = {}
        if s.seed is not None:
            changes["seed"] = s.seed + n
        if s.repetition_penalty != 1.0 or s.frequency_penalty or s.presence_penalty:
            changes["penalty_tokens"] = list(self.out)
        banning = ban and n < self.min_tokens and self.stop_ids
        if banning and (self.constraint is None or not self.constraint.complete):
            banned = [(t, -math.inf) for t in sorted(self.stop_ids)]
            changes["logit_bias"] = [*s.logit_bias, *banned]
        return replace(s, **changes) if changes else s

    def take(self, tok: int, lp: float = 0.0, ids=(), lps=()) -> None:
        """Token ``tok`` (with its log-probabilities) joins the output; a stop rule that
        holds now sets :attr:`finish`."""
        if self.want is not None:
            self.cumulative += lp
            self.entries.append([tok, lp, [list(p) for p in zip(ids, lps, strict=True)]])
        out = self.out
        out.append(tok)
        if self.stopped(out):
            self.finish = "stop"
        elif len(out) >= self.max_tokens:
            self.finish = "length"

    def stopped(self, out: list[int]) -> bool:
        """A stop token, a stop string (from ``min_tokens`` on) or a repeated item."""
        if out[-1] in self.stop_ids:
            return True
        if self.stops and len(out) >= self.min_tokens:
            tail = self.a.detokenize(self.q, out[-self.strings.tail_tokens :])
            if self.strings.should_stop(out, tail):
                return True
        rep = self.repeated
        return rep is not None and rep.closes_a_repeat(lambda: self.a.detokenize(self.q, out))

    def stream(self) -> None:
        """Send the text that can no longer change."""
        if self.deltas is not None and self.out[-1] not in self.stop_ids:
            self.deltas.should_stop(self.out, "")

    async def run_ahead(self) -> None:
        """The rest as one loop in the control layer, heard per merged part when the
        program streams or watches for a repeated item."""
        n = len(self.out)
        heard = self.deltas is not None or self.repeated is not None  # else once, at the end
        tail = self.out[-self.strings.tail_tokens :] if self.stops else []
        _, finish, _ = await self.ctx.run_ahead(
            self.max_tokens - n, self.sampling_at(n, ban=False), sorted(self.stop_ids),
            self.stops, max(0, self.min_tokens - n), tail, every=int(heard), hear=self.hear,
        )  # fmt: skip
        if self.finish is None:  # the loop's grammar said so (its other rules are take's)
            self.finish = "stop" if finish == "grammar" else finish
        keep = self.prompt_len + len(self.out)
        if len(self.ctx.tokens) > keep:  # the loop ran past where a rule of ours ended it
            await truncate(self.ctx, keep, spare=False)

    def hear(self, tokens: list[int], lps: tuple[list, list, list]) -> bool:
        """Tokens of the loop: taken one by one; True ends the loop (a repeated item)."""
        for i, tok in enumerate(tokens):
            if self.finish is not None:
                return True  # a rule of the program's own held: the rest is dropped
            if self.want is not None:
                self.take(tok, lps[0][i], lps[1][i], lps[2][i])
            else:
                self.take(tok)
        self.stream()
        return self.finish is not None

    def result(self) -> dict:
        out = self.out
        shown = out[:-1] if out and out[-1] in self.stop_ids else out
        text = self.a.detokenize(self.q, shown)
        if self.stops:
            text = self.strings.trim(text)
        if self.deltas is not None:
            self.deltas.flush(text)
        return {
            **_choice(self.index, out, self.finish or "length", None, None),
            "logprobs": self.entries if self.top is not None else None,
            "text": text,
            "cumulative_logprob": self.cumulative if self.want is not None else None,
        }


def base_sampling(opts: dict, index: int, prompt: list[int], want, constraint) -> Sampling:
    """The sampling of the first token of choice ``index``."""
    seed = opts["seed"]
    if seed is not None:  # each choice its own draws: far from the others' seed + step
        seed = (seed + index * 0x9E3779B9) % (1 << 62)
    rep, freq, pres = (
        opts[k] for k in ("repetition_penalty", "frequency_penalty", "presence_penalty")
    )
    penalties = {}
    if rep != 1.0 or freq != 0.0 or pres != 0.0:
        penalties = dict(repetition_penalty=rep, frequency_penalty=freq, presence_penalty=pres)
        if rep != 1.0:
            penalties["penalty_prompt"] = prompt
    return Sampling(
        temperature=opts["temperature"], top_k=opts["top_k"], top_p=opts["top_p"],
        min_p=opts["min_p"], seed=seed,
        logit_bias=[(int(t), float(b)) for t, b in dict(opts["logit_bias"]).items()],
        logprobs=want, constraint=None if constraint is None else constraint.handle,
        **penalties,
    )  # fmt: skip


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


class RepeatedItem:
    """Watches an output that is a JSON array for an item equal to an earlier one."""

    def __init__(self) -> None:
        self.items: list = []
        self.at = 1  # where the next item starts (after "[")
        self.decoder = json.JSONDecoder()

    def closes_a_repeat(self, text) -> bool:
        """Whether the output so far (``text()``, decoded only when an item may have ended)
        has just completed an item equal to an earlier one."""
        s = text()
        if "}" not in s[self.at :] and "]" not in s[self.at :]:
            return False
        while True:
            while self.at < len(s) and s[self.at] in ", \n\t":
                self.at += 1
            try:
                item, end = self.decoder.raw_decode(s, self.at)
            except ValueError:
                return False
            if item in self.items:
                return True
            self.items.append(item)
            self.at = end
