"""The process table: one entry per program, with the service and waiting it has had.

Autellix (``docs/scheduling.md``) schedules *programs*, not requests: a call's priority
comes from the service its program has already received. This table is where that
service is kept. It is fed by the batch schedulers (``control/scheduler.py``) and read by
the schedule policies (``control/policies/``) and the swapper (``control/swap.py``).

- A :class:`Program` is an inferlet instance, from launch to exit, error or termination.
  Clients of the OpenAI (and native) API do not run their own inferlets: their requests
  run as built-in inferlets, and the endpoint *joins* each instance to the program its
  client names (:func:`session_key`: an ``X-Session-Id`` header, else the ``user`` field,
  else one program per request; on a server with several users the key also names the
  user, ``server/auth.py``, so a session id never joins another user's program). A
  session's entry outlives its requests by ``session_ttl_s`` of idleness, so that a
  conversation keeps its attained service.
- A :class:`Thread` is one command queue of a program: an inferlet's ``Context``, each
  fork its own. Per thread: the current call's arrival, wait and service, and totals.
- A :class:`Call` is one busy period of a thread. It begins when a command arrives on an
  idle thread and ends when a batch is dispatched while the thread has no command pending
  or in flight, i.e. when the program did something else (a tool call, I/O, waiting on
  another thread or a client) instead of queueing its next step for that batch. The
  adaptive batching policy lets woken inferlets queue their next step before it
  dispatches, so a generation loop is one call and its gaps are tool calls; a simulator
  can also end calls explicitly (:meth:`ProcessTable.end_call`).
- **Charging.** A batch's engine time (dispatch to results) is charged in full to every
  thread that has a forward in the batch: service is the time a thread's work was on the
  model executor, whatever it shared the step with (continuous batching makes a step's
  time nearly independent of who else is in it; splitting it by tokens would make a
  decode step look free next to a prefill). A thread's *wait* is the time it had a
  command pending while nothing of it was in flight and no batch took it.
- On a call's end (Algorithm 1, line 4), the program's PLAS service grows by the call's
  model time, its ATLAS critical path becomes ``max(path, path at arrival + model
  time)`` and its wait grows by the call's wait.

Times come from ``clock`` (``time.perf_counter`` by default; the simulator passes its
virtual clock). Used from the event loop only (no locks); pure Python.
"""

from __future__ import annotations

import itertools
import math
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

SESSION_TTL_S = 600.0


@dataclass(eq=False, slots=True)
class Call:
    """One busy period of a thread (the paper's LLM call).

    ``level``, ``level_mark`` and ``entered`` belong to the schedule policy (Algorithm 1's
    ``c.q_idx`` and quantum): ``level`` -1 means "not placed yet".
    """

    arrival: float
    base_service: float  # the program's PLAS service when the call arrived (line 11)
    base_path: float  # the program's ATLAS critical path when the call arrived
    model_time: float = 0.0  # engine time charged to this call (never reset)
    waited: float = 0.0  # queueing time of this call (never reset)
    wait: float = 0.0  # W_c: queueing time since the last promotion
    run: float = 0.0  # T_c: model time since the last promotion
    level: int = -1
    level_mark: float = 0.0  # model_time when the call entered its level
    entered: float = 0.0  # when it entered its level (FCFS within a level)
    promoted: float = -math.inf  # when anti-starvation last promoted it


@dataclass(eq=False, slots=True)
class Thread:
    """One command queue of a program (a context or fork of an inferlet)."""

    program: Program
    tid: int
    instance: int
    engine: str
    created: float
    call: Call | None = None
    pending: int = 0  # commands queued and not yet dispatched
    inflight: int = 0  # commands dispatched whose batch has not completed
    ready_since: float | None = None  # waiting for a batch since (None: not waiting)
    calls: int = 0  # completed calls
    waited: float = 0.0
    served: float = 0.0
    last_done: float | None = None

    def current_wait(self, now: float) -> float:
        """The wait of the current call so far (W_c), the ongoing stretch included."""
        c = self.call
        if c is None:
            return 0.0
        ongoing = now - max(self.ready_since, c.promoted) if self.ready_since is not None else 0.0
        return c.wait + ongoing


@dataclass(eq=False)
class Program:
    """A process-table entry (see the module docstring)."""

    pid: int
    key: str  # "inferlet:7", "session:abc" or "request:..."
    started: float
    instances: set[int] = field(default_factory=set)
    threads: list[Thread] = field(default_factory=list)  # open threads, oldest first
    service: float = 0.0  # PLAS: model time of completed calls, summed
    critical_path: float = 0.0  # ATLAS: longest observed critical path
    wait: float = 0.0  # W_p: queueing time of completed calls, summed
    calls: int = 0
    engines: set[str] = field(default_factory=set)
    last_arrival: float | None = None
    last_completion: float | None = None
    user: str | None = None  # the instance's user, once users exist (issue 17)
    idle_since: float | None = None  # a session with no instance left

    @property
    def active(self) -> list[Thread]:
        """Threads in a call with a command pending or in flight (a thread whose call is
        open but that queued nothing since its last batch is in an interrupt: its call
        ends at the next dispatch)."""
        return [t for t in self.threads if t.call is not None and (t.pending or t.inflight)]

    @property
    def queue(self) -> int | None:
        """The best (lowest) level of its active calls (None: no call placed)."""
        levels = [t.call.level for t in self.threads if t.call is not None and t.call.level >= 0]
        return min(levels) if levels else None


def session_key(session_id: object, user: object) -> str | None:
    """The program an API request belongs to: the ``X-Session-Id`` header's session, else
    the ``user`` field's, else ``None`` (the request is a program of its own). Blank or
    non-string values do not count."""
    if isinstance(session_id, str) and session_id.strip():
        return f"session:{session_id.strip()}"
    if isinstance(user, str) and user.strip():
        return f"user:{user.strip()}"
    return None


def _is_session(key: str) -> bool:
    """Whether ``key`` names an API client's session (:func:`session_key`), also as kept
    apart per user on a server with several (``<user>/<key>``, ``server/auth.py``)."""
    sessions = ("session:", "user:")
    return key.startswith(sessions) or key.partition("/")[2].startswith(sessions)


class ProcessTable:
    """Programs, their threads and calls (see the module docstring).

    The batch scheduler reports :meth:`arrive`, :meth:`dispatched`, :meth:`completed`,
    :meth:`dropped` and :meth:`close_thread`; the controller :meth:`start` and
    :meth:`end`. Schedule policies read it and may change only a call's placement fields
    and, on promotion, its ``wait`` and ``run``.
    """

    def __init__(
        self, clock: Callable[[], float] = time.perf_counter, session_ttl_s: float = SESSION_TTL_S
    ) -> None:
        self.clock = clock
        self.session_ttl_s = session_ttl_s
        self._by_key: dict[str, Program] = {}
        self._by_instance: dict[int, Program] = {}
        self._pids = itertools.count(1)
        self._tids = itertools.count()
        self._idle: set[Thread] = set()  # threads in a call with nothing pending or in flight

    # ------------------------------------------------------------------ programs

    def start(self, instance: int, key: str | None = None, user: str | None = None) -> Program:
        """Register a launched instance as (part of) program ``key`` (default: its own)."""
        if instance in self._by_instance:
            raise ValueError(f"inferlet {instance} is already in the process table")
        now = self.clock()
        self._expire(now)
        key = key or f"inferlet:{instance}"
        p = self._by_key.get(key)
        if p is None:
            p = self._by_key[key] = Program(next(self._pids), key, now, user=user)
        p.instances.add(instance)
        p.idle_since = None
        self._by_instance[instance] = p
        return p

    def join(self, instance: int, key: str) -> Program:
        """Move a just-launched instance (one with no thread yet) into program ``key``:
        how an API request joins its client's session."""
        p = self._by_instance.get(instance)
        if p is None:
            return self.start(instance, key)
        if p.key == key:
            return p
        if p.threads:
            raise ValueError(f"inferlet {instance} already runs threads; join before it starts")
        self._leave(p, instance)
        return self.start(instance, key, p.user)

    def end(self, instance: int) -> None:
        """The instance ended (exit, error or termination). Its program's entry goes with
        its last instance; a session's waits ``session_ttl_s`` for the next request."""
        p = self._by_instance.get(instance)
        if p is not None:
            self._leave(p, instance)

    def program_of(self, instance: int) -> Program | None:
        return self._by_instance.get(instance)

    def programs(self) -> list[Program]:
        """Every entry, oldest first."""
        return list(self._by_key.values())

    def _leave(self, p: Program, instance: int) -> None:
        del self._by_instance[instance]
        p.instances.discard(instance)
        now = self.clock()
        if p.instances:
            return
        for t in list(p.threads):
            self.close_thread(t)
        if _is_session(p.key) and self.session_ttl_s > 0:
            p.idle_since = now
        else:
            self._by_key.pop(p.key, None)

    def _expire(self, now: float) -> None:
        gone = [
            k
            for k, p in self._by_key.items()
            if p.idle_since is not None and now - p.idle_since >= self.session_ttl_s
        ]
        for k in gone:
            del self._by_key[k]

    # ------------------------------------------------------------------ threads

    def open_thread(self, instance: int, engine: str = "") -> Thread:
        """A new command queue of ``instance`` on ``engine`` (a program is started for an
        instance the table does not know, e.g. a scheduler used on its own)."""
        p = self._by_instance.get(instance) or self.start(instance)
        t = Thread(p, next(self._tids), instance, engine, self.clock())
        p.threads.append(t)
        if engine:
            p.engines.add(engine)
        return t

    def close_thread(self, t: Thread) -> None:
        """The queue closed: its call (if any) ends now."""
        if t.call is not None:
            self._finish(t, self.clock())
        self._idle.discard(t)
        if t in t.program.threads:
            t.program.threads.remove(t)

    # ------------------------------------------------------------------ scheduler events

    def arrive(self, t: Thread, now: float) -> None:
        """A command was queued on ``t``; a call begins if the thread was idle."""
        p = t.program
        if t.call is None:
            t.call = Call(now, p.service, p.critical_path)
            p.last_arrival = now
        self._idle.discard(t)
        t.pending += 1
        if t.ready_since is None and t.inflight == 0:
            t.ready_since = now

    def dropped(self, t: Thread, n: int = 1) -> None:
        """``n`` pending commands of ``t`` will never be dispatched (rejected)."""
        t.pending -= n
        if t.pending == 0:
            t.ready_since = None
            if t.inflight == 0 and t.call is not None:
                self._idle.add(t)

    def dispatched(self, counts: Iterable[tuple[Thread, int]], now: float) -> None:
        """A batch went to the engine with ``n`` commands of each thread listed. Calls of
        threads that had nothing to offer to it end now."""
        for t, n in counts:
            if t.ready_since is not None:
                w = now - t.ready_since
                t.waited += w
                if t.call is not None:
                    t.call.wait += now - max(t.ready_since, t.call.promoted)
                    t.call.waited += w
                t.ready_since = None
            t.pending -= n
            t.inflight += n
        if self._idle:
            for t in list(self._idle):
                self._finish(t, now)
            self._idle.clear()

    def completed(
        self, counts: Iterable[tuple[Thread, int, bool]], elapsed: float, now: float
    ) -> None:
        """The batch is back after ``elapsed`` seconds: ``(thread, n commands, had a
        forward)`` for each thread in it; those with a forward are charged ``elapsed``."""
        for t, n, forward in counts:
            t.inflight -= n
            t.last_done = now
            if forward:
                t.served += elapsed
                if t.call is not None:
                    t.call.model_time += elapsed
                    t.call.run += elapsed
            if t.inflight == 0:
                if t.pending:
                    t.ready_since = now
                elif t.call is not None:
                    self._idle.add(t)

    def end_call(self, t: Thread, now: float | None = None) -> None:
        """End ``t``'s call now (for drivers that know call boundaries: the simulator)."""
        if t.call is not None:
            self._finish(t, self.clock() if now is None else now)
        self._idle.discard(t)

    def _finish(self, t: Thread, now: float) -> None:
        """Algorithm 1, lines 1-7: fold a finished call into its program."""
        c, p = t.call, t.program
        assert c is not None
        p.service += c.model_time
        p.critical_path = max(p.critical_path, c.base_path + c.model_time)
        p.wait += c.waited
        p.calls += 1
        p.last_completion = t.last_done if t.last_done is not None else now
        t.calls += 1
        t.call = None
        t.ready_since = None

    # ------------------------------------------------------------------ inspection

    def snapshot(self) -> list[dict]:
        """Every entry as plain data (for logs, metrics and tests)."""
        now = self.clock()
        return [
            {
                "pid": p.pid,
                "key": p.key,
                "instances": sorted(p.instances),
                "service": p.service,
                "critical_path": p.critical_path,
                "wait": p.wait,
                "calls": p.calls,
                "queue": p.queue,
                "engines": sorted(p.engines),
                "user": p.user,
                "threads": [
                    {
                        "tid": t.tid,
                        "engine": t.engine,
                        "arrival": t.call.arrival if t.call else None,
                        "wait": t.current_wait(now),
                        "service": t.call.model_time if t.call else 0.0,
                        "level": t.call.level if t.call else None,
                    }
                    for t in p.threads
                ],
            }
            for p in self._by_key.values()
        ]

    def check_integrity(self) -> None:
        """Assert the table's invariants (tests run it after every scenario)."""
        for inst, p in self._by_instance.items():
            assert inst in p.instances and self._by_key.get(p.key) is p, (inst, p.key)
        for p in self._by_key.values():
            assert all(self._by_instance.get(i) is p for i in p.instances), p.key
            assert p.instances or not p.threads, f"{p.key}: threads without an instance"
            assert p.service >= 0 and p.wait >= 0 and p.critical_path >= 0, p.key
            assert p.critical_path <= p.service + 1e-9, f"{p.key}: path longer than service"
            for t in p.threads:
                assert t.program is p and t.pending >= 0 and t.inflight >= 0, (p.key, t.tid)
                assert t.call is not None or t.pending == t.inflight == 0, (p.key, t.tid)
                assert (t.ready_since is None) or t.inflight == 0, (p.key, t.tid)
                if t.call is not None:
                    c = t.call
                    assert c.run <= c.model_time + 1e-9 and c.wait <= c.waited + 1e-9
                    assert math.isfinite(c.model_time), (p.key, t.tid)
        for t in self._idle:
            assert t.call is not None and t.pending == t.inflight == 0, t.tid
