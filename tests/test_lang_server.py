"""pastry.lang against a live server: the same greedy program through pastry.lang in the
server (`pastry run file.py`), pastry.lang from a client, and SGLang's native API gives
the same text; SGLang's /generate, /get_model_info, /get_server_info, /flush_cache."""

from __future__ import annotations

import importlib.util
import itertools
import json
import re
import sys
import textwrap

import pytest
import requests

from pastry.cli import main as cli
from server_util import integrity, running_server

PROGRAM = textwrap.dedent(
    """
    import pastry.lang as sgl
    from pastry.lang import function, gen, select

    INTRO = "Story: "


    @function
    def complete(s, prompt):
        s += INTRO + prompt + gen("out", max_tokens=12)


    @function
    def rate(s, prompt):
        s += INTRO + prompt + "\\nRating:" + select("r", choices=[" good", " bad"])
        forks = s.fork(2)
        for i, f in enumerate(forks):
            f += " because" + gen("why", max_tokens=4)
        s += forks[0]["why"] + forks[1]["why"]


    @function
    def broken(s):
        s += "x" + gen("g", max_tokens=2, presence_penalty=5.0)
        s["g"]


    async def main(args):
        return await complete.main(args)
    """
)


@pytest.fixture(scope="module")
def server(make_tiny, tmp_path_factory):
    from pastry.runtime import build_pyrt

    try:
        build_pyrt.build()  # uploads (pastry run file.py) run in the sandbox
    except build_pyrt.BuildError as e:
        pytest.skip(f"cannot build the Python runtime component: {e}")
    with running_server(make_tiny("llama"), tmp_path_factory.mktemp("lang")) as s:
        yield s


@pytest.fixture(scope="module")
def program(tmp_path_factory):
    path = tmp_path_factory.mktemp("prog") / "stories.py"
    path.write_text(PROGRAM)
    spec = importlib.util.spec_from_file_location("stories_under_test", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return path, module


@pytest.fixture(scope="module")
def endpoint(server):
    from pastry.lang import Endpoint

    ep = Endpoint(server[0])
    yield ep
    ep.close()


def test_greedy_text_is_the_same_in_server_from_a_client_and_native(
    server, program, endpoint, capsys
):
    url, srv = server
    path, module = program
    prompt = "Once upon a time"
    # (a) in the server: the file is an inferlet (sandboxed, as uploads are by default)
    assert cli(["run", str(path), "--server", url, "--", f"prompt={prompt}", "temperature=0"]) == 0
    in_server = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    # (b) from a client: shipped to the server as an inferlet
    state = module.complete.run(prompt=prompt, temperature=0, backend=endpoint)
    # (c) SGLang's native API
    r = requests.post(
        url + "/generate",
        json={
            "text": "Story: " + prompt,
            "sampling_params": {"max_new_tokens": 12, "temperature": 0},
        },
        timeout=60,
    )
    assert r.status_code == 200, r.text
    native = r.json()
    assert in_server["variables"]["out"] == state["out"] == native["text"]
    assert in_server["text"] == state.text() == "Story: " + prompt + native["text"]
    assert (
        state.get_meta_info("out")["completion_tokens"] == native["meta_info"]["completion_tokens"]
    )
    assert integrity(srv)[0] == 0


def test_client_run_batch_streaming_and_forks(program, endpoint):
    _, module = program
    prompts = ["a dog", "a cat", "a fox"]
    states = module.rate.run_batch(
        [{"prompt": p} for p in prompts], temperature=0, backend=endpoint
    )
    one = [module.rate.run(prompt=p, temperature=0, backend=endpoint) for p in prompts]
    assert [s.text() for s in states] == [s.text() for s in one]
    assert all(s["r"] in (" good", " bad") for s in states)
    streamed = module.rate.run(prompt="a dog", temperature=0, backend=endpoint, stream=True)
    pieces = list(streamed.text_iter())
    assert len(pieces) >= 3 and "".join(pieces) == one[0].text()


def test_client_errors_name_the_problem(program, endpoint):
    from pastry.lang import ProgramError, function, gen
    from pastry.lang.ship import ShipError

    _, module = program
    with pytest.raises(ProgramError, match="presence_penalty"):
        module.broken.run(backend=endpoint)
    handle = open(__file__)  # noqa: SIM115  (a global that cannot travel)
    try:
        globals()["OPEN_FILE"] = handle

        @function
        def reads_a_file(s):
            s += OPEN_FILE.name + gen("x", max_tokens=1)  # noqa: F821

        with pytest.raises(ShipError, match="OPEN_FILE"):
            reads_a_file.run(backend=endpoint)
    finally:
        handle.close()
        globals().pop("OPEN_FILE", None)


def test_program_source_carries_what_the_program_reads(program):
    from pastry.lang.ship import program_source

    _, module = program
    src = program_source(module.rate)
    assert "INTRO = 'Story: '" in src and "def rate(s, prompt):" in src
    assert "async def main(args)" in src
    compile(src, "shipped", "exec")


# ---------------------------------------------------------------------- the native API


def post(url, body):
    return requests.post(url + "/generate", json=body, timeout=60)


def test_native_single_batch_n_and_input_ids(server):
    url, srv = server
    sp = {"max_new_tokens": 5, "temperature": 0}
    one = post(url, {"text": "Hello,", "sampling_params": sp}).json()
    assert set(one) == {"text", "output_ids", "meta_info"}
    meta = one["meta_info"]
    assert meta["completion_tokens"] == 5 and meta["finish_reason"] == {
        "type": "length",
        "length": 5,
    }
    assert {"id", "prompt_tokens", "cached_tokens", "e2e_latency"} <= set(meta)
    batch = post(url, {"text": ["Hello,", "World"], "sampling_params": {**sp, "n": 2}}).json()
    assert isinstance(batch, list) and len(batch) == 4
    assert batch[0]["text"] == batch[1]["text"] == one["text"]  # greedy: both samples agree
    ids = post(url, {"input_ids": one["output_ids"], "sampling_params": sp}).json()
    assert ids["meta_info"]["prompt_tokens"] == 5
    long = {"input_ids": list(range(3, 60)), "sampling_params": sp}  # the prefix cache
    first, again = post(url, long).json(), post(url, long).json()
    assert 0 < again["meta_info"]["cached_tokens"] < 57 and again["text"] == first["text"]
    stop_id = post(
        url, {"text": "Hello,", "sampling_params": {**sp, "stop_token_ids": one["output_ids"][2:3]}}
    ).json()
    assert stop_id["meta_info"]["finish_reason"] == {
        "type": "stop",
        "matched": one["output_ids"][2],
    }
    assert stop_id["output_ids"] == one["output_ids"][:3]
    assert integrity(srv)[0] == 0


def test_native_logprobs(server):
    url, _ = server
    body = {
        "text": "The quick brown fox",
        "sampling_params": {"max_new_tokens": 3, "temperature": 0},
        "return_logprob": True,
        "logprob_start_len": 0,
        "top_logprobs_num": 3,
        "return_text_in_logprobs": True,
    }
    r = post(url, body).json()
    m = r["meta_info"]
    n = m["prompt_tokens"]
    inp, out = m["input_token_logprobs"], m["output_token_logprobs"]
    assert len(inp) == n and inp[0][0] is None and all(lp <= 0 for lp, _, _ in inp[1:])
    assert [t for _, t, _ in out] == r["output_ids"]
    assert len(m["output_top_logprobs"]) == 3 and len(m["output_top_logprobs"][0]) == 3
    # greedy: the chosen token is the most likely one
    assert all(row[0][1] == t for row, (_, t, _) in zip(m["output_top_logprobs"], out, strict=True))
    assert m["input_top_logprobs"][0] is None and len(m["input_top_logprobs"]) == n
    default = post(url, {**body, "logprob_start_len": None}).json()["meta_info"]
    assert len(default["input_token_logprobs"]) == 1  # SGLang's default: the last prompt token


def test_native_stream(server):
    url, _ = server
    r = requests.post(
        url + "/generate",
        json={
            "text": "Hello,",
            "stream": True,
            "sampling_params": {"max_new_tokens": 6, "temperature": 0},
        },
        stream=True,
        timeout=60,
    )
    lines = [line.decode() for line in r.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    chunks = [json.loads(line[5:]) for line in lines[:-1]]
    texts = [c["text"] for c in chunks]
    assert all(b.startswith(a) for a, b in itertools.pairwise(texts))  # cumulative
    whole = post(
        url, {"text": "Hello,", "sampling_params": {"max_new_tokens": 6, "temperature": 0}}
    )
    assert texts[-1] == whole.json()["text"]


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ({"text": "x", "sampling_params": {"frequency_penalty": 2.5}}, "frequency_penalty"),
        ({"text": "x", "top_logprobs_num": 21, "return_logprob": True}, "top_logprobs_num"),
        ({"text": "x", "sampling_params": {"bogus": 1}}, "bogus"),
        ({"text": "x", "image_data": "abc"}, "image_data"),
        ({"text": "x", "what": 1}, "what"),
        ({"text": "x", "input_ids": [1]}, "exactly one"),
        ({"text": "x", "sampling_params": {"regex": "("}}, "regex"),
        ({"text": "x", "sampling_params": {"top_p": 0}}, "top_p"),
        ({"input_ids": [10**9]}, "input_ids"),
    ],
)
def test_native_refuses_what_it_cannot_do_by_name(server, body, message):
    r = post(server[0], body)
    assert r.status_code == 400 and message in r.json()["error"]["message"]


def test_native_info_and_flush(server):
    url, srv_ = server
    info = requests.get(url + "/get_model_info", timeout=10).json()
    assert info["is_generation"] is True and info["model_path"]
    srv = requests.get(url + "/get_server_info", timeout=10).json()
    assert srv["version"].startswith("pastry") and srv["page_size"] > 0
    cfg = srv_.config  # the schedule policy, not the batching one
    assert (srv["schedule_policy"], srv["batching_policy"]) == (cfg.schedule, cfg.policy)
    assert requests.post(url + "/flush_cache", timeout=10).status_code == 200


def test_flush_cache_frees_the_prefix_and_the_next_request_computes_it(server):
    """/flush_cache empties the prefix cache (not what programs hold) and says how much it
    freed: a prompt served from the cache before the flush is computed again after it."""
    url, srv = server
    body = {"input_ids": list(range(5, 5 + 70)), "sampling_params": {"max_new_tokens": 2}}
    post(url, body)  # its pages go to the cache when it ends
    again = post(url, body).json()["meta_info"]
    assert again["cached_tokens"] >= 64  # the full pages of the prompt (page size 16)
    text = requests.post(url + "/flush_cache", timeout=10).text
    freed = sum(int(n) for n in re.findall(r"engine \d+: (\d+)", text))
    assert text.startswith("Cache flushed. KV pages freed:") and freed >= 4, text
    res = srv.controller.models[srv.models[0]].resources
    assert res.cache.cached_pages == res.cache.referenced_pages  # nothing unused is left
    after = post(url, body).json()["meta_info"]
    assert after["cached_tokens"] == 0 and after["prompt_tokens"] == again["prompt_tokens"]


# ---------------------------------------------------------------------- native sampling fields


@pytest.fixture(scope="module")
def reference(make_tiny):
    """transformers on the server's checkpoint, and its tokenizer."""
    import torch

    from engine_util import hf_model
    from pastry.wire.tokenizer import Tokenizer

    ckpt = make_tiny("llama")
    hf = hf_model(ckpt)

    def logprobs(tokens: list[int]):
        with torch.no_grad():
            return torch.log_softmax(hf(torch.tensor([tokens])).logits[0].float(), -1)

    return Tokenizer.from_dir(ckpt), logprobs


def reference_greedy(logprobs, prompt, n, rep=1.0, freq=0.0, pres=0.0, bias=None) -> list[int]:
    """SGLang's (and vLLM's) penalties on transformers' logits, greedily: repetition over
    prompt and output, frequency and presence over the output."""
    import torch

    out: list[int] = []
    for _ in range(n):
        x = logprobs(prompt + out)[-1].double()  # log-softmax: logits up to a constant
        x = x - x.max() + 5.0  # positive and negative values, as logits have
        for t, b in (bias or {}).items():
            x[t] += b
        counts = torch.bincount(torch.tensor(out, dtype=torch.long), minlength=len(x)).double()
        seen = counts > 0
        seen[prompt] = True
        x = torch.where(seen, torch.where(x > 0, x / rep, x * rep), x)
        x = x - freq * counts - pres * (counts > 0).double()
        out.append(int(x.argmax()))
    return out


def test_native_logprobs_equal_transformers(server, reference):
    """Input and output log-probabilities (and top ones) come from the device and equal
    transformers' log_softmax; SGLang's shapes: [logprob, token, text or null]."""
    tok, logprobs = reference
    prompt = tok.encode("The quick brown fox jumps over")
    body = {
        "input_ids": prompt,
        "sampling_params": {"max_new_tokens": 4, "temperature": 0},
        "return_logprob": True,
        "logprob_start_len": 0,
        "top_logprobs_num": 4,
    }
    r = post(server[0], body).json()
    out, m = r["output_ids"], r["meta_info"]
    ref = logprobs(prompt + out)
    inp = m["input_token_logprobs"]
    assert inp[0] == [None, prompt[0], None]
    for i in range(1, len(prompt)):
        lp, t, text = inp[i]
        assert t == prompt[i] and text is None
        assert lp == pytest.approx(float(ref[i - 1, t]), abs=1e-4)
        top = m["input_top_logprobs"][i]
        want = ref[i - 1].topk(4)
        assert [t for _, t, _ in top] == want.indices.tolist()
        assert [lp for lp, _, _ in top] == pytest.approx(want.values.tolist(), abs=1e-4)
    for j, (lp, t, _) in enumerate(m["output_token_logprobs"]):
        row = ref[len(prompt) - 1 + j]
        assert t == out[j] == int(row.argmax())
        assert lp == pytest.approx(float(row[t]), abs=1e-4)
        assert [x[1] for x in m["output_top_logprobs"][j]] == row.topk(4).indices.tolist()
    # from a later start: only the tokens from there on are scored, with the same values
    later = post(server[0], {**body, "logprob_start_len": 3}).json()["meta_info"]
    assert later["input_token_logprobs"][0] == [None, prompt[3], None]
    got = later["input_token_logprobs"][1:]
    assert [t for _, t, _ in got] == [t for _, t, _ in inp[4:]]
    assert [lp for lp, _, _ in got] == pytest.approx([lp for lp, _, _ in inp[4:]], abs=1e-5)
    # sampled: the chosen token's log-probability under the model (before processing)
    hot = {**body, "sampling_params": {"max_new_tokens": 1, "temperature": 1.5, "top_k": 5,
                                       "sampling_seed": 3}}  # fmt: skip
    h = post(server[0], hot).json()
    [(lp, t, _)] = h["meta_info"]["output_token_logprobs"]
    assert lp == pytest.approx(float(ref[len(prompt) - 1, t]), abs=1e-4)


def test_native_penalties_and_bias_match_a_reference(server, reference):
    tok, logprobs = reference
    prompt = tok.encode("The capital of France is")
    first = reference_greedy(logprobs, prompt, 1)[0]
    cases = [
        dict(rep=1.8),
        dict(freq=1.5),
        dict(pres=1.2),
        dict(rep=1.3, freq=0.5, pres=0.4, bias={first: -5.0}),
    ]
    for case in cases:
        want = reference_greedy(logprobs, prompt, 8, **case)
        sp = {
            "max_new_tokens": 8,
            "temperature": 0,
            "repetition_penalty": case.get("rep", 1.0),
            "frequency_penalty": case.get("freq", 0.0),
            "presence_penalty": case.get("pres", 0.0),
            "logit_bias": {str(t): b for t, b in (case.get("bias") or {}).items()},
        }
        r = post(server[0], {"input_ids": prompt, "sampling_params": sp}).json()
        assert r["output_ids"] == want, case
    assert want != reference_greedy(logprobs, prompt, 8)  # the penalties changed something


def test_native_top_k_min_p_stop_tokens_ignore_eos_min_new_tokens(server, reference):
    tok, logprobs = reference
    url = server[0]
    prompt = tok.encode("The capital of France is")
    greedy = reference_greedy(logprobs, prompt, 6)
    for extra in ({"top_k": 1}, {"min_p": 1.0}):  # sampling hot, but only the top token is left
        sp = {"max_new_tokens": 6, "temperature": 1.0, "sampling_seed": 3, **extra}
        assert post(url, {"input_ids": prompt, "sampling_params": sp}).json()["output_ids"] == (
            greedy
        ), extra
    eos = tok.eos_token_ids[0]
    sp = {"max_new_tokens": 5, "temperature": 0, "logit_bias": {str(eos): 100}}
    r = post(url, {"input_ids": prompt, "sampling_params": sp}).json()
    assert r["output_ids"] == [eos] and r["text"] == ""
    assert r["meta_info"]["finish_reason"] == {"type": "stop", "matched": eos}
    r = post(url, {"input_ids": prompt, "sampling_params": {**sp, "ignore_eos": True}}).json()
    assert r["output_ids"] == [eos] * 5
    assert r["meta_info"]["finish_reason"] == {"type": "length", "length": 5}
    r = post(url, {"input_ids": prompt, "sampling_params": {**sp, "min_new_tokens": 3}}).json()
    assert len(r["output_ids"]) == 4 and r["output_ids"][-1] == eos
    assert eos not in r["output_ids"][:3]
    # a stop token is banned before min_new_tokens too
    sp = {"max_new_tokens": 6, "temperature": 0, "stop_token_ids": [greedy[0]]}
    r = post(url, {"input_ids": prompt, "sampling_params": sp}).json()
    assert r["output_ids"] == greedy[:1]
    r = post(url, {"input_ids": prompt, "sampling_params": {**sp, "min_new_tokens": 2}}).json()
    assert r["output_ids"][0] != greedy[0]


def test_native_regex_with_logprobs_and_sampling(server):
    """A grammar combines with every other field: the output matches, each token sampled
    (no fast-forward) has its log-probability."""
    import re

    sp = {"max_new_tokens": 12, "temperature": 1.2, "top_p": 0.9, "sampling_seed": 5,
          "regex": r"[a-c]{2}-[0-9]{3}", "frequency_penalty": 0.5}  # fmt: skip
    body = {"text": "Code:", "sampling_params": sp, "return_logprob": True}
    r = post(server[0], body).json()
    assert re.fullmatch(r"[a-c]{2}-[0-9]{3}", r["text"]), r["text"]
    lps = r["meta_info"]["output_token_logprobs"]
    assert [t for _, t, _ in lps] == r["output_ids"] and all(lp <= 0 for lp, _, _ in lps)
    assert r["meta_info"]["finish_reason"]["type"] == "stop"
