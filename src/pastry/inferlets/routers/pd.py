"""Prefill/decode disaggregation, 1PnD (microserving Fig. 3 and 4): engine 0 prefills
``prompt[:-1]`` and writes its K/V into the least-loaded decode engine (1..n-1), which
prefills the last token and generates. Context-cache aware: only what the decode engine
does not hold (``matched_len``) is sent. With one live engine left, it serves alone."""

from pastry.sdk.router import disaggregate, engines, serve


async def main(args: list[str]) -> None:
    async def handle(req):
        e = engines(req.model)
        decoders = e.alive(list(range(1, e.count)))
        prefill = e.alive([0])[0]
        await disaggregate(req, prefill, e.least_loaded(decoders), split=-1)

    await serve(handle)
