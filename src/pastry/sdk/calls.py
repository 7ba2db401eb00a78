"""Awaiting the calls of one step: the inferlet wakes once, when the step's last call is
done, and hears the first failure among them in queue order."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence


async def await_step(earlier: Sequence[asyncio.Future], last: asyncio.Future):
    """The result of ``last``, the final call of a step on one queue, once the step's
    ``earlier`` calls are done too; the first failure in queue order is raised.

    A queue's commands complete in order, so the earlier ones are done when ``last`` is
    (unless ``last`` was rejected before they ran): awaiting ``last`` alone wakes the
    inferlet once per step, without a gather's callback round per call. Cancelled (the
    inferlet ends), it cancels the earlier calls too, as a gather would."""
    try:
        try:
            value = await last
        except Exception:
            await _first_failure(earlier)
            raise
        await _first_failure(earlier)
        return value
    except asyncio.CancelledError:
        for f in earlier:
            f.cancel()
        raise


async def _first_failure(futs: Sequence[asyncio.Future]) -> None:
    """Wait for ``futs`` (awaiting a done future does not suspend) and raise the first
    failure among them; every failure is retrieved."""
    failure = None
    for f in futs:
        try:
            await f
        except Exception as e:
            failure = failure or e
    if failure is not None:
        raise failure
