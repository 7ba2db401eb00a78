"""Prefill/decode disaggregation, xPyD (microserving Fig. 3 and 4): the first ``P`` engines
(``args[0]``, default 1: 1PnD) prefill, the others decode. A request's ``prompt[:-1]`` is
computed on the prefill engine with the fewest tokens queued and its K/V written into the
least-loaded decode engine, which prefills the last token and generates. Context-cache
aware: only what the decode engine does not hold (``matched_len``) is sent. With no live
engine of one kind left, the others serve alone."""

from pastry.sdk.router import disaggregate, engines, prefill_count, roles, serve


async def main(args: list[str]) -> None:
    count = prefill_count(args[0] if args else "1")

    async def handle(req):
        prefill, decode = roles(engines(req.model), count)
        await disaggregate(req, prefill, decode, split=-1)

    await serve(handle)
