"""Balanced prefill/decode disaggregation (microserving Fig. 6): the prefill engine (0)
computes the first ``1 - ratio`` of the prompt, the decode engine prefills the last
``ratio`` with its decoding. ``args[0]``: the ratio (default 0.2)."""

from pastry.sdk.router import disaggregate, engines, serve


async def main(args: list[str]) -> None:
    ratio = float(args[0]) if args else 0.2
    if not 0 <= ratio < 1:
        raise ValueError(f"the balance ratio must be in [0, 1), got {ratio}")

    async def handle(req):
        e = engines(req.model)
        n = len(req.prompt)
        split = min(int(n * (1 - ratio)), n - 1)
        live = e.alive()
        decode = e.least_loaded([r for r in live if r != 0] or live)
        await disaggregate(req, 0 if 0 in live else decode, decode, split)

    await serve(handle)
