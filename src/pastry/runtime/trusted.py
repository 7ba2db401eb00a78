"""The trusted runner: inferlets as asyncio tasks inside the server process.

A program is Python source defining ``async def main(args: list[str]) -> str | None`` (see
:mod:`pastry.sdk`). It is compiled once (:class:`Program`); each launch creates an
:class:`Instance` — a control-layer session plus one task running ``main`` with the SDK
bound to that session. Hundreds run concurrently on one event loop; their model calls meet
in the batch scheduler.

An instance ends with its result (:class:`Finished`), with the traceback of an exception it
raised (:class:`Failed`; only that instance ends), or terminated (:class:`Terminated`, by its
client or by the resource policy, with the reason); :meth:`Instance.events` yields its
messages, then that end event (:mod:`pastry.control.events`). However it ends, the
controller releases everything it held.

Instance ids are random (not guessable), and each instance belongs to a user
(:mod:`pastry.control.users`). A result over ``Quotas.result_bytes`` fails the instance;
tracebacks name the server's files relative to their package, never by server path.
"""

from __future__ import annotations

import asyncio
import hashlib
import inspect
import linecache
import logging
import secrets
import sys
import time
import traceback
import types
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from pastry.control.controller import Controller
from pastry.control.events import End, Event, Failed, Finished, Message, Terminated
from pastry.control.outbox import message_bytes
from pastry.control.session import Session
from pastry.control.users import LOCAL
from pastry.sdk import bind

log = logging.getLogger(__name__)


class ProgramError(ValueError):
    """The program cannot be loaded (syntax error, no suitable ``main``)."""


class InferletFailure(Exception):
    """Raised by a program's ``main`` to end its instance with exactly this message as the
    error, without the host's traceback (a sandboxed inferlet's own traceback, a trap, a
    limit it went over)."""


@dataclass(frozen=True)
class Program:
    name: str
    digest: str  # sha256 of the source
    main: Callable[[list[str]], Awaitable[str | None]]
    # bytes of memory an instance (by id) of it holds, where the runner can tell (the
    # sandbox: its linear memory); None for trusted programs, which share the process's
    memory: Callable[[int], int | None] | None = None

    @property
    def sandboxed(self) -> bool:
        """Whether it runs in the WebAssembly sandbox (only the sandbox can tell memory)."""
        return self.memory is not None

    @classmethod
    def from_source(cls, name: str, source: str) -> Program:
        digest = hashlib.sha256(source.encode()).hexdigest()
        filename = f"<inferlet {name} {digest[:12]}>"
        try:
            code = compile(source, filename, "exec")
        except SyntaxError as e:
            raise ProgramError(f"{name}: syntax error at line {e.lineno}: {e.msg}") from None
        linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
        module = types.ModuleType(f"inferlet_{digest[:12]}")
        module.__file__ = filename
        # Registered like an imported module, so that dataclasses, pickling-free
        # introspection and `from __future__ import annotations` work inside programs.
        sys.modules[module.__name__] = module
        try:
            exec(code, module.__dict__)
        except Exception as e:
            raise ProgramError(
                f"{name}: error while loading: {type(e).__name__}: {e}\n{traceback.format_exc()}"
            ) from None
        main = module.__dict__.get("main")
        if main is None or not inspect.iscoroutinefunction(main):
            raise ProgramError(f"{name}: an inferlet must define `async def main(args)`")
        if len(inspect.signature(main).parameters) != 1:
            raise ProgramError(f"{name}: main must take exactly one parameter (the argument list)")
        return cls(name, digest, main)


@dataclass(eq=False)
class Instance:
    id: int
    program: Program
    args: list[str]
    session: Session
    started: float = field(default_factory=time.time)
    task: asyncio.Task | None = None
    done: asyncio.Event = field(default_factory=asyncio.Event)
    end: End | None = None

    async def events(self) -> AsyncIterator[Event]:
        """:class:`Message` events as they come, then the :data:`End` event (one consumer)."""
        while True:
            event = await self.session.outbox.get()
            yield event
            if not isinstance(event, Message):
                return

    def send(self, message: str) -> None:
        """Deliver a client message to the inferlet's ``receive``."""
        self.session.deliver(message)  # QuotaError while it leaves too much unread

    async def wait(self) -> End:
        await self.done.wait()
        assert self.end is not None
        return self.end

    @property
    def user(self) -> str:
        """The user it belongs to."""
        return self.session.user


class TrustedRuntime:
    def __init__(self, controller: Controller) -> None:
        self.controller = controller
        self.instances: dict[int, Instance] = {}
        controller.on_terminate = self.terminate

    def new_id(self) -> int:
        """A random instance id (53 bits: exact in JSON numbers everywhere), not in use."""
        while (iid := secrets.randbits(53)) in self.controller.sessions or iid == 0:
            pass
        return iid

    def launch(self, program: Program, args: Sequence[str] = (), user: str = LOCAL) -> Instance:
        iid = self.new_id()
        session = self.controller.session(iid, args, user)
        inst = Instance(iid, program, list(args), session)
        self.instances[iid] = inst
        inst.task = asyncio.get_running_loop().create_task(self._run(inst), name=f"inferlet-{iid}")
        return inst

    async def _run(self, inst: Instance) -> None:
        bind(inst.session)
        try:
            result = await inst.program.main(list(inst.args))
            if result is not None and not isinstance(result, str):
                result = str(result)
            limit = self.controller.quotas.result_bytes
            if result is not None and limit is not None and message_bytes(result) > limit:
                size = message_bytes(result)
                self._finish(inst, Failed(
                    f"the result is {size} bytes, over the result quota of {limit} bytes "
                    "(--max-result-bytes): send large output in pieces with send()"
                ))  # fmt: skip
                return
            self._finish(inst, Finished(result))
        except asyncio.CancelledError:
            self._finish(inst, inst.end or Terminated("terminated"))
        except InferletFailure as e:
            self._finish(inst, Failed(str(e)))
        except Exception:
            log.debug("inferlet %d failed", inst.id, exc_info=True)
            self._finish(inst, Failed(tenant_traceback()))

    def _finish(self, inst: Instance, event: End) -> None:
        if inst.done.is_set():
            return
        inst.end = event
        self.controller.end_session(inst.id)
        inst.session.outbox.put_nowait(event)
        inst.done.set()
        self.instances.pop(inst.id, None)

    def terminate(self, instance: int, reason: str) -> None:
        """End an instance now (its client gets ``reason``); its resources are released."""
        inst = self.instances.get(instance)
        if inst is None:
            return
        log.info("terminating inferlet %d: %s", instance, reason)
        self._finish(inst, Terminated(reason))
        if inst.task is not None and not inst.task.done():
            inst.task.cancel()


_ROOTS = sorted(
    {p for p in (str(Path(__file__).resolve().parents[2]), *sys.path) if p and p != "."},
    key=len,
    reverse=True,
)  # where server code lives: src/, site-packages, the standard library


def tenant_traceback() -> str:
    """The current exception's traceback with server paths cut to package-relative names
    (``pastry/sdk/context.py``, ``asyncio/tasks.py``): what the inferlet's client sees."""
    lines = traceback.format_exc().splitlines(keepends=True)
    out = []
    for line in lines:
        if line.startswith('  File "/'):
            for root in _ROOTS:
                prefix = f'  File "{root.rstrip("/")}/'
                if line.startswith(prefix):
                    line = '  File "' + line[len(prefix) :]
                    break
            else:
                line = '  File "' + line[len('  File "') :].rsplit("/", 1)[-1]
        out.append(line)
    return "".join(out)
