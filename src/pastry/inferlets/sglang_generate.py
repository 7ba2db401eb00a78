"""One prompt of SGLang's native ``POST /generate`` (``server/sglang_api.py``), as an
inferlet: the prompt's tokens, ``n`` generations with SGLang's sampling parameters
(:mod:`pastry.lang.generation`, the code ``pastry.lang``'s ``gen`` runs), and the prompt's
log-probabilities when asked for (:mod:`pastry.lang.scoring`, the code ``select`` runs).

    pastry run sglang-generate -- '{"text": "Hello,", "sampling_params": {"max_new_tokens": 8}}'

The argument is one JSON object: ``text`` or ``input_ids``, ``sampling_params`` (SGLang's
names), ``return_logprob``, ``logprob_start_len``, ``top_logprobs_num``,
``return_text_in_logprobs``, ``stream``, ``model``, and ``images`` (base64, one per image
token of the prompt, on a model with the ``input_image`` trait). The result is a JSON list, one
``{"text", "output_ids", "meta_info"}`` per generation; with ``stream``, each piece of text
is first sent as a message ``{"index": i, "delta": text}``.
"""

from __future__ import annotations

import base64
import json
from typing import Any

import pastry.sdk as px
from pastry.lang.expr import SamplingParams
from pastry.lang.generation import check, generate_n
from pastry.lang.scoring import score
from pastry.sdk import Context

NAMES = {"sampling_seed": "seed"}  # SGLang's name -> pastry.lang's


def params(given: dict[str, Any]) -> SamplingParams:
    return SamplingParams().override({NAMES.get(k, k): v for k, v in given.items()})


async def main(args: list[str]) -> str:
    req = json.loads(args[0])
    p = params(req.get("sampling_params") or {})
    if req.get("return_logprob"):
        from dataclasses import replace

        p = replace(
            p,
            return_logprob=True,
            top_logprobs_num=int(req.get("top_logprobs_num") or 0),
            return_text_in_logprobs=bool(req.get("return_text_in_logprobs")),
        )
    check(p)
    ctx = Context(req.get("model"), adapter=req.get("lora_path"))  # a LoRA adapter's name
    tokens = req.get("input_ids") or px.tokenize(ctx.queue, req["text"], True)  # BOS if any
    if not tokens:
        raise ValueError("the prompt is empty: give at least one token")
    text_of = (lambda t: px.detokenize(ctx.queue, [t])) if p.return_text_in_logprobs else (
        lambda t: None)  # fmt: skip
    meta: dict[str, Any] = {"prompt_tokens": len(tokens), "cached_tokens": 0}
    if p.return_logprob:
        start = req.get("logprob_start_len")
        start = len(tokens) - 1 if start is None or start < 0 else min(start, len(tokens) - 1)
        ctx.fill_tokens(tokens[: start + 1])
        # the prompt's log-probabilities on the device; the last token stays pending, so
        # generation goes on from it
        scored = await score(ctx, tokens[start + 1 :], p.top_logprobs_num)
        meta["input_token_logprobs"] = [(None, tokens[start], text_of(tokens[start]))] + [
            (s.logprob, s.token, text_of(s.token)) for s in scored
        ]
        if p.top_logprobs_num:
            meta["input_top_logprobs"] = [None] + [
                [(lp, t, text_of(t)) for t, lp in s.top] for s in scored
            ]
    else:
        ctx.fill_prompt(tokens, [base64.b64decode(i, validate=True) for i in req.get("images", ())])
        meta["prompt_tokens"] = len(ctx.tokens)  # an image's embeddings count as tokens
    if p.max_new_tokens == 0:
        await ctx.flush(keep_last=False)  # the prompt's K/V is computed (a prefill request)
    streams = None
    if req.get("stream"):
        streams = [_sender(i) for i in range(p.n)]
    gens = await generate_n(ctx, p, streams)
    out = []
    for g in gens:
        m = {**meta, "completion_tokens": len(g.tokens), "finish_reason": g.finish_reason}
        m["cached_tokens"] = ctx.cached_tokens  # prompt tokens the prefix cache supplied
        if p.return_logprob:
            m["output_token_logprobs"] = [(lp, t, text_of(t)) for lp, t in g.logprobs or []]
            if p.top_logprobs_num:
                m["output_top_logprobs"] = [
                    [(lp, t, text_of(t)) for lp, t in row] for row in g.top_logprobs or []
                ]
        out.append({"text": g.text, "output_ids": g.tokens, "meta_info": m})
    return json.dumps(out)


def _sender(index: int):
    def send(piece: str) -> None:
        px.send(json.dumps({"index": index, "delta": piece}))

    return send
