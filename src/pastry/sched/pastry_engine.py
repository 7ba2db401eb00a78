"""Pastry's engine in the simulator: the real control layer over a simulated engine
(:mod:`pastry.sched.sim`'s docstring says what is real and what is simulated)."""

from __future__ import annotations

import asyncio
import sys
from typing import Any

from pastry.control.commands import Command, Op, Queue
from pastry.control.commands import Stage as CommandStage
from pastry.control.policies import Adaptive, SchedulePolicy
from pastry.control.programs import ProcessTable
from pastry.control.resources import ExportError, ResourceError, ResourceManager
from pastry.control.scheduler import BatchScheduler
from pastry.control.swap import KvSwapper
from pastry.sched.sim_model import SimProgram, SimThread


class PastryEngine:
    """Pastry's control layer over a simulated engine (see the module docstring): the
    real batch scheduler, process table, resource manager and swapper; the simulated
    inferlets allocate their contexts' pages before each forward, as ``Context`` does."""

    def __init__(
        self, sim: Any, policy: SchedulePolicy, table: ProcessTable | None = None, name: str = "sim"
    ) -> None:
        # (sim: the simulator driving it: its config and clock; table: a process table
        # shared with other engines, as the control layer's is: pastry.sched.cluster)
        cfg = sim.config
        self.sim = sim
        self.policy = policy
        self.cost = cfg.cost
        self.steps = cfg.steps_per_schedule
        self.memory = cfg.memory
        self.page_size = cfg.memory.page_size if cfg.memory is not None else 16
        self.table = table or ProcessTable(clock=lambda: sim.now, session_ttl_s=0)
        self.sched = BatchScheduler(
            _no_engine,
            cfg.max_batch_tokens if cfg.max_batch_tokens is not None else sys.maxsize,
            self.page_size,
            Adaptive(),
            policy,
            programs=self.table,
            engine=name,
            max_batch=cfg.max_batch,
        )
        self.resources: ResourceManager | None = None
        self.swapper: KvSwapper | None = None
        if cfg.memory is not None:
            # No termination callback: a program that even the last resort cannot fit
            # fails itself (the server would end the newest programs instead)
            self.resources = ResourceManager(
                cfg.memory.pages, 0, num_host_pages=cfg.memory.host_pages
            )
            self.swapper = KvSwapper(
                self.resources, self.sched, cfg.min_resident, admission=cfg.admission
            )
        self.share_prefix = cfg.share_prefix
        self._loop = asyncio.new_event_loop()  # commands' futures (never run)
        self._by_queue: dict[Queue, SimThread] = {}
        self._prefixes: set[str] = set()  # exported shared prefixes
        self._pending = 0  # threads with a command not yet taken
        self._failed: list[tuple[SimProgram, str]] = []  # reported by the next step
        self._doomed: set[SimThread] = set()
        self._swap_s = 0.0
        self._prefill_tokens = 0  # input tokens of calls' first forwards (vLLM's count)

    def describe(self) -> str:
        return self.policy.describe()

    def finish(self) -> dict:
        """The engine's counters; the simulation is over."""
        out = {
            "mean_batch": round(self.sched.stats.mean_batch, 2),
            "prefill_tokens": self._prefill_tokens,
        }
        if self.swapper is not None:
            s = self.swapper.stats
            out.update(pages_out=s.pages_out, pages_in=s.pages_in, swap_outs=s.swap_outs,
                       forced=s.forced, held_back=s.held_back,
                       swap_s=round(self._swap_s, 3))  # fmt: skip
        self._loop.close()
        return out

    # ------------------------------------------------------------------ programs, threads

    def start_program(self, p: SimProgram) -> None:
        self.table.start(p.instance)
        if self.resources is not None:
            self.resources.add_instance(p.instance)

    def open_thread(self, th: SimThread, parent: SimThread | None) -> None:
        p = th.program
        th.queue = self.sched.create_queue(p.instance)
        self._by_queue[th.queue] = th
        res = self.resources
        if parent is not None:  # Context.fork: the root's full pages by reference
            full = parent.kv // self.page_size
            th.pages, th.shared, th.kv = parent.pages[:full], full, parent.kv
            if res is not None and parent.kv % self.page_size:
                th.pages = th.pages + res.alloc(p.instance, "kv", 1)  # the partial page's copy
            return
        prefix = p.spec.shared_prefix
        name = f"prefix:{p.spec.workload}:{prefix}"
        if res is None or not self.share_prefix or name not in self._prefixes:
            return
        try:
            th.pages = res.import_(p.instance, "kv", name)
        except ExportError:  # a cache: dropped under memory pressure; computed again
            self._prefixes.discard(name)
            return
        th.shared = len(th.pages)
        th.kv = th.shared * self.page_size
        p.prefix_left = prefix - th.kv

    def start_call(self, th: SimThread, tokens: int, decode: int) -> None:
        self._prefill_tokens += tokens  # the call's new input (its context is in KV)
        self._submit(th, tokens)

    def close_thread(self, th: SimThread) -> None:
        q = th.queue
        assert q is not None
        th.waited = q.thread.waited if q.thread is not None else 0.0
        if th.command is not None and th.command in q.pending:
            self._pending -= 1  # dropped with the queue
        self.sched.close_queue(q, "the program ended")
        if th.command is not None and th.command.future.done():
            th.command.future.exception()  # nobody awaits it (as an ended inferlet would)
        self._by_queue.pop(q, None)
        own = th.pages[th.shared :]
        if self.resources is not None and own and th.program.failed is None:
            self.resources.free(th.program.instance, "kv", own)
        th.pages, th.command = [], None

    def end_program(self, p: SimProgram) -> None:
        if self.resources is not None:
            self.resources.remove_instance(p.instance)
        self.table.end(p.instance)
        self._doomed.difference_update([t for t in self._doomed if t.program is p])

    def has_work(self) -> bool:
        return self._pending > 0 or bool(self._failed)

    # ------------------------------------------------------------------ a step

    def step(self) -> tuple[float, list[SimThread], list[tuple[SimProgram, str]]]:
        """One scheduling pass: a batch formed by the real scheduler, run for up to
        ``steps_per_schedule`` steps (see the module docstring)."""
        sim, sched = self.sim, self.sched
        batch = sched.take_batch() or []
        moved = 0
        if self.swapper is not None:  # the copies go at the front of the batch
            s = self.swapper.stats
            before = s.pages_out + s.pages_in
            self.swapper.take_calls()
            moved = s.pages_out + s.pages_in - before
        self._pending -= len(batch)
        failed, self._failed = self._failed, []
        if not batch:
            return 0.0, [], failed + self._dropped()
        threads = [self._by_queue[c.queue] for c in batch]
        sched.stats.batches += 1
        sched.stats.forward_items += len(batch)
        sched.stats.forward_batches += 1
        self.table.dispatched([(c.queue.thread, 1) for c in batch], sim.now)
        spans = [min(th.left, self.steps) for th in threads]
        swap_s = self.memory.swap_s(moved) if self.memory is not None else 0.0
        self._swap_s += swap_s
        dt = self._run(batch, threads, spans) + swap_s
        end = sim.now + dt
        self.table.completed([(c.queue.thread, 1, True) for c in batch], dt, end)
        self.policy.on_batch_done(batch, dt)
        done = []
        for cmd, th, k in zip(batch, threads, spans, strict=True):
            cmd.future.set_result(None)
            th.command = None
            if th.program.failed is not None or th in self._doomed:
                continue
            th.kv += cmd.tokens + k - 1
            if th.root and th.program.prefix_left == 0 and th.program.stage == 0:
                self._export_prefix(th)
            th.left -= k
            if th.left > 0:
                self._submit(th, 1, at=end)
                continue
            self.table.end_call(th.queue.thread, end)
            done.append(th)
        return dt, done, failed

    def _run(self, batch: list[Command], threads: list[SimThread], spans: list[int]) -> float:
        """Seconds of the pass's steps: step 0 runs every command (its input tokens over
        its context), step s > 0 the calls with more than s steps in the pass, one token
        each over a context grown by s."""
        tokens = sum(c.tokens for c in batch)
        dt = self.cost.step(len(batch), tokens, sum(th.kv for th in threads) + tokens)
        last = max(spans)
        if last == 1:
            return dt
        count = [0] * (last + 1)  # calls with exactly k steps in the pass
        base = [0] * (last + 1)  # their contexts after step 0
        for cmd, th, k in zip(batch, threads, spans, strict=True):
            count[k] += 1
            base[k] += th.kv + cmd.tokens
        n = ctx = 0
        for s in range(last - 1, 0, -1):  # step s runs the calls with k > s
            n += count[s + 1]
            ctx += base[s + 1]
            dt += self.cost.step(n, n, ctx + n * s)
        return dt

    def _submit(self, th: SimThread, tokens: int, at: float | None = None) -> None:
        """Allocate the pages the forwards of the next pass write (``Context`` does before
        a forward; short of device pages they start on the host), then queue it."""
        q = th.queue
        assert q is not None
        res = self.resources
        if res is not None:
            span = min(th.left, self.steps)
            need = -(-(th.kv + tokens + span - 1) // self.page_size) - len(th.pages)
            if need > 0:
                try:
                    th.pages = th.pages + res.alloc(th.program.instance, "kv", need)
                except ResourceError as e:  # neither device nor host pages: it fails
                    self._failed.append((th.program, str(e)))
                    self._doomed.add(th)
                    return
        now = self.sim.now if at is None else at
        cmd = Command(CommandStage.FORWARD, _NOTHING, tokens=tokens,
                      future=self._loop.create_future(), created=now)  # fmt: skip
        th.command = cmd
        self._pending += 1
        self.sched.submit(q, cmd)

    def _export_prefix(self, root: SimThread) -> None:
        """After the first forward of a program that computed the shared prefix itself:
        export its full pages for the programs after it."""
        p = root.program
        spec = p.spec
        if self.resources is None or not self.share_prefix or root.shared:
            return
        full = spec.shared_prefix // self.page_size
        name = f"prefix:{spec.workload}:{spec.shared_prefix}"
        if full == 0 or name in self._prefixes:
            return
        self.resources.export(p.instance, "kv", root.pages[:full], name, persistent=True)
        self._prefixes.add(name)

    def _dropped(self) -> list[tuple[SimProgram, str]]:
        """Programs whose command the scheduler failed (even forced residency could not
        make room)."""
        out = []
        for q, th in list(self._by_queue.items()):
            cmd = th.command
            if cmd is not None and cmd.future.done() and cmd.future.exception() is not None:
                if cmd not in q.pending:
                    self._pending -= 1
                th.command = None
                out.append((th.program, str(cmd.future.exception())))
        return out


async def _no_engine(calls):  # the simulator runs the batch itself
    raise AssertionError("the simulated scheduler never dispatches to an engine")


class _Nothing(Op):
    """A simulated forward: nothing to translate (the simulator runs the batch itself)."""

    __slots__ = ()

    def prepare(self) -> None:
        return None


_NOTHING = _Nothing()
