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

import pastry.sdk as px
from pastry.sdk import Context, MaxTokens, Sampler, StopCondition, StopStrings
from pastry.sdk.steps import prompt_logprobs, sample_next

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


async def complete(ctx: Context, opts: dict, plain: bool = False) -> dict:
    """Generate ``opts["n"]`` continuations of ``ctx`` concurrently; the result object.

    The branches are forks of ``ctx``: they share the prompt's KV pages, and their steps
    batch together because they run at the same time.
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
            *(generate(b, i, opts, prompt, plain, best_of > n) for i, b in enumerate(branches))
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
    ctx: Context, index: int, opts: dict, prompt: list[int], plain: bool, rank: bool
) -> dict:
    """One choice: sample token by token with the request's processing, streaming the text
    if asked; its index, text, tokens, log-probabilities and finish reason."""
    a, q = ctx.api, ctx.queue
    eos = set(ctx.eos_ids)
    stop_ids = set(map(int, opts["stop_token_ids"])) | (set() if opts["ignore_eos"] else eos)
    stops = [s for s in opts["stop"] if s]
    seed = opts["seed"]
    if seed is not None:  # each choice its own draws: far from the others' seed + step
        seed = (seed + index * 0x9E3779B9) % (1 << 62)
    sampler = Sampler(
        temperature=opts["temperature"],
        top_k=opts["top_k"],
        top_p=opts["top_p"],
        min_p=opts["min_p"],
        seed=seed,
    )
    bias = [(int(t), float(b)) for t, b in dict(opts["logit_bias"]).items()]
    banned = [(t, -math.inf) for t in sorted(stop_ids)]  # before min_tokens
    rep, freq, pres = (
        opts["repetition_penalty"],
        opts["frequency_penalty"],
        opts["presence_penalty"],
    )
    penalize = rep != 1.0 or freq != 0.0 or pres != 0.0
    top = opts["logprobs"]
    want = top if top is not None else (0 if rank else None)
    constraint = None
    if opts["grammar"] is not None:
        from pastry.sdk.grammar import Constraint

        constraint = Constraint(ctx, opts["grammar"])
    stop: StopCondition = MaxTokens(opts["max_tokens"]) | StopStrings(stops)
    entries: list = []
    repeated = RepeatedItem() if opts["stop_repeated_item"] else None
    deltas = None
    if plain or opts["stream"]:
        sent = [0]

        def send(d: str) -> None:
            if plain:
                px.send(d)
                return
            px.send(json.dumps({"index": index, "delta": d, "logprobs": entries[sent[0] :]}))
            sent[0] = len(entries)

        deltas = Deltas(send, lambda t: a.detokenize(q, t), list(stop_ids), stops)
    out: list[int] = []
    finish = "length"
    cumulative = 0.0
    while len(out) < opts["max_tokens"]:
        if constraint is not None and constraint.done:
            finish = "stop"
            break
        kw = dict(sampler.params(len(out)))
        step_bias = bias + banned if len(out) < opts["min_tokens"] else bias
        if constraint is not None:
            kw["mask"] = constraint.bitmask()
            if constraint.complete:  # the end is allowed: min_tokens must not forbid it
                step_bias = bias
        if step_bias:
            kw["logit_bias"] = step_bias
        if penalize:
            kw.update(
                penalty_tokens=out,
                penalty_prompt=prompt if rep != 1.0 else None,
                repetition_penalty=rep,
                frequency_penalty=freq,
                presence_penalty=pres,
            )
        if want is not None:
            kw["logprobs"] = want
        got = await sample_next(ctx, **kw)
        if want is not None:
            tok, lp, ids, lps = got
            cumulative += lp
            entries.append([tok, lp, [list(p) for p in zip(ids, lps, strict=True)]])
        else:
            tok = got
        if constraint is not None:
            constraint.consume([tok])
        out.append(tok)
        ctx.fill_tokens([tok])
        if tok in stop_ids:
            finish = "stop"
            break
        tail = a.detokenize(q, out[-stop.tail_tokens :]) if stop.tail_tokens else ""
        if deltas is not None:
            deltas.should_stop(out, tail)
        if stops and StopStrings(stops).should_stop(out, tail):
            finish = "stop"
            break
        if repeated is not None and repeated.closes_a_repeat(lambda: a.detokenize(q, out)):
            finish = "stop"
            break
    if constraint is not None:
        constraint.free()
    shown = out[:-1] if out and out[-1] in stop_ids else out
    text = StopStrings(stops).trim(a.detokenize(q, shown)) if stops else a.detokenize(q, shown)
    if deltas is not None:
        deltas.flush(text)
    return {
        **_choice(index, out, finish, entries if top is not None else None, None),
        "text": text,
        "cumulative_logprob": cumulative if want is not None else None,
    }


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
