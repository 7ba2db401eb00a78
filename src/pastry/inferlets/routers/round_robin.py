"""Data parallel, round robin (microserving Fig. 2): each request, whole, to the next engine."""

import itertools

from pastry.sdk.router import engines, serve


async def main(args: list[str]) -> None:
    turn = itertools.count()

    async def handle(req):
        e = engines(req.model)
        live = e.alive()
        req.start_generate(e.queue(live[next(turn) % len(live)]), begin=0)

    await serve(handle)
