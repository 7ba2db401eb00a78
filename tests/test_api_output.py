"""The output functions of the inferlet API with logit processing and log-probabilities:
from a trusted inferlet, and the same source in the sandbox (tests/test_wasm.py)."""

from __future__ import annotations

import asyncio
import json

import numpy as np

from inferlet_util import load_engine, result, run_all

LOGITS = """
import json
import math
import pastry.sdk as px

async def main(args):
    model = px.available_models()[0]
    q = px.create_queue(model)
    toks = px.tokenize(q, "Hello, world. The quick brown fox jumps")
    n = len(toks)
    ps = px.get_kv_page_size(q)
    emb = px.alloc_embeds(q, n + 1)
    kv = px.alloc_kvpages(q, -(-n // ps))
    await px.embed_txt(q, toks, list(range(n)), emb[:n])
    lps, top_ids, top_lps = await px.forward(
        q, [], 0, emb[:n], kv, 0, [emb[n]], None, toks[1:] + [-1], 3
    )
    out = {"nan_last": math.isnan(lps[-1]), "prompt": [lps[:-1], top_ids, top_lps]}
    vocab = px.get_vocab_size(q)
    allowed = list(range(5, vocab, 7))
    mask = bytearray(4 * ((vocab + 31) // 32))
    for t in allowed:
        mask[t // 8] |= 1 << (t % 8)
    mask = bytes(mask)
    out["allowed"] = allowed
    out["greedy"] = await px.sample(q, emb[n], logprobs=5)
    out["plain"] = await px.sample(q, emb[n])
    out["masked"] = await px.sample(q, emb[n], mask=mask, logprobs=2)
    out["long_mask"] = await px.sample(q, emb[n], mask=mask + bytes(4))  # as llguidance may
    out["hot"] = [await px.sample(q, emb[n], temperature=2.0, seed=s, mask=mask) for s in range(20)]
    out["biased"] = await px.sample(q, emb[n], logit_bias=[(allowed[3], 100.0)])
    top = out["greedy"][0]
    out["penalized"] = await px.get_next_dist(
        q, emb[n], 4, penalty_tokens=[top, top], repetition_penalty=1.5,
        frequency_penalty=0.5, presence_penalty=0.5,
    )
    out["masked_dist"] = await px.get_next_dist(q, emb[n], 3, mask=mask)
    out["dist"] = await px.get_next_dist(q, emb[n], 4)
    try:
        await px.sample(q, emb[n], mask=b"123")
    except px.ApiError as e:
        out["bad_mask"] = str(e)
    return json.dumps(out)
"""


def check(out: dict) -> None:
    allowed = set(out["allowed"])
    token, logprob, ids, lps = out["greedy"]
    assert token == out["plain"] == ids[0] and logprob == lps[0] and len(ids) == 5
    assert lps == sorted(lps, reverse=True)
    assert out["masked"][0] in allowed and len(out["masked"][2]) == 2
    assert out["masked"][2] == ids[:2]  # raw log-probabilities, before the mask
    assert out["long_mask"] == out["masked"][0]
    assert all(t in allowed for t in out["hot"]) and len(set(out["hot"])) > 1
    assert out["biased"] == out["allowed"][3]
    assert set(out["masked_dist"][0]) <= allowed
    assert out["penalized"][0][0] != token and out["dist"][0][0] == token
    assert out["nan_last"] and all(np.isfinite(out["prompt"][0]))
    assert all(len(r) == 3 for r in out["prompt"][1])
    assert "mask must be" in out["bad_mask"]


def test_output_functions_from_a_trusted_inferlet(make_tiny):
    eng = load_engine(make_tiny("llama"))
    events, _ = asyncio.run(run_all(eng, [(LOGITS, [])]))
    check(json.loads(result(events[0])))
