"""The guest side of the generic Python runtime ("pyrt"): runs inside WebAssembly.

Built into a component by :mod:`pastry.runtime.build_pyrt` together with the pure-Python
parts of ``pastry`` (``pastry.api`` and ``pastry.sdk`` without ``grammar``), so inferlets
run the *same* SDK as trusted ones. Two exports (world ``python-runtime`` of
``wit/pastry.wit``):

- ``compile-source`` checks an inferlet's source (syntax, ``async def main(args)``) and
  compiles it to a marshalled code object. The host runs it once per program, in its own
  instance, so tenant source is never parsed by the host (a pathological source only burns
  this instance's CPU and memory budget).
- ``serve`` is what a pre-started instance runs: it warms up (runs what a launch runs,
  so that work is done before a launch asks for it), blocks in the host's
  ``load-inferlet`` until the host gives it an inferlet, executes its module, blocks in
  ``start-inferlet`` until a launch (at once if the launch is what gave it the inferlet;
  later if the host loaded it ahead of its launches), and runs ``main(args)`` on
  :class:`GuestLoop`, an asyncio event loop whose only way to wait is the host's
  ``wait-take``: while the inferlet waits, its Wasmtime fiber is suspended and the host
  runs other inferlets and the batch scheduler.

Queued API calls return asyncio futures at once (the host returns a ``pending`` handle),
so ``asyncio.gather`` over embed, forward and sample submits them all before waiting, as
in the trusted runner. Every import is called through :func:`_call`, which checks the
arguments against the WIT signature first (``pyrt_sigs``, generated from the WIT at build
time): a value the import cannot take (a negative handle, a number over 32 bits, a string
for a number) is an :class:`ApiError` naming it, not a trap of the whole instance.
``time.sleep`` waits on the host's timer (the fiber is parked; the server goes on). This
module never runs on the host (it imports the generated ``wit_world`` bindings).
"""

from __future__ import annotations

import array
import ast
import asyncio
import asyncio.base_events
import collections
import contextlib
import contextvars
import dataclasses
import functools
import heapq
import itertools
import json
import linecache
import marshal
import math
import os
import random
import re
import string
import sys
import time
import traceback
import types
import typing
import weakref

import wit_world
from componentize_py_types import Err, Ok
from pyrt_sigs import SIGNATURES
from wit_world.imports import api as host
from wit_world.imports import launcher

import pastry.lang  # in the snapshot, so that inferlets can import it
import pastry.sdk
import pastry.sdk.args  # only what the snapshot imported can be imported later
import pastry.sdk.grammar
import pastry.sdk.router  # routers run sandboxed too (uploaded routers)
from pastry.api import ApiError

# Modules imported here (or by pastry.sdk) are in the snapshot; nothing else of the
# standard library can be imported by an inferlet.
STDLIB = (
    asyncio, collections, contextvars, dataclasses, functools, heapq, itertools, json, math,
    random, re, string, time, typing, weakref,
)  # fmt: skip

U32 = 0xFFFFFFFF


# ---------------------------------------------------------------------------- argument checks


def _u32_list(v) -> bool:
    """A list of integers from 0 to 2**32-1 (array("I") checks every element, in C)."""
    if type(v) is not list:
        return False
    try:
        array.array("I", v)
    except (TypeError, OverflowError):
        return False
    return True


assert array.array("I").itemsize == 4


def _checker(ty):
    """A predicate for values the binding of WIT type ``ty`` (a parsed type, see
    ``build_pyrt.wit_signatures``) accepts without trapping."""
    if isinstance(ty, str):
        bounds = {"u8": (0, 0xFF), "u16": (0, 0xFFFF), "u32": (0, U32), "u64": (0, 2**64 - 1),
                  "s8": (-(2**7), 2**7 - 1), "s16": (-(2**15), 2**15 - 1),
                  "s32": (-(2**31), 2**31 - 1), "s64": (-(2**63), 2**63 - 1)}  # fmt: skip
        if ty in bounds:
            lo, hi = bounds[ty]
            return lambda v: type(v) is int and lo <= v <= hi
        if ty in ("f32", "f64"):
            return lambda v: type(v) is float or type(v) is int
        if ty == "bool":
            return lambda v: type(v) is bool
        if ty in ("string", "char"):
            return lambda v: type(v) is str
        return lambda v: True  # a named type (record, variant): left to the binding
    kind, *parts = ty
    if kind == "list":
        if parts[0] == "u32":  # the common case (handles, tokens): checked in C
            return _u32_list
        each = _checker(parts[0])
        return lambda v: type(v) is list and all(each(x) for x in v)
    if kind == "option":
        inner = _checker(parts[0])
        return lambda v: v is None or inner(v)
    if kind == "tuple":
        items = [_checker(p) for p in parts]
        return lambda v: (
            type(v) in (tuple, list)
            and len(v) == len(items)
            and all(c(x) for c, x in zip(items, v, strict=True))
        )
    return lambda v: True


_SCALARS = {
    "u8": ("an integer from 0 to 255", "integers from 0 to 255"),
    "u16": ("an integer from 0 to 65535", "integers from 0 to 65535"),
    "u32": ("an integer from 0 to 2**32-1", "integers from 0 to 2**32-1"),
    "u64": ("an integer from 0 to 2**64-1", "integers from 0 to 2**64-1"),
    "s32": ("an integer from -2**31 to 2**31-1", "integers from -2**31 to 2**31-1"),
    "s64": ("an integer from -2**63 to 2**63-1", "integers from -2**63 to 2**63-1"),
    "f32": ("a number", "numbers"),
    "f64": ("a number", "numbers"),
    "bool": ("a bool", "bools"),
    "string": ("a string", "strings"),
}


def _describe(ty, plural: bool = False) -> str:
    if isinstance(ty, str):
        one, many = _SCALARS.get(ty, (ty, ty + "s"))
        return many if plural else one
    kind, *parts = ty
    if kind == "list":
        return ("lists of " if plural else "a list of ") + _describe(parts[0], True)
    if kind == "option":
        return f"None or {_describe(parts[0], plural)}"
    inner = ", ".join(_describe(p) for p in parts)
    return f"tuples ({inner})" if plural else f"a tuple ({inner})"


def _checks(sig):
    params = [(name.replace("-", "_"), ty, _checker(ty)) for name, ty in sig]

    def check(fname: str, args: tuple) -> None:
        for (name, ty, ok), v in zip(params, args, strict=False):
            if not ok(v):
                raise ApiError(
                    f"{fname}: {name} must be {_describe(ty)}, got {_short(v)}"
                ) from None

    return check


def _short(v) -> str:
    r = repr(v)
    return r if len(r) <= 60 else r[:57] + "..."


CHECKS = {name.replace("-", "_"): _checks(sig) for name, sig in SIGNATURES.items()}


def _call(fn, *args):
    """Call a host import: arguments checked against its WIT signature, its ``err``
    turned into the SDK's :class:`ApiError`."""
    name = fn.__name__
    check = CHECKS.get(name)
    if check is not None:
        check(name, args)
    try:
        return fn(*args)
    except Err as e:
        raise ApiError(e.value) from None


# ---------------------------------------------------------------------------- the event loop


class _HostSelector:
    """Stands in for the loop's selector: waiting = the host's blocking ``wait-take``."""

    def __init__(self, loop: GuestLoop) -> None:
        self.loop = loop

    def select(self, timeout: float | None) -> list:
        loop = self.loop
        if timeout is not None and timeout <= 0:
            return []
        if not loop.pending and timeout is None:
            raise RuntimeError(
                "the inferlet waits for nothing: no API call is in flight and no task "
                "can make progress (a deadlock in the inferlet)"
            )
        ns = None if timeout is None else int(timeout * 1e9)
        pending = loop.pending
        for pid, outcome in host.wait_take(ns):
            fut = pending.pop(pid, None)
            if fut is None or fut.done():
                continue
            if isinstance(outcome, Ok):
                fut.set_result(_unwrap(outcome.value))
            else:
                fut.set_exception(ApiError(outcome.value))
        return []


def _mapped(fut: asyncio.Future, fn) -> asyncio.Future:
    """A future of ``fn(result)`` of ``fut``."""
    out = fut.get_loop().create_future()

    def done(f):
        if f.exception() is not None:
            out.set_exception(f.exception())
        else:
            out.set_result(fn(f.result()))

    fut.add_done_callback(done)
    return out


def _unwrap(v):
    if isinstance(v, host.Value_Dist):
        ids, probs = v.value
        return list(ids), list(probs)
    if isinstance(v, host.Value_Http):
        return tuple(v.value)
    if isinstance(v, wit_world.imports.api.Value_Sampled):
        token, logprob, ids, lps = v.value
        return token, logprob, list(ids), list(lps)
    if isinstance(v, wit_world.imports.api.Value_Logprobs):
        lps, ids, tops = v.value
        return list(lps), [list(r) for r in ids], [list(r) for r in tops]
    return getattr(v, "value", None)


class GuestLoop(asyncio.base_events.BaseEventLoop):
    """A complete asyncio loop (tasks, futures, gather, timers) without sockets."""

    def __init__(self) -> None:
        super().__init__()
        self.pending: dict[int, asyncio.Future] = {}
        self._selector = _HostSelector(self)

    def _process_events(self, event_list) -> None:
        pass

    def _write_to_self(self) -> None:
        pass

    def track(self, pid: int) -> asyncio.Future:
        fut = self.create_future()
        self.pending[pid] = fut
        return fut


def _sleep(seconds: float) -> None:
    """``time.sleep`` in the sandbox: the host parks this instance on its own timer."""
    seconds = float(seconds)
    if not seconds >= 0:
        raise ValueError("sleep length must be non-negative")
    host.wait([], int(min(seconds, 1e9) * 1e9))


time.sleep = _sleep


class GuestApi:
    """:class:`pastry.api.InferletApi` over the host imports (see ``wit/pastry.wit``)."""

    def __init__(self, loop: GuestLoop) -> None:
        self.loop = loop

    def _queued(self, fn, *args) -> asyncio.Future:
        return self.loop.track(_call(fn, *args))

    # runtime
    def get_arguments(self):
        return list(host.get_arguments())

    def get_instance_id(self):
        return host.get_instance_id()

    def get_version(self):
        return host.get_version()

    def send(self, message):
        if not isinstance(message, str):
            raise ApiError(f"send takes a string, got {type(message).__name__}")
        _call(host.send, message)

    def receive(self):
        return self.loop.track(_call(host.receive))

    def available_models(self):
        return list(host.available_models())

    def available_traits(self, model):
        return list(_call(host.available_traits, model))

    def create_queue(self, model, engine=-1):
        if engine == -1:
            return _call(host.create_queue, model)
        return _call(host.create_queue_on, model, engine)

    def synchronize(self, q):
        return self._queued(host.synchronize, q)

    def set_queue_priority(self, q, priority):
        _call(host.set_queue_priority, q, int(priority))

    def close_queue(self, q):
        _call(host.close_queue, q)

    # allocate
    def get_kv_page_size(self, q):
        return _call(host.get_kv_page_size, q)

    def alloc_kvpages(self, q, n):
        return list(_call(host.alloc_kvpages, q, n))

    def dealloc_kvpages(self, q, pages):
        return self._queued(host.dealloc_kvpages, q, list(pages))

    def alloc_embeds(self, q, n):
        return list(_call(host.alloc_embeds, q, n))

    def dealloc_embeds(self, q, embeds):
        return self._queued(host.dealloc_embeds, q, list(embeds))

    def copy_kvpage(self, q, src, dst, src_offset, dst_offset, size):
        return self._queued(host.copy_kvpage, q, src, dst, src_offset, dst_offset, size)

    def export_kvpages(self, q, pages, name, persistent=False):
        return self._queued(host.export_kvpages, q, list(pages), name, bool(persistent))

    def import_kvpages(self, q, name):
        return list(_call(host.import_kvpages, q, name))

    def unexport_kvpages(self, q, name):
        _call(host.unexport_kvpages, q, name)

    def list_exported_kvpages(self, q):
        return [tuple(x) for x in _call(host.list_exported_kvpages, q)]

    # forward
    def forward(self, q, in_kv, in_kv_last_len, in_embeds, out_kv, out_kv_offset, out_embeds,
                mask=None, logprob_targets=None, logprob_top=0):  # fmt: skip
        m = None if mask is None else [[bool(x) for x in row] for row in mask]
        if logprob_targets is not None:
            return self._queued(
                host.forward_with_logprobs, q, None, list(in_kv), in_kv_last_len,
                list(in_embeds), list(out_kv), out_kv_offset, list(out_embeds), m,
                [int(t) for t in logprob_targets], int(logprob_top),
            )  # fmt: skip
        return self._queued(
            host.forward, q, list(in_kv), in_kv_last_len, list(in_embeds), list(out_kv),
            out_kv_offset, list(out_embeds), m,
        )  # fmt: skip

    def forward_with_adapter(self, q, adapter, in_kv, in_kv_last_len, in_embeds, out_kv,
                             out_kv_offset, out_embeds, mask=None, logprob_targets=None,
                             logprob_top=0):  # fmt: skip
        m = None if mask is None else [[bool(x) for x in row] for row in mask]
        if logprob_targets is not None:
            return self._queued(
                host.forward_with_logprobs, q, adapter, list(in_kv), in_kv_last_len,
                list(in_embeds), list(out_kv), out_kv_offset, list(out_embeds), m,
                [int(t) for t in logprob_targets], int(logprob_top),
            )  # fmt: skip
        return self._queued(
            host.forward_with_adapter, q, adapter, list(in_kv), in_kv_last_len,
            list(in_embeds), list(out_kv), out_kv_offset, list(out_embeds), m,
        )  # fmt: skip

    def get_adapters(self, q):
        return list(_call(host.get_adapters, q))

    def mask_kvpage(self, q, page, mask):
        return self._queued(host.mask_kvpage, q, page, [bool(x) for x in mask])

    def prefill(self, q, tokens, kv_len, pages, out_embeds, reserve=0):
        new, pid = _call(
            host.prefill, q, list(tokens), kv_len, list(pages), list(out_embeds), reserve
        )
        return list(new), self.loop.track(pid)

    # input text, tokenize
    def embed_txt(self, q, tokens, positions, embeds):
        return self._queued(host.embed_txt, q, list(tokens), list(positions), list(embeds))

    def tokenize(self, q, text, add_special_tokens=False):
        return list(_call(host.tokenize, q, text, bool(add_special_tokens)))

    def detokenize(self, q, tokens):
        return _call(host.detokenize, q, list(tokens))

    def get_vocabs(self, q):
        return [bytes(b) for b in _call(host.get_vocabs, q)]

    def get_eos_token_ids(self, q):
        return list(_call(host.get_eos_token_ids, q))

    def get_vocab_size(self, q):
        return _call(host.get_vocab_size, q)

    def apply_chat_template(self, q, messages, add_generation_prompt=True):
        msgs = [(str(r), str(c)) for r, c in messages]
        return _call(host.apply_chat_template, q, msgs, bool(add_generation_prompt))

    # output
    def get_next_dist(self, q, embed, k=256, mask=None, logit_bias=None, penalty_tokens=None,
                      penalty_prompt=None, repetition_penalty=1.0, frequency_penalty=0.0,
                      presence_penalty=0.0):  # fmt: skip
        proc = _processing(
            mask, logit_bias, penalty_tokens, penalty_prompt, repetition_penalty,
            frequency_penalty, presence_penalty,
        )  # fmt: skip
        if proc is None:
            return self._queued(host.get_next_dist, q, embed, k)
        return self._queued(host.get_next_dist_with, q, embed, k, *proc)

    def sample(self, q, embed, temperature=0.0, top_k=0, top_p=1.0, min_p=0.0, seed=None,
               mask=None, logit_bias=None, penalty_tokens=None, penalty_prompt=None,
               repetition_penalty=1.0, frequency_penalty=0.0, presence_penalty=0.0,
               logprobs=None, constraint=None):  # fmt: skip
        args = (
            q, embed, float(temperature), int(top_k), float(top_p), float(min_p),
            None if seed is None else int(seed),
        )  # fmt: skip
        extras = _sample_extras(
            mask, logit_bias, penalty_tokens, penalty_prompt, repetition_penalty,
            frequency_penalty, presence_penalty, logprobs, constraint,
        )  # fmt: skip
        if extras is None:
            return self._queued(host.sample, *args)
        if constraint is not None:
            return self._queued(host.sample_constrained, *args, *extras, int(constraint))
        return self._queued(host.sample_with, *args, *extras)

    def step(self, q, tokens, positions, in_embeds, in_kv, in_kv_last_len, out_kv,
             out_kv_offset, out_embed, temperature=0.0, top_k=0, top_p=1.0, min_p=0.0,
             seed=None, mask=None, logit_bias=None, penalty_tokens=None, penalty_prompt=None,
             repetition_penalty=1.0, frequency_penalty=0.0, presence_penalty=0.0,
             logprobs=None, constraint=None):  # fmt: skip
        args = (
            q, list(tokens), list(positions), list(in_embeds), list(in_kv), in_kv_last_len,
            list(out_kv), out_kv_offset, out_embed, float(temperature), int(top_k),
            float(top_p), float(min_p), None if seed is None else int(seed),
        )  # fmt: skip
        extras = _sample_extras(
            mask, logit_bias, penalty_tokens, penalty_prompt, repetition_penalty,
            frequency_penalty, presence_penalty, logprobs, constraint,
        )  # fmt: skip
        if extras is None:
            return self._queued(host.step, *args)
        c = None if constraint is None else int(constraint)
        return self._queued(host.step_with, *args, *extras, c)

    # grammar constraints
    def create_constraint(self, q, grammar):
        return _call(host.create_constraint, q, grammar)

    def constraint_state(self, c):
        complete, stopped, forced = _call(host.constraint_state, c)
        return complete, stopped, list(forced)

    def constraint_consume(self, c, tokens):
        _call(host.constraint_consume, c, [int(t) for t in tokens])

    def constraint_mask(self, c):
        return b"".join(w.to_bytes(4, "little") for w in _call(host.constraint_mask, c))

    def free_constraint(self, c):
        _call(host.free_constraint, c)

    # messaging
    def broadcast(self, topic, message):
        return _call(host.broadcast, topic, message)

    def subscribe(self, topic):
        return _call(host.subscribe, topic)

    def next_message(self, sub):
        return self._queued(host.next_message, sub)

    def unsubscribe(self, sub):
        _call(host.unsubscribe, sub)

    # key-value store
    def store_get(self, key):
        return _call(host.store_get, key)

    def store_set(self, key, value):
        _call(host.store_set, key, value)

    def store_delete(self, key):
        return _call(host.store_delete, key)

    def store_exists(self, key):
        return _call(host.store_exists, key)

    def store_list_keys(self, prefix=""):
        return list(_call(host.store_list_keys, prefix))

    # http
    def http_get(self, url):
        return self.loop.track(_call(host.http_get, url))

    def http_post(self, url, body):
        return self.loop.track(_call(host.http_post, url, body))

    # several engines
    def available_engines(self, model):
        return _call(host.available_engines, model)

    def get_queue_engine(self, q):
        return _call(host.get_queue_engine, q)

    def get_engine_load(self, model):
        return [tuple(x) for x in _call(host.get_engine_load, model)]

    def route(self, q, prompt, whole=False):
        fut = self._queued(host.route, q, [int(t) for t in prompt], bool(whole))
        return _mapped(fut, lambda v: (v[0], list(v[1])))

    def prep_recv(self, q, prompt, end):
        fut = self._queued(host.prep_recv, q, [int(t) for t in prompt], end)
        return _mapped(fut, tuple)

    def remote_send(self, q, prompt, kv_addr_info, recv_rank, begin, end, src_pages=None,
                    src_len=0):  # fmt: skip
        return self._queued(
            host.remote_send, q, [int(t) for t in prompt], kv_addr_info, recv_rank, begin, end,
            list(src_pages or []), src_len,
        )  # fmt: skip

    def start_generate(self, q, prompt, begin, request=-1):
        return list(_call(host.start_generate, q, [int(t) for t in prompt], begin, request))

    def next_request(self):
        fut = self._queued(host.next_request)
        return _mapped(fut, lambda v: (v[0], v[1], list(v[2]), v[3]))

    def reject_request(self, request, reason):
        _call(host.reject_request, request, reason)


def _processing(mask, bias, penalty_tokens, penalty_prompt, rep, freq, pres):
    """The WIT arguments of the logit processing, or None when there is none."""
    unset = mask is None and not bias and not penalty_tokens and not penalty_prompt
    if unset and rep == 1.0 and freq == 0.0 and pres == 0.0:
        return None
    if mask is not None:
        if not isinstance(mask, bytes | bytearray | memoryview) or len(mask) % 4:
            raise ApiError("mask must be bytes holding whole 32-bit words (a packed bitmask)")
        mask = memoryview(bytes(mask)).cast("I").tolist()  # wasm32 is little-endian
    pairs = [(int(t), float(b)) for t, b in (bias or [])]
    return (
        mask, pairs, [int(t) for t in (penalty_tokens or [])],
        [int(t) for t in (penalty_prompt or [])], float(rep), float(freq), float(pres),
    )  # fmt: skip


def _sample_extras(mask, bias, penalty_tokens, penalty_prompt, rep, freq, pres, logprobs,
                   constraint):  # fmt: skip
    """The WIT arguments a sampling call adds to the plain one (the logit processing, then
    the number of top log-probabilities), or None when it needs none of them."""
    proc = _processing(mask, bias, penalty_tokens, penalty_prompt, rep, freq, pres)
    if proc is None and logprobs is None and constraint is None:
        return None
    top = None if logprobs is None else int(logprobs)
    return (*(proc or (None, [], [], [], 1.0, 0.0, 0.0)), top)


# ---------------------------------------------------------------------------- compile and run


class _Rejected(Exception):
    """The source is not a valid inferlet (the message says why)."""


def _check(name: str, source: str):
    """Parse, check the entry point statically and compile; nothing of the source runs."""
    filename = f"<inferlet {name}>"
    try:
        tree = ast.parse(source, filename)
        code = compile(tree, filename, "exec", dont_inherit=True)
    except SyntaxError as e:
        raise _Rejected(f"{name}: syntax error at line {e.lineno}: {e.msg}") from None
    except (ValueError, RecursionError, MemoryError) as e:
        raise _Rejected(f"{name}: cannot compile: {type(e).__name__}: {e}") from None
    mains = [
        n
        for n in tree.body
        if isinstance(n, ast.AsyncFunctionDef | ast.FunctionDef) and n.name == "main"
    ]
    if not mains or not isinstance(mains[-1], ast.AsyncFunctionDef):
        raise _Rejected(f"{name}: an inferlet must define `async def main(args)`")
    a = mains[-1].args
    if len(a.posonlyargs) + len(a.args) != 1 or a.vararg or a.kwonlyargs or a.kwarg:
        raise _Rejected(f"{name}: main must take exactly one parameter (the argument list)")
    return code


def _execute(name: str, code: bytes):
    """Run a compiled inferlet's module (marshalled ``code``); its ``main``."""
    module = types.ModuleType("inferlet")
    module.__file__ = f"<inferlet {name}>"
    sys.modules["inferlet"] = module
    exec(marshal.loads(code), module.__dict__)
    main = module.__dict__.get("main")
    if main is None or not asyncio.iscoroutinefunction(main):
        raise ValueError(f"{name}: an inferlet must define `async def main(args)`")
    return main


async def _serve():
    """The pre-started instance's task: load the inferlet, wait for its launch, run it.
    An error while loading is reported as the launch's (it is the inferlet's)."""
    name, code = launcher.load_inferlet()  # a pre-started instance parks here
    main = failure = None
    try:
        main = _execute(name, code.encode("latin-1"))
    except BaseException as e:
        failure = e
    args = launcher.start_inferlet()  # an instance loaded ahead of its launch parks here
    try:
        if failure is not None:
            raise failure
        result = await main(list(args))
    except BaseException as e:
        raise Err(_tenant_traceback(name, e)) from None
    return None if result is None else str(result)


_PROBE = array.array("B")  # the bytes memory-probe points at (kept alive, never moved)
# What a launch runs, run once before it (through the same functions): the interpreter's
# caches along the way are written, and the pages they live on copied (copy-on-write of
# the snapshot), before a launch waits for that.
_WARM = marshal.dumps(
    compile(
        "import pastry.sdk as px\n"
        "async def main(args):\n"
        "    try:\n"
        "        px.send('warm')\n"
        "    except px.ApiError:\n"
        "        pass\n"
        "    return args[0]\n",
        "<inferlet warm-up>",
        "exec",
    )
)


async def _warm_up() -> None:
    loop = asyncio.get_running_loop()
    main = _execute("warm-up", _WARM)
    await asyncio.gather(loop.create_task(main(["warm"])), asyncio.sleep(0))
    # The common calls, through the SDK to the host and back: nothing is bound yet, so
    # each raises ApiError.
    px = pastry.sdk
    for call in (
        lambda: px.create_queue("warm"),
        lambda: px.get_kv_page_size(0),
        lambda: px.alloc_kvpages(0, 1),
        lambda: px.embed_txt(0, [1], [0], [0]),
        lambda: px.forward(0, [0], 1, [0], [0], 0, [0]),
        lambda: px.sample(0, 0),
        lambda: px.step(0, [1], [0], [0], [0], 1, [0], 0, 0),
        lambda: px.synchronize(0),
    ):
        with contextlib.suppress(ApiError):
            call()
    host.wait_take(0)
    # Memory a launch's first objects will take: allocated and freed once, so that the
    # allocator's pools are on written pages already.
    junk = [[i] * 4 for i in range(4000)] + [{"k": i} for i in range(500)]
    del junk
    sys.modules.pop("inferlet", None)


def _tenant_traceback(name: str, exc: BaseException) -> str:
    """``exc``'s traceback from the inferlet's own frames on (the runtime's frames and the
    event loop's entry are left out), with the inferlet's source lines."""
    tb = exc.__traceback__
    mine = (__file__, asyncio.base_events.__file__, asyncio.events.__file__)
    while tb is not None and tb.tb_frame.f_code.co_filename in mine:
        tb = tb.tb_next
    filename = f"<inferlet {name}>"
    try:
        source = launcher.inferlet_source()
        linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
    except BaseException:  # the source is only decoration
        pass
    return "".join(traceback.format_exception(type(exc), exc, tb)).rstrip()


class WitWorld(wit_world.WitWorld):
    def compile_source(self, name: str, source: str) -> str:
        try:
            code = _check(name, source)
        except _Rejected as e:
            raise Err(str(e)) from None
        return marshal.dumps(code).decode("latin-1")

    def serve(self) -> str | None:
        loop = GuestLoop()
        asyncio.set_event_loop(loop)
        pastry.sdk._current.set(GuestApi(loop))
        try:
            _PROBE.frombytes(os.urandom(16))
            launcher.memory_probe(_PROBE.buffer_info()[0], bytes(_PROBE))
            loop.run_until_complete(_warm_up())
        except Exception:
            raise Err(f"the Python runtime failed to start:\n{traceback.format_exc()}") from None
        return loop.run_until_complete(_serve())
