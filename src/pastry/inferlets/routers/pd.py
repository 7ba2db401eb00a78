"""Prefill/decode disaggregation, 1PnD (microserving Fig. 3 and 4): engine 0 prefills
``prompt[:-1]`` and writes its K/V into the least-loaded decode engine (1..n-1), which
prefills the last token and generates. Context-cache aware: only what the decode engine
does not hold (``matched_len``) is sent. With one live engine left, it serves alone."""

from pastry.sdk.router import disaggregate, engines, serve


async def main(args: list[str]) -> None:
    async def handle(req):
        e = engines(req.model)
        live = e.alive()
        decode = e.least_loaded([r for r in live if r != 0] or live)
        await disaggregate(req, 0 if 0 in live else decode, decode, split=-1)

    await serve(handle)
