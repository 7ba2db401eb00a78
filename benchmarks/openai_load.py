"""One load generator for any OpenAI-compatible server: Pastry, vLLM, anything with /v1.

    python benchmarks/openai_load.py URL [--concurrency 16] [--requests 64] [--tokens 64]

Used by ``vs_vllm.py`` so that both servers are driven by the same client. A workload is a
list of :class:`Conversation`s; ``concurrency`` workers take conversations from a queue and
play their turns one after another (a turn's answer, as streamed back, joins the messages of
the next turn). Every request streams (``stream: true`` with ``stream_options.include_usage``),
is greedy (``temperature: 0``) and, unless a conversation says otherwise, asks the server to
generate exactly ``max_tokens`` tokens with ``ignore_eos`` (a vLLM extension that Pastry
accepts too; a plain OpenAI server refuses it, and that refusal is reported, not hidden).

Per turn: TTFT is the time from sending the request to the first streamed chunk with text;
TPOT is (end - first text) / (output tokens - 1), as vLLM's ``benchmark_serving`` defines it,
for turns of more than one token. Output tokens are the server's ``usage.completion_tokens``
(counted from the streamed chunks when the server sends no usage). :func:`summarize` turns
the turns into :class:`Stats`: output tokens/s and requests (turns)/s over the wall time of
the whole run, TTFT and TPOT mean and p99; failed turns are counted, with the first error,
and turns that stopped before ``max_tokens`` despite ``ignore_eos`` are counted as ``short``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field

import httpx


@dataclass(frozen=True)
class Conversation:
    """One client's requests. ``turns``: the user messages, sent one after the other on
    the chat endpoint with the answers so far in between; or, when ``prompt`` is set, a
    single completion of that prompt (``turns`` unused)."""

    turns: tuple[str, ...] = ()
    prompt: str | None = None
    system: str | None = None
    max_tokens: int = 64
    ignore_eos: bool = True
    response_format: dict | None = None  # OpenAI's, e.g. {"type": "json_schema", ...}

    def __post_init__(self) -> None:
        if (self.prompt is None) == (not self.turns):
            raise ValueError("a Conversation has either a prompt or turns, not both or neither")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")


@dataclass(frozen=True)
class Turn:
    """What one request measured. Times in seconds from the request's start; ``ttft`` is
    None when no text arrived; ``error`` is None for a turn that completed."""

    ttft: float | None
    latency: float
    output_tokens: int
    max_tokens: int
    ignore_eos: bool
    text: str = ""
    error: str | None = None

    @property
    def tpot(self) -> float | None:
        if self.error is not None or self.ttft is None or self.output_tokens < 2:
            return None
        return (self.latency - self.ttft) / (self.output_tokens - 1)


@dataclass(frozen=True)
class Stats:
    """A run's figures (seconds; ``None`` where no turn gave the figure)."""

    requests: int
    failed: int
    short: int  # completed with fewer than max_tokens tokens although ignore_eos was asked
    duration: float
    output_tokens: int
    output_tok_s: float
    requests_s: float
    ttft_mean: float | None
    ttft_p99: float | None
    tpot_mean: float | None
    tpot_p99: float | None
    first_error: str | None = None

    def row(self) -> dict:
        """The figures rounded for a JSON line (ms for TTFT / TPOT)."""
        ms = lambda x: None if x is None else round(x * 1e3, 1)  # noqa: E731
        return {
            "output_tok_s": round(self.output_tok_s, 1),
            "requests_s": round(self.requests_s, 3),
            "ttft_mean_ms": ms(self.ttft_mean),
            "ttft_p99_ms": ms(self.ttft_p99),
            "tpot_mean_ms": ms(self.tpot_mean),
            "tpot_p99_ms": ms(self.tpot_p99),
            "requests": self.requests,
            "failed": self.failed,
            "short": self.short,
            "duration_s": round(self.duration, 2),
        }


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0-100) with linear interpolation between the closest ranks
    (numpy's default), e.g. ``percentile([1, 2, 3, 4], 50) == 2.5``."""
    if not values:
        raise ValueError("percentile of no values")
    if not 0 <= q <= 100:
        raise ValueError(f"q must be within 0..100, got {q}")
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100
    lo, hi = math.floor(pos), math.ceil(pos)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def summarize(turns: Sequence[Turn], duration: float) -> Stats:
    """Figures over ``turns`` measured in ``duration`` seconds of wall time."""
    if duration <= 0:
        raise ValueError(f"duration must be > 0, got {duration}")
    ok = [t for t in turns if t.error is None]
    failed = [t for t in turns if t.error is not None]
    ttfts = [t.ttft for t in ok if t.ttft is not None]
    tpots = [p for t in ok if (p := t.tpot) is not None]
    tokens = sum(t.output_tokens for t in ok)
    mean = lambda xs: sum(xs) / len(xs) if xs else None  # noqa: E731
    p99 = lambda xs: percentile(xs, 99) if xs else None  # noqa: E731
    return Stats(
        requests=len(turns),
        failed=len(failed),
        short=sum(1 for t in ok if t.ignore_eos and t.output_tokens < t.max_tokens),
        duration=duration,
        output_tokens=tokens,
        output_tok_s=tokens / duration,
        requests_s=len(ok) / duration,
        ttft_mean=mean(ttfts),
        ttft_p99=p99(ttfts),
        tpot_mean=mean(tpots),
        tpot_p99=p99(tpots),
        first_error=failed[0].error if failed else None,
    )


def request_body(model: str, conv: Conversation, messages: list[dict] | None) -> dict:
    """The JSON body of one turn: a completion of ``conv.prompt``, or a chat on ``messages``."""
    body: dict = {
        "model": model,
        "max_tokens": conv.max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if conv.ignore_eos:
        body["ignore_eos"] = True
    if conv.response_format is not None:
        body["response_format"] = conv.response_format
    if messages is None:
        body["prompt"] = conv.prompt
    else:
        body["messages"] = messages
    return body


async def one_turn(client: httpx.AsyncClient, path: str, body: dict) -> Turn:
    """POST one streamed request and time it."""
    t0 = time.perf_counter()
    ttft, usage, chunks, text = None, None, 0, []
    max_tokens, ignore = body["max_tokens"], bool(body.get("ignore_eos"))
    try:
        async with client.stream("POST", path, json=body) as r:
            if r.status_code != 200:
                detail = (await r.aread()).decode(errors="replace")[:300]
                return Turn(None, time.perf_counter() - t0, 0, max_tokens, ignore,
                            error=f"HTTP {r.status_code}: {detail}")  # fmt: skip
            async for line in r.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                event = json.loads(data)
                if "error" in event:
                    return Turn(ttft, time.perf_counter() - t0, 0, max_tokens, ignore,
                                error=f"stream error: {event['error']}")  # fmt: skip
                if event.get("usage"):
                    usage = event["usage"]
                for choice in event.get("choices") or ():
                    piece = choice.get("text") or (choice.get("delta") or {}).get("content")
                    if piece:
                        if ttft is None:
                            ttft = time.perf_counter() - t0
                        chunks += 1
                        text.append(piece)
    except httpx.HTTPError as e:
        return Turn(ttft, time.perf_counter() - t0, 0, max_tokens, ignore,
                    error=f"{type(e).__name__}: {e}")  # fmt: skip
    latency = time.perf_counter() - t0
    tokens = int(usage["completion_tokens"]) if usage else chunks
    return Turn(ttft, latency, tokens, max_tokens, ignore, "".join(text))


async def play(client: httpx.AsyncClient, model: str, conv: Conversation) -> list[Turn]:
    """All turns of one conversation, in order (the first failed turn ends it)."""
    if conv.prompt is not None:
        return [await one_turn(client, "/v1/completions", request_body(model, conv, None))]
    messages = [{"role": "system", "content": conv.system}] if conv.system else []
    out = []
    for user in conv.turns:
        messages.append({"role": "user", "content": user})
        turn = await one_turn(client, "/v1/chat/completions", request_body(model, conv, messages))
        out.append(turn)
        if turn.error is not None:
            break
        messages.append({"role": "assistant", "content": turn.text})
    return out


@dataclass
class Run:
    """The turns of one :func:`run_load` and its wall time."""

    turns: list[Turn] = field(default_factory=list)
    duration: float = 0.0

    @property
    def stats(self) -> Stats:
        return summarize(self.turns, self.duration)


async def run_load(
    base_url: str,
    model: str,
    conversations: Sequence[Conversation],
    concurrency: int,
    timeout: float = 600.0,
) -> Run:
    """Play ``conversations`` with ``concurrency`` clients at once; wall time from the
    first request to the last answer."""
    if concurrency < 1:
        raise ValueError(f"concurrency must be >= 1, got {concurrency}")
    queue: asyncio.Queue[Conversation] = asyncio.Queue()
    for c in conversations:
        queue.put_nowait(c)
    run = Run()
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(base_url=base_url, timeout=timeout, limits=limits) as client:

        async def worker() -> None:
            while not queue.empty():
                run.turns.extend(await play(client, model, queue.get_nowait()))

        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(min(concurrency, len(conversations)))))
        run.duration = time.perf_counter() - t0
    return run


async def served_model(base_url: str) -> str:
    """The first model id ``GET /v1/models`` lists."""
    async with httpx.AsyncClient(base_url=base_url, timeout=30) as client:
        r = await client.get("/v1/models")
        r.raise_for_status()
        return r.json()["data"][0]["id"]


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("url", help="the server's base URL, e.g. http://127.0.0.1:8080")
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--words", type=int, default=200, help="words per prompt")
    args = ap.parse_args()
    from vs_vllm import plain_prompts  # benchmarks/ is on the path (the script's dir)

    convs = [
        Conversation(prompt=p, max_tokens=args.tokens)
        for p in plain_prompts(args.requests, args.words, seed=0)
    ]
    model = asyncio.run(served_model(args.url))
    stats = asyncio.run(run_load(args.url, model, convs, args.concurrency)).stats
    print(json.dumps({"model": model, **asdict(stats)}))


if __name__ == "__main__":
    main()
