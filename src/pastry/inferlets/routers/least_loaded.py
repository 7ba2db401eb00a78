"""Data parallel, least loaded: each request, whole, to the engine with the fewest routed
contexts running (then the fewest queued tokens)."""

from pastry.sdk.router import engines, serve


async def main(args: list[str]) -> None:
    async def handle(req):
        e = engines(req.model)
        req.start_generate(e.queue(e.least_loaded()), begin=0)

    await serve(handle)
