"""A swarm of agents (GPTSwarm, Zhuge et al. 2024) that cooperate through topic messaging
(``broadcast`` / ``subscribe``, Pie §4.3 and §7.1): one coordinator, several workers, each
its own inferlet with its own context.

Every round the coordinator broadcasts a task; each worker appends it to its context,
generates an answer and broadcasts it back; the coordinator appends the answers (in worker
name order) to its own context and generates a summary, which is the next round's task.
After the last round it broadcasts ``done`` and the workers end. Contexts keep their KV
cache across rounds: each round forwards only the new tokens.

Topics and keys, for a swarm named ``<topic>``:

- ``<topic>/tasks``: coordinator to workers, ``{"round": r, "task": text}`` or
  ``{"done": true}``;
- ``<topic>/answers``: workers to coordinator, ``{"worker", "round", "tokens", "text"}``;
- ``<topic>/ready`` and the store key ``<topic>/workers/<name>``: a worker announces itself
  once it has subscribed to the tasks. The coordinator subscribes to ``ready`` first, then
  reads the store, so it finds every worker whether it started before or after it.

A late subscriber does not see earlier messages, hence the handshake: the coordinator
broadcasts the first task only when ``workers`` workers have announced themselves.

Args (one JSON object; ``task`` and ``persona`` are text or lists of token ids)::

    coordinator: {"role": "coordinator", "topic": "swarm", "task": ..., "workers": 2,
                  "rounds": 2, "summary_tokens": 8, "model": null, "wait_s": 60}
    worker:      {"role": "worker", "topic": "swarm", "name": "w0", "persona": ...,
                  "answer_tokens": 8, "model": null, "wait_s": 60}

Results (JSON)::

    coordinator: {"workers": [names], "rounds": [{"task": text, "delivered": workers
                  reached, "answers": {name: [ids]}, "summary": [ids]}]}
    worker:      {"name": ..., "rounds": [{"round": r, "task": text, "tokens": [ids]}]}

``wait_s`` bounds every wait for a message; a worker that does not answer in time ends the
coordinator with an error naming it.
"""

from __future__ import annotations

import asyncio
import json

import pastry.sdk as px
from pastry.sdk import Context, MaxTokens, Sampler

TASK = "\nTask: {}\nAnswer:"
REPLY = "\n{}: {}"
SUMMARY = "\nSummary:"

COMMON = {"role": None, "topic": "swarm", "model": None, "wait_s": 60.0}
COORDINATOR = {**COMMON, "task": None, "workers": 2, "rounds": 2, "summary_tokens": 8}
WORKER = {**COMMON, "name": None, "persona": None, "answer_tokens": 8}


async def main(args: list[str]) -> str:
    given = json.loads(args[0]) if args else {}
    if not isinstance(given, dict) or given.get("role") not in ("coordinator", "worker"):
        raise ValueError('args must be one JSON object with "role": "coordinator" or "worker"')
    if given["role"] == "coordinator":
        return json.dumps(await coordinate(_options(given, COORDINATOR)))
    return json.dumps(await work(_options(given, WORKER)))


async def coordinate(opts: dict) -> dict:
    topic, wait_s = opts["topic"], opts["wait_s"]
    ready = px.subscribe(f"{topic}/ready")  # before reading the store: nobody is missed
    answers = px.subscribe(f"{topic}/answers")
    ctx = Context(opts["model"])
    q = ctx.queue
    workers = {k.rsplit("/", 1)[1] for k in px.store_list_keys(f"{topic}/workers/")}
    while len(workers) < opts["workers"]:
        workers.add(await _next(ready, wait_s, f"{opts['workers'] - len(workers)} more workers"))
    px.unsubscribe(ready)
    task = opts["task"]
    if isinstance(task, str) and task:
        ctx.fill(task)
    elif isinstance(task, list) and task:
        ctx.fill_tokens(task)
        task = px.detokenize(q, task)
    else:
        raise ValueError(f'"task" must be non-empty text or token ids, got {task!r}')
    rounds = []
    for r in range(opts["rounds"]):
        delivered = px.broadcast(f"{topic}/tasks", json.dumps({"round": r, "task": task}))
        got: dict[str, list[int]] = {}
        while len(got) < len(workers):
            missing = ", ".join(sorted(workers - set(got)))
            msg = json.loads(await _next(answers, wait_s, f"the answers of {missing}"))
            if msg["round"] == r and msg["worker"] in workers:
                got[msg["worker"]] = msg
        for name in sorted(got):
            ctx.fill(REPLY.format(name, got[name]["text"]))
        ctx.fill(SUMMARY)
        start = len(ctx.tokens)
        await ctx.generate(Sampler(), MaxTokens(opts["summary_tokens"]))
        summary = ctx.tokens[start:]
        answered = {name: got[name]["tokens"] for name in sorted(got)}
        rounds.append(
            {"task": task, "delivered": delivered, "answers": answered, "summary": summary}
        )
        task = px.detokenize(q, summary)
    px.broadcast(f"{topic}/tasks", json.dumps({"done": True}))
    await ctx.release()
    return {"workers": sorted(workers), "rounds": rounds}


async def work(opts: dict) -> dict:
    topic, name = opts["topic"], opts["name"]
    if not isinstance(name, str) or not name or "/" in name:
        raise ValueError(f'a worker needs a "name" (text without "/"), got {name!r}')
    tasks = px.subscribe(f"{topic}/tasks")
    key = f"{topic}/workers/{name}"
    px.store_set(key, "ready")
    px.broadcast(f"{topic}/ready", name)
    ctx = Context(opts["model"])
    persona = opts["persona"]
    if isinstance(persona, str):
        ctx.fill(persona)
    elif isinstance(persona, list) and persona:
        ctx.fill_tokens(persona)
    else:
        raise ValueError(f'"persona" must be non-empty text or token ids, got {persona!r}')
    rounds = []
    try:
        while True:
            msg = json.loads(await _next(tasks, opts["wait_s"], "the next task"))
            if msg.get("done"):
                break
            ctx.fill(TASK.format(msg["task"]))
            start = len(ctx.tokens)
            await ctx.generate(Sampler(), MaxTokens(opts["answer_tokens"]))
            tokens = ctx.tokens[start:]
            text = px.detokenize(ctx.queue, tokens)
            reply = {"worker": name, "round": msg["round"], "tokens": tokens, "text": text}
            px.broadcast(f"{topic}/answers", json.dumps(reply))
            rounds.append({"round": msg["round"], "task": msg["task"], "tokens": tokens})
    finally:
        px.store_delete(key)
    await ctx.release()
    return {"name": name, "rounds": rounds}


async def _next(sub: int, wait_s: float, what: str) -> str:
    try:
        return await asyncio.wait_for(px.next_message(sub), wait_s)
    except TimeoutError:
        raise TimeoutError(f"waited {wait_s} s for {what}") from None


def _options(given: dict, defaults: dict) -> dict:
    unknown = sorted(set(given) - set(defaults))
    if unknown:
        raise ValueError(
            f"unknown args {unknown} for a {given['role']}; accepted: {', '.join(defaults)}"
        )
    opts = {**defaults, **given}
    if not isinstance(opts["topic"], str) or not opts["topic"]:
        raise ValueError(f'"topic" must be a non-empty string, got {opts["topic"]!r}')
    return opts
