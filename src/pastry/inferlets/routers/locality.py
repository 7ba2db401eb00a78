"""Autellix's data-locality-aware load balancer (Alg. 2): a call of at most ``threshold``
input tokens (``args[0]``, default 2048) goes to the least-used engine; a longer one to the
engine its program is pinned to, the first long call pinning the program to the least-used
engine, so that a program's long contexts stay where its K/V are."""

from pastry.sdk.router import engines, serve


async def main(args: list[str]) -> None:
    threshold = int(args[0]) if args else 2048
    pins: dict[int, int] = {}  # program -> engine

    async def handle(req):
        e = engines(req.model)
        if len(req.prompt) <= threshold:
            rank = e.least_loaded()
        else:
            rank = pins.get(req.program)
            if rank is None or rank not in e.alive():
                rank = pins[req.program] = e.least_loaded()
        req.start_generate(e.queue(rank), begin=0)

    await serve(handle)
