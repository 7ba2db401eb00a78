"""Every function of the inferlet API, called from inferlets on the trusted runner."""

from __future__ import annotations

import asyncio
import inspect
import json
import threading
from http.server import BaseHTTPRequestHandler, HTTPServer

import numpy as np
import pytest

from inferlet_util import load_engine, result, run_all, start
from pastry.api import API_FUNCTIONS, TRAITS, InferletApi
from pastry.api.types import RECORDS, wit_type
from pastry.control.events import Failed, Finished, Message, Terminated
from pastry.control.policies import BATCH_POLICIES, Adaptive, Eager, KOnly, TOnly
from pastry.control.session import Session
from pastry.runtime.trusted import Program, ProgramError

try:  # the session-scoped fixture that writes PEFT adapters
    from test_lora import adapters
except pytest.skip.Exception:  # peft is not installed

    @pytest.fixture
    def adapters():
        pytest.skip("peft is not installed")


# Language-neutral: WIT's scalars, and lists, tuples, options and records of them.
NEUTRAL = {"u8", "u16", "u32", "u64", "s32", "s64", "f32", "f64", "bool", "string", "bitmask"}


def _neutral(tree) -> bool:
    if isinstance(tree, str):
        return tree in NEUTRAL
    kind, *parts = tree
    if kind == "record":
        return parts[0] in RECORDS.values()
    return kind in ("list", "tuple", "option") and all(_neutral(p) for p in parts)


def test_session_implements_the_api_with_neutral_types():
    for name in API_FUNCTIONS:
        spec = inspect.signature(getattr(InferletApi, name))
        impl = inspect.signature(getattr(Session, name))
        assert list(spec.parameters) == list(impl.parameters), name
        for p in spec.parameters.values():
            if p.name in ("self", "options"):  # options: a record's fields as keywords
                continue
            assert _neutral(wit_type(p.annotation)), (name, p.name, p.annotation)
    traited = {f for fs in TRAITS.values() for f in fs}
    assert traited <= set(API_FUNCTIONS)


EVERYTHING = """
import json
import pastry.sdk as px

async def main(args):
    out = {}
    out["args"] = px.get_arguments()
    out["id"] = px.get_instance_id()
    out["version"] = px.get_version()
    model = px.available_models()[0]
    out["traits"] = px.available_traits(model)
    q = px.create_queue(model)
    px.set_queue_priority(q, 5)
    ps = px.get_kv_page_size(q)
    text = "Hello, world. The quick brown fox jumps over the lazy dog."
    toks = px.tokenize(q, text)
    out["roundtrip"] = px.detokenize(q, toks) == text
    vocab = px.get_vocabs(q)
    out["vocab_ok"] = b"".join(vocab[t] for t in toks).decode() == text
    out["eos"] = px.get_eos_token_ids(q)
    out["chat"] = px.apply_chat_template(q, [("user", "hi there")])
    # prefill 6 tokens, copy the first page token by token into a new page
    kv = px.alloc_kvpages(q, 2)
    emb = px.alloc_embeds(q, 8)
    await px.embed_txt(q, toks[:6], list(range(6)), emb[:6])
    await px.forward(q, [], 0, emb[:6], kv, 0, [emb[6]])
    copy = px.alloc_kvpages(q, 2)
    await px.copy_kvpage(q, kv[0], copy[0], 0, 0, ps)
    await px.copy_kvpage(q, kv[1], copy[1], 0, 0, 6 - ps)
    await px.synchronize(q)
    # the same next token on top of the copy
    await px.embed_txt(q, [toks[6]], [6], [emb[0]])
    await px.forward(q, kv, 6 - ps, [emb[0]], [], 0, [emb[6]])
    await px.forward(q, copy, 6 - ps, [emb[0]], [], 0, [emb[7]])
    a = await px.get_next_dist(q, emb[6], 5)
    b = await px.get_next_dist(q, emb[7], 5)
    out["copy_equal"] = a[0] == b[0] and max(abs(x - y) for x, y in zip(a[1], b[1])) < 1e-6
    out["greedy_is_top"] = (await px.sample(q, emb[6])) == a[0][0]
    # masking the first token changes the distribution; unmasking restores it
    await px.mask_kvpage(q, kv[0], [True] + [False] * (ps - 1))
    await px.forward(q, kv, 6 - ps, [emb[0]], [], 0, [emb[7]])
    c = await px.get_next_dist(q, emb[7], 5)
    out["mask_changes"] = c != a
    # export / import / list / unexport
    await px.export_kvpages(q, kv, "prefix", False)
    out["exports"] = px.list_exported_kvpages(q)
    again = px.import_kvpages(q, "prefix")
    out["imported"] = len(again)
    px.unexport_kvpages(q, "prefix")
    out["exports_after"] = px.list_exported_kvpages(q)
    await px.dealloc_kvpages(q, again)
    await px.dealloc_kvpages(q, kv + copy)
    await px.dealloc_embeds(q, emb)
    # key-value store and messaging (to itself: no subscribers but the sender)
    px.store_set("k", "v")
    out["store"] = [px.store_get("k"), px.store_exists("k"), px.store_list_keys(""), px.store_delete("k"), px.store_get("k")]
    sub = px.subscribe("topic")
    out["delivered"] = px.broadcast("topic", "hi")
    px.unsubscribe(sub)
    # the client
    px.send("ready")
    out["from_client"] = await px.receive()
    out["http"] = await px.http_get(args[0])
    out["http_post"] = await px.http_post(args[0], "payload")
    return json.dumps(out)
"""


class _Handler(BaseHTTPRequestHandler):
    def do_GET(self):
        self._reply(b"got " + self.path.encode())

    def do_POST(self):
        body = self.rfile.read(int(self.headers["Content-Length"]))
        self._reply(b"posted " + body)

    def _reply(self, body):
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *a):
        pass


@pytest.fixture
def http_server():
    srv = HTTPServer(("127.0.0.1", 0), _Handler)
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    yield f"http://127.0.0.1:{srv.server_address[1]}"
    srv.shutdown()


def test_every_function_from_an_inferlet(make_tiny, http_server):
    eng = load_engine(make_tiny("llama"))

    async def go():
        controller, rt, handle = await start(eng, http_allow=["127.0.0.1"])
        inst = rt.launch(Program.from_source("everything", EVERYTHING), [http_server + "/x"])
        events = []
        async for ev in inst.events():
            events.append(ev)
            if ev == Message("ready"):
                inst.send("hello inferlet")
        res = next(iter(controller.models.values())).resources
        res.check_integrity()
        used = res.referenced("kv"), res.referenced("embed")
        await controller.close()
        handle.close()
        return events, used

    events, used = asyncio.run(go())
    out = json.loads(result(events))
    assert events[0] == Message("ready")
    assert out["args"] == [http_server + "/x"] and out["id"] >= 1 and out["version"]
    assert "forward" in out["traits"] and "tokenize" in out["traits"]
    assert out["roundtrip"] and out["vocab_ok"]
    assert out["eos"]
    assert "hi there" in out["chat"] and out["chat"].count("<|im_start|>") == 2
    assert out["copy_equal"] and out["greedy_is_top"] and out["mask_changes"]
    assert out["exports"] == [["prefix", 2]] and out["imported"] == 2 and out["exports_after"] == []
    assert out["store"] == ["v", True, ["k"], True, None]
    assert out["delivered"] == 0  # the sender does not hear itself
    assert out["from_client"] == "hello inferlet"
    assert out["http"] == [200, "got /x"] and out["http_post"] == [200, "posted payload"]
    assert used == (0, 0)


DENIED = """
import pastry.sdk as px

async def main(args):
    try:
        await px.http_get("http://example.com/")
    except PermissionError as e:
        return "denied: " + str(e)
    return "allowed"
"""


def test_http_outside_the_allowlist_is_denied(make_tiny):
    events, _ = asyncio.run(run_all(load_engine(make_tiny("llama")), [(DENIED, [])]))
    assert result(events[0]).startswith("denied: ") and "example.com" in result(events[0])


EXPORTER = """
import pastry.sdk as px
from pastry.sdk import Context

async def main(args):
    ctx = Context()
    ctx.fill_tokens([int(t) for t in args[0].split(",")])
    await ctx.flush(keep_last=False)
    await px.export_kvpages(ctx.queue, ctx.pages, "system", True)
    px.broadcast("ready", "system")
    return "exported %d" % len(ctx.pages)
"""

IMPORTER = """
import pastry.sdk as px
from pastry.sdk import Context, MaxTokens

async def main(args):
    sub = px.subscribe("ready")
    name = await px.next_message(sub)
    ctx = Context()
    pages = px.import_kvpages(ctx.queue, name)
    prefix = [int(t) for t in args[0].split(",")]
    ctx.pages = list(pages)
    ctx.kv_len = len(prefix)
    ctx.tokens = list(prefix)
    ctx.fill_tokens([int(args[1])])
    await ctx.generate(stop=MaxTokens(4))
    return ",".join(map(str, ctx.tokens))
"""

PLAIN = """
from pastry.sdk import Context, MaxTokens

async def main(args):
    ctx = Context()
    ctx.fill_tokens([int(t) for t in args[0].split(",")] + [int(args[1])])
    await ctx.generate(stop=MaxTokens(4))
    return ",".join(map(str, ctx.tokens))
"""


def test_export_import_between_inferlets(make_tiny):
    """One inferlet exports a prefilled prefix (persistent) and tells others by broadcast;
    importers continue on the shared pages and get what a full prefill gives."""
    eng = load_engine(make_tiny("llama"))
    prefix = np.random.default_rng(3).integers(0, eng.info.vocab_size, 8).tolist()
    p = ",".join(map(str, prefix))
    launches = [(IMPORTER, [p, "5"]), (IMPORTER, [p, "9"]), (EXPORTER, [p])]
    events, controller = asyncio.run(run_all(eng, launches))
    assert result(events[2]) == "exported 2"
    plain, _ = asyncio.run(
        run_all(load_engine(make_tiny("llama")), [(PLAIN, [p, "5"]), (PLAIN, [p, "9"])])
    )
    assert result(events[0]) == result(plain[0]) and result(events[1]) == result(plain[1])
    res = next(iter(controller.models.values())).resources
    assert res.list_exports() == [("system", "kv", 2)]  # persistent: outlives its exporter
    res.check_integrity()


HOG = """
import pastry.sdk as px

async def main(args):
    q = px.create_queue(px.available_models()[0])
    px.alloc_kvpages(q, int(args[0]))
    px.send("allocated")
    more = int(await px.receive())
    if more:
        px.alloc_kvpages(q, more)
    return "finished"
"""


def test_out_of_pages_terminates_the_newest(make_tiny):
    """The paper's FCFS policy: when an older inferlet needs pages, the newest ones end
    (their client is told why); a newest requester that cannot be served gets an error."""
    eng = load_engine(make_tiny("llama"), num_pages=64)

    async def go():
        controller, rt, handle = await start(eng)
        prog = Program.from_source("hog", HOG)
        old = rt.launch(prog, ["40"])
        young = rt.launch(prog, ["20"])
        for inst in (old, young):
            assert await anext(inst.events()) == Message("allocated")
        newest = rt.launch(prog, ["30"])  # 4 free: the newest cannot be served
        old.send("10")  # needs 10, 4 free: the young one must go
        ends = [await i.wait() for i in (old, young, newest)]
        res = next(iter(controller.models.values())).resources
        res.check_integrity()
        await controller.close()
        handle.close()
        return ends

    old, young, newest = asyncio.run(go())
    assert isinstance(old, Finished), old
    assert isinstance(young, Terminated) and "FCFS" in young.reason, young
    assert isinstance(newest, Failed) and "cannot allocate 30 KV pages" in newest.error, newest


def test_program_errors_are_clear():
    with pytest.raises(ProgramError, match="syntax error at line 1"):
        Program.from_source("bad", "def main(:\n")
    with pytest.raises(ProgramError, match="async def main"):
        Program.from_source("bad", "def main(args): pass\n")


QUOTA = """
import pastry.sdk as px

async def main(args):
    q = px.create_queue(px.available_models()[0])
    await px.receive()
    px.alloc_kvpages(q, 2)
    try:
        px.alloc_kvpages(q, 1)
    except px.ApiError as e:
        return f"{type(e).__name__}: {e}"
"""


def test_a_session_limit_is_an_api_error_in_the_inferlet(make_tiny):
    eng = load_engine(make_tiny("llama"))

    async def go():
        controller, rt, handle = await start(eng)
        inst = rt.launch(Program.from_source("quota", QUOTA), [])
        inst.session.set_limit("kv", 2, "the test's limit")
        inst.send("go")
        end = await inst.wait()
        await controller.close()
        handle.close()
        return inst.id, end

    iid, end = asyncio.run(go())
    assert end == Finished(
        f"QuotaError: KV page quota exceeded: inferlet {iid} holds 2, asked for 1 more, quota 2 "
        "(set by the test's limit). Free KV pages it no longer needs, or raise the test's limit"
    )


@pytest.mark.parametrize(
    "policy", [Adaptive(), Eager(), KOnly(k=6, t_ms=2), TOnly(t_ms=2)], ids=BATCH_POLICIES
)
def test_every_policy_gives_the_same_tokens(make_tiny, policy):
    from test_inferlets import CONTEXT_TOKENS

    eng = load_engine(make_tiny("llama"))
    rng = np.random.default_rng(4)
    launches = [
        (CONTEXT_TOKENS, [",".join(map(str, rng.integers(0, 500, 5).tolist())), "5"])
        for _ in range(12)
    ]
    events, controller = asyncio.run(run_all(eng, launches, policy))
    ref, _ = asyncio.run(run_all(load_engine(make_tiny("llama")), launches))
    assert [result(e) for e in events] == [result(e) for e in ref]
    sched = next(iter(controller.models.values())).scheduler
    assert sched.batching is policy
    assert sched.stats.forward_items == 12 * 5  # a prefill and 4 decode steps each


ADAPTED = """
import json
import pastry.sdk as px

async def main(args):
    tokens = [int(t) for t in args[0].split(",")]
    q = px.create_queue(px.available_models()[0])
    n = len(tokens)
    emb = px.alloc_embeds(q, n + 2)
    await px.embed_txt(q, tokens, list(range(n)), emb[:n])
    f1 = px.forward(q, [], 0, emb[:n], [], 0, [emb[n]])
    f2 = px.forward_with_adapter(q, args[1], [], 0, emb[:n], [], 0, [emb[n + 1]])
    await f1; await f2
    base = await px.get_next_dist(q, emb[n], 8)
    lora = await px.get_next_dist(q, emb[n + 1], 8)
    try:
        px.forward_with_adapter(q, "nope", [], 0, emb[:n], [], 0, [])
    except px.ApiError as e:
        err = str(e)
    return json.dumps({"adapters": px.get_adapters(q), "base": base, "lora": lora, "err": err,
                       "traits": px.available_traits(px.available_models()[0])})
"""


def test_controller_sees_an_adapter_loaded_after_wrapping(adapters):
    """``EngineHandle.info`` is live: an in-process engine that loads an adapter after its
    handle was made reports it, and a controller built on the handle serves it."""
    from pastry.control.controller import Controller
    from pastry.wire.handle import InProcessEngine

    path, dirs = adapters("llama")
    eng = load_engine(path)
    with InProcessEngine(eng) as handle:
        assert handle.info.adapters == ()
        eng.load_adapter(dirs["all7"], name="late")
        assert handle.info.adapters == ("late",)

        async def served() -> dict[str, int]:
            controller = Controller([handle])
            try:
                return dict(controller.models[handle.info.model_name].adapters)
            finally:
                await controller.close()

        assert asyncio.run(served()) == {"late": 0}


def test_forward_with_adapter_from_an_inferlet(adapters):
    """The inferlet's adapted forward equals the engine's own adapted forward (which
    tests/test_lora.py checks against peft + transformers)."""
    from pastry.wire.calls import EmbedTxt, Forward, NextDist, ids

    path, dirs = adapters("llama")
    adapter_dir = dirs["all7"]
    eng = load_engine(path)
    eng.load_adapter(adapter_dir, name="mine")
    tokens = np.random.default_rng(6).integers(0, eng.info.vocab_size, 7).tolist()
    events, _ = asyncio.run(run_all(eng, [(ADAPTED, [",".join(map(str, tokens)), "mine"])]))
    out = json.loads(result(events[0]))
    assert out["adapters"] == ["mine"] and "forward_with_adapter" in out["traits"]
    assert "no adapter named 'nope'" in out["err"]
    n = len(tokens)
    res = eng.execute(
        [
            EmbedTxt(ids(tokens), ids(range(n)), ids(range(n))),
            Forward(
                in_embeds=ids(range(n)), out_embeds=ids([n]), out_indices=ids([n - 1]), adapter=0
            ),
            NextDist(n, k=8),
        ]
    )
    assert out["lora"][0] == res[2].ids.tolist()
    np.testing.assert_allclose(out["lora"][1], res[2].probs, atol=1e-6)
    assert out["lora"] != out["base"]


WRITER = """
import pastry.sdk as px

async def main(args):
    q = px.create_queue(px.available_models()[0])
    ps = px.get_kv_page_size(q)
    kv = px.alloc_kvpages(q, 4)
    emb = px.alloc_embeds(q, 4 * ps)
    toks = [int(t) for t in args[0].split(",")] * ps
    n = 4 * ps
    await px.embed_txt(q, toks[:n], list(range(n)), emb[:n])
    await px.forward(q, [], 0, emb[:n], kv, 0, [])
    await px.dealloc_kvpages(q, kv)
    return "wrote"
"""

READER = """
import pastry.sdk as px

async def main(args):
    q = px.create_queue(px.available_models()[0])
    ps = px.get_kv_page_size(q)
    kv = px.alloc_kvpages(q, 4)  # very likely the writer's old pages
    emb = px.alloc_embeds(q, 3)
    await px.embed_txt(q, [7], [4 * ps], [emb[0]])
    # claim the (never written) pages as context: nothing of the writer's may be seen
    await px.forward(q, kv, ps, [emb[0]], [], 0, [emb[1]])
    await px.forward(q, [], 0, [emb[0]], [], 0, [emb[2]])
    a = await px.get_next_dist(q, emb[1], 8)
    b = await px.get_next_dist(q, emb[2], 8)
    return repr((a, b))
"""


def test_fresh_pages_never_show_another_inferlets_kv(make_tiny):
    eng = load_engine(make_tiny("llama"), num_pages=8)
    events, _ = asyncio.run(run_all(eng, [(WRITER, ["3,1,4,1"])]))
    assert result(events[0]) == "wrote"
    events, _ = asyncio.run(run_all(eng, [(READER, [])]))
    (a_ids, a_p), (b_ids, b_p) = eval(result(events[0]))
    assert a_ids == b_ids
    np.testing.assert_allclose(a_p, b_p, atol=1e-6)


MUTATING = """
import pastry.sdk as px

async def main(args):
    q = px.create_queue(px.available_models()[0])
    emb = px.alloc_embeds(q, 6)
    slots = emb[:5]
    f1 = px.embed_txt(q, [5, 6, 7, 8, 9], [0, 1, 2, 3, 4], slots)
    if args[0] == "mutate":
        slots.reverse()  # after issuing, before it runs: must not change the call
    f2 = px.forward(q, [], 0, emb[:5], [], 0, [emb[5]])
    await f1; await f2
    return repr(await px.get_next_dist(q, emb[5], 4))
"""


def test_queued_calls_snapshot_their_arguments(make_tiny):
    eng = load_engine(make_tiny("llama"))
    events, _ = asyncio.run(run_all(eng, [(MUTATING, ["mutate"]), (MUTATING, ["keep"])]))
    (a_ids, a_p), (b_ids, b_p) = (eval(result(e)) for e in events)
    assert a_ids == b_ids
    np.testing.assert_allclose(a_p, b_p, rtol=1e-5)


def test_served_engine_process_loads_adapters(adapters, tmp_path):
    """`pastry serve --adapter NAME=DIR`: the engine process loads it, its info lists it,
    and inferlets reach it by name, with the same result as an in-process engine."""
    from pastry.server.service import PastryServer, ServerConfig

    path, dirs = adapters("llama")
    tokens = [5, 9, 13, 21, 34, 55, 89]
    arg = ",".join(map(str, tokens))

    async def go(in_process):
        cfg = ServerConfig(
            model=path, in_process=in_process, programs_dir=tmp_path / f"p{in_process}",
            trusted_uploads=True, adapters=(("mine", str(dirs["all7"])),),
            dtype="float32", num_pages=256, num_embeds=1024,
        )  # fmt: skip
        server = PastryServer(cfg)
        await server.start()
        try:
            server.registry.upload(ADAPTED, name="adapted")
            inst = server.launch("adapted", [arg, "mine"])
            end = await inst.wait()
            assert isinstance(end, Finished), end
            return json.loads(end.result)
        finally:
            await server.stop()

    remote, local = asyncio.run(go(False)), asyncio.run(go(True))
    assert remote["adapters"] == ["mine"]
    assert remote["lora"][0] == local["lora"][0]
    np.testing.assert_allclose(remote["lora"][1], local["lora"][1], atol=1e-6)
