"""The built-in inferlets ``text-completion`` and ``chat`` on the trusted runner."""

from __future__ import annotations

import asyncio
import json
from importlib import resources

import numpy as np
import pytest

from inferlet_util import load_engine, run_all
from pastry.control.events import Failed, Finished
from pastry.engine.generate import FusedGenerator, Request
from pastry.inferlets.text_completion import Deltas
from pastry.wire.tokenizer import Tokenizer

TEXT = resources.files("pastry.inferlets").joinpath("text_completion.py").read_text()
CHAT = resources.files("pastry.inferlets").joinpath("chat.py").read_text()


@pytest.fixture(scope="module")
def ckpt(make_tiny):
    return make_tiny("llama")


@pytest.fixture(scope="module")
def tok(ckpt):
    return Tokenizer.from_dir(ckpt)


def run(ckpt, *launches, **pools):
    """Run (source, options) launches together; each instance's (messages, result)."""
    args = [(src, [o] if isinstance(o, str) else [json.dumps(o)]) for src, o in launches]
    events, controller = asyncio.run(run_all(load_engine(ckpt, **pools), args))
    res = next(iter(controller.models.values())).resources
    res.check_integrity()
    assert res.referenced("kv") == 0 and res.referenced("embed") == 0  # everything released
    out = []
    for evs in events:
        *messages, end = evs
        assert isinstance(end, Finished), end
        out.append(([m.text for m in messages], end.result and json.loads(end.result)))
    return out


def fused_greedy(ckpt, tokens, n) -> list[int]:
    eng = load_engine(ckpt)
    req = Request(list(tokens), n, stop_ids=tuple(eng.info.eos_token_ids))
    FusedGenerator(eng.execute, eng.info, max_running=4).run([req])
    return req.output


def expected(tok, ckpt, tokens, n) -> tuple[str, str, int]:
    """Greedy (text, finish reason, completion tokens) from the fused reference loop."""
    out = fused_greedy(ckpt, tokens, n)
    eos = out[-1] in tok.eos_token_ids
    return tok.decode(out[:-1] if eos else out), "stop" if eos else "length", len(out)


def joined(messages: list[str], n: int) -> list[str]:
    """Streamed deltas, concatenated per choice."""
    texts = [""] * n
    for m in messages:
        d = json.loads(m)
        texts[d["index"]] += d["delta"]
    return texts


def test_greedy_matches_the_fused_reference(ckpt, tok):
    tokens = np.random.default_rng(0).integers(0, tok.vocab_size, 9).tolist()
    text, finish, used = expected(tok, ckpt, tokens, 12)
    [(messages, result)] = run(ckpt, (TEXT, {"prompt": tokens, "max_tokens": 12, "temperature": 0}))
    assert messages == []
    assert brief(result["choices"]) == [{"index": 0, "text": text, "finish_reason": finish}]
    assert result["usage"] == {
        "prompt_tokens": 9,
        "completion_tokens": used,
        "total_tokens": 9 + used,
        "prompt_tokens_details": {"cached_tokens": 0},
    }


def test_plain_words_stream_greedy_text(ckpt, tok):
    text, _, _ = expected(tok, ckpt, tok.encode("Once upon a time", True), 32)
    [(messages, result)] = run(ckpt, (TEXT, "Once upon a time"))
    assert result is None
    # streamed in pieces: one per token, or fewer when the program reads slower than its
    # run-ahead loop samples (the tokens merge)
    assert "".join(messages) == text and len(messages) > 1


def test_n_forks_share_the_prompt_pages(ckpt, tok):
    # 60 prompt tokens are 15 pages of 4; four unshared copies would need 4 * 17 pages, the
    # pool has 32: the choices fit only because the forks share the prompt's full pages.
    tokens = np.random.default_rng(1).integers(0, tok.vocab_size, 60).tolist()
    text, finish, _ = expected(tok, ckpt, tokens, 6)
    opts = {"prompt": tokens, "max_tokens": 6, "temperature": 0, "n": 4}
    [(_, result)] = run(ckpt, (TEXT, opts), num_pages=32)
    assert [c["text"] for c in result["choices"]] == [text] * 4
    assert [c["index"] for c in result["choices"]] == [0, 1, 2, 3]
    assert {c["finish_reason"] for c in result["choices"]} == {finish}
    assert result["usage"]["prompt_tokens"] == 60


def test_stop_strings_cut_the_text_and_the_stream(ckpt, tok):
    tokens = np.random.default_rng(2).integers(0, tok.vocab_size, 7).tolist()
    full, _, _ = expected(tok, ckpt, tokens, 24)
    stop = full[12:15]
    opts = {"prompt": tokens, "max_tokens": 24, "temperature": 0, "stream": True}
    [(messages, result)] = run(ckpt, (TEXT, {**opts, "stop": [stop, "never-generated"]}))
    [choice] = result["choices"]
    assert choice["text"] == full[: full.find(stop)] and choice["finish_reason"] == "stop"
    assert joined(messages, 1) == [choice["text"]]
    assert result["usage"]["completion_tokens"] < 24


def test_seeded_sampling_streams_reproducibly(ckpt):
    opts = {
        "prompt": "The quick brown fox",
        "max_tokens": 40,
        "temperature": 1.0,
        "seed": 3,
        "n": 3,
        "stream": True,
    }
    (m1, r1), (m2, r2) = run(ckpt, (TEXT, opts), (TEXT, opts))
    texts = [c["text"] for c in r1["choices"]]
    assert r1 == r2 and len(set(texts)) == 3  # the same draws each time, different per choice
    assert joined(m1, 3) == texts and joined(m2, 3) == texts
    assert len(m1) > 60  # streamed piece by piece, not at the end


def test_chat_renders_the_template(ckpt, tok):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}]
    prompt = tok.encode(tok.apply_chat_template(messages))
    text, finish, _ = expected(tok, ckpt, prompt, 10)
    got = run(
        ckpt,
        (CHAT, {"messages": messages, "max_tokens": 10, "temperature": 0}),
        (CHAT, {"messages": messages, "max_tokens": 10, "temperature": 0, "stream": True}),
        (CHAT, "Hi!"),
    )
    (_, plain), (streamed, result), (words, none) = got
    assert brief(plain["choices"]) == [{"index": 0, "text": text, "finish_reason": finish}]
    assert plain["usage"]["prompt_tokens"] == len(prompt)
    assert result == plain and joined(streamed, 1) == [text]
    assert none is None and words  # plain words: one user message, streamed as raw text


def test_unknown_options_fail_with_their_names(ckpt):
    events, _ = asyncio.run(run_all(load_engine(ckpt), [(TEXT, ['{"prompt": "a", "max": 3}'])]))
    end = events[0][-1]
    assert isinstance(end, Failed) and "unknown options ['max']" in end.error, end


def test_deltas_hold_back_partial_characters_and_stop_prefixes():
    # a byte-level vocabulary: "é" and "☃" (3 bytes) are split over several tokens
    vocab = [b"<eos>", b"H", b"\xc3", b"\xa9", b"\xe2\x98", b"\x83 ", b"ab", b"EN", b"D", b"x"]

    def detokenize(tokens):
        return b"".join(vocab[t] for t in tokens).decode(errors="replace")

    sent = []
    d = Deltas(sent.append, detokenize, eos_ids=[0], stops=["END"])  # holds back 2 characters
    tokens = []
    for t in [1, 2, 3, 4, 5, 6, 7, 8]:  # "H", "é" in 2, "☃ " in 2, "ab", "EN", "D"
        tokens.append(t)
        assert not d.should_stop(tokens, "")
    assert sent == ["Hé", "\u2603 ", "ab"]  # no partial character, nothing of "END"
    assert not d.should_stop([*tokens, 0], "")  # an end-of-sequence token sends nothing
    d.flush("Hé\u2603 ab")  # the final text, cut at the stop string
    assert "".join(sent) == "Hé\u2603 ab"

    sent = []
    d = Deltas(sent.append, detokenize, eos_ids=[0], stops=["ababababX"])
    for n in range(1, 5):
        d.should_stop([6] * n, "")
    assert sent == []  # all of "abababab" may still be the start of the stop string


def test_every_builtin_loads(tmp_path):
    """A built-in that fails to load is only logged by the server: catch it here."""
    from importlib import resources

    from pastry.server.registry import ProgramRegistry

    reg = ProgramRegistry(tmp_path)
    reg.add_builtins()
    files = [
        e.name
        for package in ("pastry.inferlets", "pastry.inferlets.routers")
        for e in resources.files(package).iterdir()
        if e.name.endswith(".py") and not e.name.startswith("_")
    ]
    assert len([p for p in reg.list() if p.builtin]) == len(files)
    with pytest.raises(Exception, match="built-in"):
        reg.upload("async def main(args): return 'x'\n", name="text-completion")


def brief(choices: list[dict]) -> list[dict]:
    return [{k: c[k] for k in ("index", "text", "finish_reason")} for c in choices]
