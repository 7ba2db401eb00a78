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
  :class:`~pastry.runtime.guest.loop.GuestLoop`, an asyncio event loop whose only
  way to wait is the host's ``wait-take``: while the inferlet waits, its Wasmtime fiber is suspended and the host
  runs other inferlets and the batch scheduler.

Queued API calls return asyncio futures at once (the host returns a ``pending`` handle),
so ``asyncio.gather`` over embed, forward and sample submits them all before waiting, as
in the trusted runner. ``GuestApi`` is generated from the request table
(:func:`pastry.api.guest.binding`): every argument is checked against its WIT type before
the import is called, so a value the import cannot take (a negative handle, a number over
32 bits, a string for a number) is an :class:`ApiError` naming it, not a trap of the whole
instance.
``time.sleep`` waits on the host's timer (the fiber is parked; the server goes on). This
module never runs on the host (it imports the generated ``wit_world`` bindings).
"""

from __future__ import annotations

import array
import ast
import asyncio
import asyncio.base_events  # (its file name: the loop's frames left out of tracebacks)
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
from wit_world.imports import api as host
from wit_world.imports import launcher

import pastry.lang  # in the snapshot, so that inferlets can import it
import pastry.sdk
import pastry.sdk.args  # only what the snapshot imported can be imported later
import pastry.sdk.grammar
import pastry.sdk.interpreter  # codeact's restricted interpreter (with interp_values)
import pastry.sdk.router  # routers run sandboxed too (uploaded routers)
import pastry.sdk.tools  # agents' tools: schemas, the action grammar, HTTP and MCP calls
from pastry.api import ApiError
from pastry.api.guest import binding, unwrap
from pastry.runtime.guest import loop as guest_loop
from pastry.runtime.guest.loop import GuestLoop

# Modules imported here (or by pastry.sdk) are in the snapshot; nothing else of the
# standard library can be imported by an inferlet.
STDLIB = (
    asyncio, collections, contextvars, dataclasses, functools, heapq, itertools, json, math,
    random, re, string, time, typing, weakref,
)  # fmt: skip

# ---------------------------------------------------------------------------- the event loop


def _select(loop: GuestLoop, timeout: float | None) -> None:
    """The loop's waiting: the host's blocking ``wait-take``, then the completed calls'
    futures resolved with their outcomes."""
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
            fut.set_result(unwrap(outcome.value))
        else:
            fut.set_exception(ApiError(outcome.value))


def _sleep(seconds: float) -> None:
    """``time.sleep`` in the sandbox: the host parks this instance on its own timer."""
    seconds = float(seconds)
    if not seconds >= 0:
        raise ValueError("sleep length must be non-negative")
    host.wait([], int(min(seconds, 1e9) * 1e9))


time.sleep = _sleep


# :class:`pastry.api.InferletApi` over the host imports, generated from the request table
# (every argument checked against its WIT type first: a value the import cannot take is an
# ApiError naming it, not a trap of the whole instance).
GuestApi = binding(host, Err)


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
    mine = (__file__, guest_loop.__file__, asyncio.base_events.__file__, asyncio.events.__file__)
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
        loop = GuestLoop(_select)
        asyncio.set_event_loop(loop)
        pastry.sdk.bind(GuestApi(loop))
        try:
            _PROBE.frombytes(os.urandom(16))
            launcher.memory_probe(_PROBE.buffer_info()[0], bytes(_PROBE))
            loop.run_until_complete(_warm_up())
        except Exception:
            raise Err(f"the Python runtime failed to start:\n{traceback.format_exc()}") from None
        return loop.run_until_complete(_serve())
