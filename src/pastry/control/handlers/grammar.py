"""Handlers of the grammar constraints (:mod:`pastry.control.constraints`)."""

from __future__ import annotations

from pastry import api
from pastry.api import ApiError
from pastry.control.constraints import HostConstraint
from pastry.control.handlers.caller import Caller
from pastry.control.handlers.registry import handles
from pastry.control.quotas import QuotaError


@handles(api.CreateConstraint)
def create_constraint(s: Caller, r: api.CreateConstraint) -> int:
    """A grammar constraint on the queue's model (see :mod:`pastry.control.constraints`)."""
    ref = s.queue(r.q)
    if len(s.constraints) >= s.max_constraints:
        raise QuotaError(
            f"this inferlet holds {len(s.constraints)} grammar constraints, the most it "
            "may at once: free those it is done with (free_constraint)"
        )
    info = ref.model.info
    try:
        c = HostConstraint(ref.model.tokenizer, info.vocab_size, info.eos_token_ids, r.grammar)
    except ImportError as e:
        raise ApiError(f"this server cannot constrain output: {e}") from None
    cid = s.new_handle()
    s.constraints[cid] = c
    return cid


@handles(api.ConstraintState)
def constraint_state(s: Caller, r: api.ConstraintState) -> tuple[bool, bool, list[int]]:
    return s.constraint(r.c).state()


@handles(api.ConstraintConsume)
def constraint_consume(s: Caller, r: api.ConstraintConsume) -> None:
    grammar = s.constraint(r.c)
    if grammar.busy:
        raise ApiError(f"constraint {r.c} is used by a sample in flight; await it first")
    grammar.consume(list(r.tokens))


@handles(api.ConstraintMask)
def constraint_mask(s: Caller, r: api.ConstraintMask) -> bytes:
    return s.constraint(r.c).mask().astype("<i4").tobytes()


@handles(api.FreeConstraint)
def free_constraint(s: Caller, r: api.FreeConstraint) -> None:
    s.constraint(r.c)
    del s.constraints[r.c]
