"""LoRA adapters by name (issue 30, point 3) against PEFT on a tiny checkpoint, through a
live server: loaded and unloaded at runtime by operators (``/v1/load_lora_adapter``,
``/v1/unload_lora_adapter``), listed by ``/v1/models``, selected by ``model=`` on the
completions, chat, Responses and Messages endpoints, batched with base-model requests,
and never given the prefix cache's base-model K/V."""

from __future__ import annotations

import json
import threading
import urllib.error
import urllib.request

import pytest
import torch

from engine_util import hf_model
from pastry.control.users import Account, User
from server_util import integrity, running_server

peft = pytest.importorskip("peft")

OP, BOB = Account(User("op", operator=True), "tok-op"), Account(User("bob"), "tok-bob")
PROMPT = [5, 17, 33, 2, 41, 8, 19, 60, 7, 3, 12, 25, 30, 9, 14, 50, 21]  # > one page
N = 8


@pytest.fixture(scope="module")
def setup(make_tiny, tmp_path_factory):
    from peft import LoraConfig, get_peft_model

    ckpt = make_tiny("llama")
    root = tmp_path_factory.mktemp("lora-by-name")
    torch.manual_seed(0)
    cfg = LoraConfig(r=4, lora_alpha=16, init_lora_weights=False, task_type="CAUSAL_LM",
                     target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "down_proj"])  # fmt: skip
    get_peft_model(hf_model(ckpt), cfg).save_pretrained(root / "ad")
    with running_server(ckpt, root, users=(OP, BOB)) as (url, server):
        yield ckpt, root / "ad", url, server
        assert integrity(server) == (0, 0)


def greedy(ckpt, adapter, prompt: list[int], n: int) -> list[int]:
    """PEFT (or plain transformers) greedy continuation."""
    from peft import PeftModel

    model = hf_model(ckpt)
    if adapter is not None:
        model = PeftModel.from_pretrained(model, adapter).eval()
    toks = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            toks.append(int(model(torch.tensor([toks])).logits[0, -1].argmax()))
    return toks[len(prompt) :]


def post(url: str, path: str, body: dict, token: str = OP.token) -> tuple[int, object]:
    req = urllib.request.Request(url + path, json.dumps(body).encode(), {"content-type": "application/json", "authorization": f"Bearer {token}"})  # fmt: skip
    try:
        with urllib.request.urlopen(req) as r:
            data = r.read()
            status = r.status
    except urllib.error.HTTPError as e:
        data, status = e.read(), e.code
    try:
        return status, json.loads(data)
    except ValueError:
        return status, data.decode()


def get(url: str, path: str, token: str = OP.token) -> dict:
    req = urllib.request.Request(url + path, headers={"authorization": f"Bearer {token}"})
    with urllib.request.urlopen(req) as r:
        return json.loads(r.read())


def complete(url: str, model: str, prompt=PROMPT) -> dict:
    status, body = post(url, "/v1/completions", {"model": model, "prompt": prompt, "max_tokens": N, "temperature": 0, "ignore_eos": True})  # fmt: skip
    assert status == 200, body
    return body


def generated(url: str, model: str) -> str:
    return complete(url, model)["choices"][0]["text"]


def test_load_select_batch_and_unload(setup):
    ckpt, ad, url, server = setup
    base = server.models[0]
    # operators only; a bad directory names the field
    assert post(url, "/v1/load_lora_adapter", {"lora_name": "ad", "lora_path": str(ad)}, BOB.token)[0] == 403  # fmt: skip
    status, body = post(url, "/v1/load_lora_adapter", {"lora_name": "x", "lora_path": "/nonexistent"})  # fmt: skip
    assert status == 400 and body["error"]["param"] == "lora_path"
    status, body = post(url, "/v1/load_lora_adapter", {"lora_name": "ad", "lora_path": str(ad)})
    assert status == 200, body
    assert post(url, "/v1/load_lora_adapter", {"lora_name": "ad", "lora_path": str(ad)})[0] == 400  # fmt: skip
    cards = {c["id"]: c for c in get(url, "/v1/models")["data"]}
    assert cards["ad"]["parent"] == base and cards["ad"]["root"] == str(ad)
    assert get(url, "/v1/models/ad")["parent"] == base

    tok = server.controller.models[base].tokenizer
    want_base = tok.decode(greedy(ckpt, None, PROMPT, N))
    want_ad = tok.decode(greedy(ckpt, ad, PROMPT, N))
    assert want_base != want_ad  # the adapter changes the answer
    # the base model first: its prompt enters the prefix cache
    r = complete(url, base)
    assert r["choices"][0]["text"] == want_base and r["model"] == base
    # the adapter's request with the same prompt: none of the base model's K/V
    r = complete(url, "ad")
    assert r["model"] == "ad" and r["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    # both, at once (batched together), each equal to its reference
    got: dict[str, str] = {}

    def run(model: str) -> None:
        got[model] = generated(url, model)

    threads = [threading.Thread(target=run, args=(m,)) for m in (base, "ad")]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert got[base] == want_base and got["ad"] == want_ad
    # the base request again reuses its cache; the adapter's K/V never entered it
    r = complete(url, base)
    assert r["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    assert r["choices"][0]["text"] == want_base
    assert complete(url, "ad")["usage"]["prompt_tokens_details"]["cached_tokens"] == 0

    # the other endpoints select it by model= too
    status, body = post(url, "/v1/chat/completions", {"model": "ad", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3})  # fmt: skip
    assert status == 200 and body["model"] == "ad"
    status, body = post(url, "/v1/responses", {"model": "ad", "input": "Hi", "max_output_tokens": 3, "store": False})  # fmt: skip
    assert status == 200 and body["model"] == "ad"
    status, body = post(url, "/v1/messages", {"model": "ad", "max_tokens": 3, "messages": [{"role": "user", "content": "Hi"}]})  # fmt: skip
    assert status == 200 and body["model"] == "ad"

    # SGLang's /generate selects it by lora_path (one per prompt in a batch)
    sp = {"max_new_tokens": N, "temperature": 0, "ignore_eos": True}
    status, body = post(url, "/generate", {"input_ids": [PROMPT, PROMPT], "sampling_params": sp, "lora_path": [None, "ad"]})  # fmt: skip
    assert status == 200 and [b["text"] for b in body] == [want_base, want_ad], body
    status, body = post(url, "/generate", {"input_ids": PROMPT, "lora_path": "nope"})
    assert status == 400 and "lora_path" in str(body)

    # unloaded: gone from the list and from every endpoint
    assert post(url, "/v1/unload_lora_adapter", {"lora_name": "ad"}, BOB.token)[0] == 403
    assert post(url, "/v1/unload_lora_adapter", {"lora_name": "ad"})[0] == 200
    assert "ad" not in {c["id"] for c in get(url, "/v1/models")["data"]}
    status, body = post(url, "/v1/completions", {"model": "ad", "prompt": "x", "max_tokens": 1})
    assert status == 404 and body["error"]["code"] == "model_not_found"
    assert post(url, "/v1/unload_lora_adapter", {"lora_name": "ad"})[0] == 404
    # loaded again under the same name: a new id, the same answers
    assert post(url, "/v1/load_lora_adapter", {"lora_name": "ad", "lora_path": str(ad)})[0] == 200  # fmt: skip
    assert generated(url, "ad") == want_ad
    assert post(url, "/v1/unload_lora_adapter", {"lora_name": "ad"})[0] == 200


def test_runtime_loading_over_the_engine_wire(setup, tmp_path):
    """An engine process's adapters load and unload over ZeroMQ (Op.LOAD_ADAPTER /
    UNLOAD_ADAPTER) between batches; a bad directory is an error that says why."""
    import asyncio

    from pastry.engine.engine import Engine
    from pastry.engine.serve import serve
    from pastry.wire.config import EngineConfig
    from pastry.wire.handle import EngineError
    from pastry.wire.remote import RemoteEngine

    ckpt, ad, _, _ = setup
    engine = Engine.load(ckpt, EngineConfig(dtype="float32", num_pages=64, num_embeds=256))
    endpoint = f"ipc://{tmp_path}/engine.sock"
    thread = threading.Thread(target=serve, args=(engine, endpoint), daemon=True)
    thread.start()

    async def main() -> None:
        remote = await RemoteEngine.connect(endpoint, timeout=30)
        try:
            assert remote.info.adapters == ()
            info = await remote.load_adapter("ad", str(ad))
            assert info.adapters == ("ad",) and remote.info.adapters == ("ad",)
            with pytest.raises(EngineError, match=r"adapter_config\.json"):
                await remote.load_adapter("bad", str(tmp_path))
            with pytest.raises(EngineError, match="already loaded"):
                await remote.load_adapter("ad", str(ad))
            assert (await remote.unload_adapter("ad")).adapters == ("",)
            with pytest.raises(EngineError, match="no adapter named 'ad'"):
                await remote.unload_adapter("ad")
            assert (await remote.load_adapter("ad", str(ad))).adapters == ("", "ad")
        finally:
            await remote.shutdown()

    asyncio.run(main())
    thread.join(timeout=30)
    assert not thread.is_alive()


LANG_PROGRAM = """
from pastry.lang import function, gen, select


@function
def cont(s, prompt):
    s += prompt + gen("out", max_tokens=8, temperature=0, ignore_eos=True)
    s += select("pick", choices=[" yes", " no"])
"""


def test_pastry_lang_selects_the_adapter(setup, tmp_path):
    """pastry.lang from a client (the program shipped to the server, sandboxed): ``run(...,
    adapter=NAME)`` and ``Endpoint(adapter=NAME)`` generate what ``/v1/completions`` with
    ``model=NAME`` does (PEFT's answer, test above); without one, the base model's."""
    import importlib.util
    import sys

    from pastry.lang import Endpoint, ProgramError
    from pastry.runtime import build_pyrt

    try:
        build_pyrt.build()
    except build_pyrt.BuildError as e:
        pytest.skip(f"cannot build the Python runtime component: {e}")
    _, ad, url, server = setup
    base = server.models[0]
    path = tmp_path / "lang_lora_prog.py"
    path.write_text(LANG_PROGRAM)
    spec = importlib.util.spec_from_file_location("lang_lora_prog", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    assert post(url, "/v1/load_lora_adapter", {"lora_name": "lang-ad", "lora_path": str(ad)})[0] == 200  # fmt: skip
    text = "Once upon a time there was"
    want = {m: generated_text(url, m, text) for m in (base, "lang-ad")}
    assert want[base] != want["lang-ad"]
    ep, ep_ad = Endpoint(url, OP.token), Endpoint(url, OP.token, adapter="lang-ad")
    try:
        assert module.cont.run(prompt=text, backend=ep)["out"] == want[base]
        assert module.cont.run(prompt=text, backend=ep, adapter="lang-ad")["out"] == want["lang-ad"]
        assert module.cont.run(prompt=text, backend=ep_ad)["out"] == want["lang-ad"]
        states = module.cont.run_batch([{"prompt": text}] * 2, backend=ep, adapter="lang-ad")
        assert [s["out"] for s in states] == [want["lang-ad"]] * 2
        with pytest.raises(ProgramError, match="no adapter named 'nope'"):
            module.cont.run(prompt=text, backend=ep, adapter="nope")
    finally:
        ep.close()
        ep_ad.close()
        assert post(url, "/v1/unload_lora_adapter", {"lora_name": "lang-ad"})[0] == 200


def generated_text(url: str, model: str, prompt: str) -> str:
    status, body = post(url, "/v1/completions", {"model": model, "prompt": prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": True})  # fmt: skip
    assert status == 200, body
    return body["choices"][0]["text"]


def test_an_engine_process_loads_adapters_and_keeps_them_across_a_restart(make_tiny, tmp_path):
    """With the engine in its own process (``pastry serve``'s default), an adapter loaded at
    runtime serves, and the engine restarted after a SIGKILL has it again, under the same
    name, with the same answers."""
    import time

    from peft import LoraConfig, get_peft_model

    ckpt = make_tiny("llama")
    torch.manual_seed(1)
    cfg = LoraConfig(r=4, lora_alpha=16, init_lora_weights=False, task_type="CAUSAL_LM",
                     target_modules=["q_proj", "v_proj"])  # fmt: skip
    get_peft_model(hf_model(ckpt), cfg).save_pretrained(tmp_path / "ad")
    with running_server(ckpt, tmp_path, users=(OP,), in_process=False) as (url, server):
        status, body = post(url, "/v1/load_lora_adapter", {"lora_name": "ad", "lora_path": str(tmp_path / "ad")})  # fmt: skip
        assert status == 200, body
        tok = server.controller.models[server.models[0]].tokenizer
        want = tok.decode(greedy(ckpt, tmp_path / "ad", PROMPT, N))
        assert generated(url, "ad") == want
        engine = server.engines.processes[0]
        engine.kill()
        deadline = time.time() + 120
        while engine.restarts == 0 or engine.state != "up":
            assert time.time() < deadline, engine.last_failure
            time.sleep(0.1)
        assert generated(url, "ad") == want
        assert post(url, "/v1/unload_lora_adapter", {"lora_name": "ad"})[0] == 200
