"""The commands of the decode hot path, prepared a whole batch at a time.

A :class:`Step` is the op a ``step`` request queues (:mod:`pastry.control.handlers.model`):
the handles and parameters of one ``embed_txt -> forward -> sample`` (the SDK's decode
step), as data; an :class:`Embed` is one ``embed_txt``. The batch scheduler
(:mod:`pastry.control.scheduler`) collects the steps (embeds) it takes into a batch and
prepares them together with :meth:`Step.prepare_batch` (:meth:`Embed.prepare_batch`):

- every step's handles are translated against its instance's tables in one pass;
- the integers of every call of every step (tokens, positions, translated embedding slots
  and KV pages) go into *one* int64 array per batch; each call's fields are views of it,
  not arrays of their own;
- the write claims on the prefix cache's pages are made in the same pass, in the order the
  steps were taken.

A step whose handles do not translate is prepared alone (:meth:`Step.prepare`, the same
work for one step), which raises the error its caller sees, exactly as before.
"""

from __future__ import annotations

import numpy as np

from pastry.api import ApiError
from pastry.control.commands import Command, Op
from pastry.control.quotas import QuotaError
from pastry.control.resources import QuotaExceeded, ResourceError, ResourceManager
from pastry.control.sampling import SampleSpec
from pastry.wire.calls import EmbedTxt, Forward, Sample, ids


def claim(res: ResourceManager, instance: int, pages: list[int]) -> None:
    """``instance`` is about to write physical ``pages`` (see ``claim_writes``); the
    error its caller sees if it may not."""
    try:
        res.claim_writes(instance, pages)
    except QuotaExceeded as e:
        raise QuotaError(str(e)) from None
    except ResourceError as e:
        raise ApiError(str(e)) from None


def sample_call(embed: int, spec: SampleSpec | None) -> Sample:
    """The engine's ``Sample`` from embed slot ``embed`` with ``spec`` (None: greedy)."""
    if spec is None:
        return Sample(embed)
    if spec.params is None:
        return Sample(embed, **spec.proc)
    return Sample(embed, *spec.params, **spec.proc)


class Step(Op):
    """One queued decode step: ``embed_txt(tokens, positions) -> in_embeds``, ``forward``
    over them on top of ``kv[:n_ctx]`` writing ``kv[n_ctx:]`` from ``offset``, the last
    input's output to ``embeds[-1]``, and ``sample`` from it with ``spec`` (None: greedy).
    Handles are the inferlet's, snapshotted at submission."""

    __slots__ = (
        "embeds",
        "instance",
        "kv",
        "last_len",
        "n_ctx",
        "offset",
        "positions",
        "res",
        "spec",
        "tokens",
    )
    batched = True

    def __init__(
        self,
        res: ResourceManager,
        instance: int,
        tokens: list[int],
        positions: list[int],
        embeds: list[int],
        kv: list[int],
        n_ctx: int,
        last_len: int,
        offset: int,
        spec: SampleSpec | None = None,
    ) -> None:
        self.res, self.instance = res, instance
        self.tokens, self.positions = tokens, positions  # Python ints, checked at submission
        self.embeds, self.kv = embeds, kv  # [*in_embeds, out_embed], [*in_kv, *out_kv]
        self.n_ctx, self.last_len, self.offset = n_ctx, last_len, offset
        self.spec = spec

    def prepare(self) -> tuple[EmbedTxt, Forward, Sample]:
        """The step's three engine calls, alone (raises what its caller should see)."""
        res, inst = self.res, self.instance
        try:
            phys_e = res.translate(inst, "embed", self.embeds)
            phys_kv = res.translate(inst, "kv", self.kv)
        except ResourceError as e:
            raise ApiError(str(e)) from None
        out_pages = phys_kv[self.n_ctx :]
        if res.cache is not None:
            claim(res, inst, out_pages)
        n = len(self.tokens)
        ins = ids(phys_e[:-1])
        return (
            EmbedTxt(ids(self.tokens), ids(self.positions), ins),
            Forward(
                in_embeds=ins, ctx_pages=ids(phys_kv[: self.n_ctx]), ctx_last_len=self.last_len,
                out_pages=ids(out_pages), out_offset=self.offset, out_embeds=ids(phys_e[-1:]),
                out_indices=ids([n - 1]),
            ),
            sample_call(phys_e[-1], self.spec),
        )  # fmt: skip

    @staticmethod
    def prepare_batch(commands: list[Command]) -> list[Command]:
        """Prepare the steps of ``commands`` (each command's ``op`` is a Step) in one
        pass: sets each command's ``call``, or its future's exception when its write claim
        is refused. Returns the commands whose handles did not translate, for
        :meth:`prepare` one by one (in order; nothing was done for them)."""
        failed: list[Command] = []
        done: list[tuple[Command, Step, int]] = []  # (command, step, its phys embed)
        flat: list[int] = []  # every integer of the batch's calls, step after step
        for cmd in commands:
            s: Step = cmd.op
            res, inst = s.res, s.instance
            try:  # translate: one dict lookup per handle, no closure
                kv_table, embed_table = res.tables(inst)
                phys_e = [embed_table[h] for h in s.embeds]
                phys_kv = [kv_table[h] for h in s.kv]
            except Exception:  # the single path raises the right error
                failed.append(cmd)
                continue
            if res.cache is not None:
                try:
                    claim(res, inst, phys_kv[s.n_ctx :])
                except ApiError as e:
                    if not cmd.future.done():
                        cmd.future.set_exception(e)
                    continue
            flat += s.tokens
            flat += s.positions
            flat += phys_e
            flat += phys_kv
            done.append((cmd, s, phys_e[-1]))
        if not done:
            return failed
        arr = np.array(flat, dtype=np.int64)
        at = 0
        for cmd, s, out in done:
            n = len(s.tokens)
            tok = arr[at : at + n]
            pos = arr[at + n : at + 2 * n]
            e = at + 2 * n
            ins = arr[e : e + n]
            kv = e + n + 1
            ctx = kv + s.n_ctx
            at = kv + len(s.kv)
            cmd.call = (
                EmbedTxt(tok, pos, ins),
                Forward(
                    in_embeds=ins, ctx_pages=arr[kv:ctx], ctx_last_len=s.last_len,
                    out_pages=arr[ctx:at], out_offset=s.offset, out_embeds=arr[e + n : kv],
                    out_indices=_LAST[n] if n < len(_LAST) else ids([n - 1]),
                ),
                Sample(out) if s.spec is None else sample_call(out, s.spec),  # greedy: inline
            )  # fmt: skip
        return failed


class SampledStep(Step):
    """A :class:`Step` whose value is not the token alone: with log-probabilities, or with
    a grammar constraint that advances with the token."""

    __slots__ = ()

    def finish(self, r):
        return self.spec.finish(r)


class Embed(Op):
    """One queued ``embed_txt``: ``tokens`` at ``positions`` into the inferlet's embedding
    slot handles ``embeds`` (snapshotted at submission)."""

    __slots__ = ("embeds", "instance", "positions", "res", "tokens")
    batched = True

    def __init__(
        self,
        res: ResourceManager,
        instance: int,
        tokens: list[int],
        positions: list[int],
        embeds: list[int],
    ) -> None:
        self.res, self.instance = res, instance
        self.tokens, self.positions, self.embeds = tokens, positions, embeds

    def prepare(self) -> EmbedTxt:
        """The engine call, alone (raises what its caller should see)."""
        try:
            phys = self.res.translate(self.instance, "embed", self.embeds)
        except ResourceError as e:
            raise ApiError(str(e)) from None
        return EmbedTxt(ids(self.tokens), ids(self.positions), ids(phys))

    @staticmethod
    def prepare_batch(commands: list[Command]) -> list[Command]:
        """:meth:`Step.prepare_batch` for embeds: one translation pass, one array."""
        failed: list[Command] = []
        done: list[tuple[Command, int]] = []  # (command, its number of tokens)
        flat: list[int] = []
        for cmd in commands:
            e: Embed = cmd.op
            try:
                table = e.res.tables(e.instance)[1]
                phys = [table[h] for h in e.embeds]
            except Exception:  # the single path raises the right error
                failed.append(cmd)
                continue
            flat += e.tokens
            flat += e.positions
            flat += phys
            done.append((cmd, len(phys)))
        if done:
            arr = np.array(flat, dtype=np.int64)
            at = 0
            for cmd, n in done:
                cmd.call = EmbedTxt(
                    arr[at : at + n], arr[at + n : at + 2 * n], arr[at + 2 * n : at + 3 * n]
                )
                at += 3 * n
        return failed


# ``out_indices`` of a step of n tokens ([n - 1]), shared read-only for the small n
_LAST = [ids([n - 1]) for n in range(65)]
for _a in _LAST:
    _a.flags.writeable = False
