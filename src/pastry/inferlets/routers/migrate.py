"""Context migration (microserving Fig. 5): the router keeps its own index of which engine
holds which context (the first ``block`` tokens of each prompt, ``args[1]``, default 64)
and sends a request where its context is; when that engine carries ``margin`` (``args[0]``,
default 2) more routed contexts than the least-loaded one, the context's K/V move there
(``prep_recv`` on the new engine, ``remote_send`` from the old) and the request follows."""

import pastry.sdk as px
from pastry.sdk.router import engines, serve


async def main(args: list[str]) -> None:
    margin = int(args[0]) if args else 2
    block = int(args[1]) if len(args) > 1 else 64
    home: dict[tuple[int, ...], int] = {}  # context (prompt prefix) -> engine holding it

    async def handle(req):
        e = engines(req.model)
        key = tuple(req.prompt[:block])
        least = e.least_loaded()
        rank = home.get(key)
        if rank is None or rank not in e.alive():
            home[key] = least
            req.start_generate(e.queue(least))
            return
        load = e.load()
        excess = load[rank][1] - load[least][1] - e.incoming[least]
        if len(req.prompt) > 1 and excess >= margin:
            e.incoming[least] += 1  # counted there from now on (see Engines.incoming)
            try:
                kv, matched = await px.prep_recv(e.queue(least), req.prompt, -1)
                await px.remote_send(e.queue(rank), req.prompt, kv, least, matched, -1)
            finally:
                e.incoming[least] -= 1
            home[key] = least
            req.start_generate(e.queue(least), -1)
            return
        req.start_generate(e.queue(rank))

    await serve(handle)
