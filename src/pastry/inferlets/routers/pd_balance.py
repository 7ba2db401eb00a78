"""Balanced prefill/decode disaggregation (microserving Fig. 6): the prefill engine computes
the first ``1 - ratio`` of the prompt, the decode engine prefills the last ``ratio`` with
its decoding. ``args[0]``: the ratio (default 0.2); ``args[1]``: how many of the first
engines prefill (default 1), as for ``pd``."""

from pastry.sdk.router import disaggregate, engines, prefill_count, roles, serve


async def main(args: list[str]) -> None:
    ratio = float(args[0]) if args else 0.2
    if not 0 <= ratio < 1:
        raise ValueError(f"the balance ratio must be in [0, 1), got {ratio}")
    count = prefill_count(args[1] if len(args) > 1 else "1")

    async def handle(req):
        n = len(req.prompt)
        split = min(int(n * (1 - ratio)), n - 1)
        prefill, decode = roles(engines(req.model), count)
        await disaggregate(req, prefill, decode, split)

    await serve(handle)
