"""The inferlet that replays a :class:`~pastry.sched.programs.ProgramSpec` on the real
engine (the scheduling benchmark's programs; the source of this module is the inferlet).

    args: [spec JSON, seed, vocabulary size]

One root ``Context`` holds the program's main thread. A single-call stage runs on it; a
stage of k parallel calls runs on the root and k - 1 forks of it (sharing its pages), the
forks released afterwards, so the program continues from the root (a tree search that
keeps one path); a ``fork`` stage runs all k calls on forks (the root stays as it was).
A call fills ``prefill`` seeded random token ids (3 and up) and generates ``decode``
tokens greedily (no end-of-sequence stop: the length is the spec's). The shared prefix
is the same token sequence in every program. After each stage the inferlet sleeps the
stage's interrupt (a tool call or a human: time outside the engine). The result is
``{"tokens": generated tokens}``.
"""

import asyncio
import json
import random

from pastry.sdk import Context, MaxTokens, Sampler


async def main(args):
    spec, seed, vocab = json.loads(args[0]), int(args[1]), int(args[2])
    rng = random.Random(seed)

    def tokens(n):
        return [rng.randrange(3, vocab) for _ in range(n)]

    root = Context()
    root.fill_tokens([3 + (i * 7919) % (vocab - 3) for i in range(spec["shared_prefix"])])
    generated = 0

    async def call(ctx, prefill, decode):
        ctx.fill_tokens(tokens(prefill))
        await ctx.generate(Sampler(), MaxTokens(decode))

    for stage in spec["stages"]:
        calls = stage["calls"]
        on_forks = stage.get("fork", False)
        forks = [await root.fork() for _ in (calls if on_forks else calls[1:])]
        ctxs = forks if on_forks else [root, *forks]
        await asyncio.gather(*(call(c, p, d) for c, (p, d) in zip(ctxs, calls, strict=True)))
        generated += sum(d for _, d in calls)
        for f in forks:
            await f.release()
        if stage["interrupt_s"] > 0:
            await asyncio.sleep(stage["interrupt_s"])
    await root.release()
    return json.dumps({"tokens": generated})
