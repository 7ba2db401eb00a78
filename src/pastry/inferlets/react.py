"""ReAct (Yao et al. 2023): an agent that alternates thoughts and tool calls over HTTP, its
KV cache kept across the calls (Pie §7.1), with the three application-specific
optimizations of Pie §7.2 as options.

The tiny random models write gibberish, so the agent's structure comes from the program,
not from parsing the model's text: every step it generates ``thought_tokens`` tokens
greedily, calls the tool at ``tool_url`` with arguments derived from the first
``call_after`` of them (``?step=k&tokens=id,id,...``), appends the response as an
observation, and goes on; after ``steps`` calls it generates ``answer_tokens`` tokens. The
transcript::

    [tools] prompt "\\nThought:" thought_0 "\\nObservation: <body 0>\\n" "\\nThought:" thought_1
    ... "\\nObservation: <body N-1>\\n" "\\nAnswer:" answer

Nothing is forwarded twice: each piece is appended to the same sequence and only the new
tokens run through the model (a completion API instead re-prefills the whole transcript
for every call). The result reports ``forwarded``, the tokens this instance forwarded.

Optimizations (each off by default; Pie §7.2 #1-#3):

- ``export_tools``: the KV of the tool documentation (``tools``) is computed once and kept
  as a persistent export named ``react-tools/<sha256 of model and tokens>``; later agents
  import its pages and forward only their own tokens. Of agents that start together one
  prefills (it holds the store key ``<name>/lock``) and the others wait for its broadcast
  on the topic ``<name>``. The export's last page is closed (see below), so importers never
  write into shared pages.
- ``early_call``: the HTTP request starts as soon as its arguments are known (after
  ``call_after`` thought tokens) and runs while the rest of the thought is generated; the
  tokens are the same as without it.
- ``drop_results``: an observation is used once, by the thought after it. Once that
  thought is complete (before its last token is forwarded), the observation's tokens stop
  being attended: the pages that hold only them are deallocated (left out of every later
  forward) and its slots in the pages it shares with its neighbours are masked
  (``mask_kvpage``). Later tokens attend less and the agent holds fewer pages; the tokens
  therefore differ from a run that keeps every observation.

Pages and positions: the token at index ``i`` of the transcript has position ``i``, and the
tokens' K/V fill the slots of the pages in order, except after a *closed* page: closing
masks the free slots of the last page and the next token starts a new page. The tool
documentation ends with a closed page, so its pages hold only it and can be shared.

Args (one JSON object; ``prompt`` and ``tools`` are text or lists of token ids)::

    {"prompt": ..., "tool_url": "http://...", "tools": "" (documentation before the prompt),
     "steps": 4, "thought_tokens": 8, "call_after": thought_tokens, "answer_tokens": 8,
     "model": null (the first), "export_tools": false, "early_call": false,
     "drop_results": false, "wait_s": 60 (longest wait for another agent's tool export)}

Result (JSON)::

    {"steps": [{"thought": [ids], "url": "...", "status": 200, "observation": "body"}],
     "answer": [ids], "tokens": transcript length, "forwarded": tokens this instance
     forwarded, "tools_cache": "off" | "miss" (prefilled, exported) | "hit" (imported)
     | "own" (prefilled, not exported), "max_pages_held": most KV pages held at once}

The tool must be on the server's HTTP allowlist (``pastry serve --http-allow``).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
from collections.abc import Awaitable, Sequence

import pastry.sdk as px
from pastry.sdk import ApiError
from pastry.sdk.args import options

THOUGHT = "\nThought:"
OBSERVATION = "\nObservation: {}\n"
ANSWER = "\nAnswer:"

DEFAULTS = {
    "prompt": None,
    "tool_url": None,
    "tools": "",
    "steps": 4,
    "thought_tokens": 8,
    "call_after": None,
    "answer_tokens": 8,
    "model": None,
    "export_tools": False,
    "early_call": False,
    "drop_results": False,
    "wait_s": 60.0,
}


class Transcript:
    """The agent's token sequence in KV pages (see the module docstring): appended to,
    never moved; the token at index ``i`` of ``tokens`` has position ``i``."""

    def __init__(self, q: int) -> None:
        self.q = q
        self.page_size = px.get_kv_page_size(q)
        # Live pages in sequence order, the position of each one's first slot and how many
        # of its slots hold tokens (they hold consecutive positions).
        self.pages: list[int] = []
        self.starts: list[int] = []
        self.counts: list[int] = []
        self.masked: dict[int, list[bool]] = {}  # page -> slots made unattendable
        self.closed = False  # the last page takes no more tokens
        self.length = 0  # tokens in the cache, dropped ones included (= the next position)
        self.tokens: list[int] = []  # every token, dropped ones included
        self.pending: list[int] = []  # appended, not yet forwarded
        self.forwarded = 0  # tokens this instance forwarded
        self.max_pages = 0
        self._embeds: list[int] = []
        self._inflight: list[Awaitable] = []

    def fill(self, tokens: Sequence[int]) -> None:
        self.tokens += tokens
        self.pending += tokens

    def flush(self, output: bool = False) -> int:
        """Issue embed + forward of the pending tokens (not awaited); with ``output`` the
        last one's hidden state goes to the embed slot returned."""
        tokens, self.pending = self.pending, []
        n, ps, q, start = len(tokens), self.page_size, self.q, self.length
        if len(self._embeds) < n + 1:
            self._embeds += px.alloc_embeds(q, n + 1 - len(self._embeds))
        ins, out = self._embeds[:n], self._embeds[n]
        if n == 0:
            return out
        last = self.counts[-1] if self.pages else 0
        room = ps - last if self.pages and not self.closed else 0
        fresh = px.alloc_kvpages(q, -(-(n - room) // ps)) if n > room else []
        self._inflight += [
            px.embed_txt(q, tokens, list(range(start, start + n)), ins),
            px.forward(
                q,
                list(self.pages),  # copies: a queued call reads its lists when it runs
                last,
                ins,
                self.pages[-1:] + fresh if room else fresh,
                last if room else 0,
                [out] if output else [],
            ),
        ]
        if room:
            self.counts[-1] += min(room, n)
        for j, page in enumerate(fresh):
            self.pages.append(page)
            self.starts.append(start + room + j * ps)
            self.counts.append(min(ps, n - room - j * ps))
        self.closed = self.closed and not fresh
        self.length += n
        self.forwarded += n
        self.max_pages = max(self.max_pages, len(self.pages))
        return out

    def close_page(self) -> None:
        """Forward what is pending, then start the next token on a new page (the free slots
        of the last page are masked: never attended, never written)."""
        self.flush()
        if self.pages and not self.closed and self.counts[-1] < self.page_size:
            self._mask(-1, range(self.counts[-1], self.page_size))
        self.closed = True

    def drop(self, begin: int, end: int) -> None:
        """Stop attending the tokens at positions ``begin..end-1`` (all forwarded, followed
        by others in the cache): pages that hold only them are deallocated, the slots of
        the others masked."""
        assert begin < end <= self.length - 1, (begin, end, self.length)
        gone = []
        for i in reversed(range(len(self.pages))):
            first, n = self.starts[i], self.counts[i]
            lo, hi = max(begin, first), min(end, first + n)
            if lo >= hi:
                continue
            if lo == first and hi == first + n:
                gone.append(self.pages.pop(i))
                del self.starts[i], self.counts[i]
                self.masked.pop(gone[-1], None)
            else:
                self._mask(i, range(lo - first, hi - first))
        if gone:
            self._inflight.append(px.dealloc_kvpages(self.q, gone))

    def _mask(self, i: int, slots: range) -> None:
        page = self.pages[i]
        masked = self.masked.setdefault(page, [False] * self.page_size)
        for j in slots:
            masked[j] = True
        self._inflight.append(px.mask_kvpage(self.q, page, list(masked)))

    def adopt(self, pages: list[int], tokens: list[int]) -> None:
        """Start from imported pages holding ``tokens`` (a closed segment)."""
        assert not self.tokens, "adopt only into an empty transcript"
        ps = self.page_size
        self.pages, self.tokens, self.length = list(pages), list(tokens), len(tokens)
        self.starts = [i * ps for i in range(len(pages))]
        self.counts = [min(ps, len(tokens) - i * ps) for i in range(len(pages))]
        self.closed = True
        self.max_pages = len(pages)

    async def sync(self) -> None:
        """Wait for every call issued so far (and raise the first error)."""
        futs, self._inflight = self._inflight, []
        await asyncio.gather(*futs)

    async def generate(self, n: int) -> list[int]:
        """``n`` greedy tokens after the pending ones (the last stays pending)."""
        if n and not self.pending:
            raise ApiError("nothing to generate from: fill the transcript first")
        out: list[int] = []
        for _ in range(n):
            emb = self.flush(output=True)
            futs, self._inflight = self._inflight, []
            *_, tok = await asyncio.gather(*futs, px.sample(self.q, emb))
            out.append(tok)
            self.fill([tok])
        return out


async def main(args: list[str]) -> str:
    opts = _options(args)
    model = opts["model"] or px.available_models()[0]
    q = px.create_queue(model)
    kv = Transcript(q)
    tools = _tokens(q, opts["tools"], "tools", allow_empty=True)
    prompt = _tokens(q, opts["prompt"], "prompt")
    cache = "off"
    if tools and opts["export_tools"]:
        cache = await _shared_tools(kv, model, tools, opts["wait_s"])
    else:
        kv.fill(tools)
    kv.fill(prompt)
    thought_marker = px.tokenize(q, THOUGHT)
    first, rest = opts["call_after"], opts["thought_tokens"] - opts["call_after"]
    steps, used = [], None  # used: the positions of the observation the thought reads
    for k in range(opts["steps"]):
        kv.fill(thought_marker)
        thought = await kv.generate(first)
        url = tool_url(opts["tool_url"], k, thought)
        call = asyncio.ensure_future(px.http_get(url)) if opts["early_call"] else None
        thought += await kv.generate(rest)
        if used:
            kv.drop(*used)
        status, body = await (call if call is not None else px.http_get(url))
        text = body if 200 <= status < 300 else f"HTTP {status}: {body}"
        observation = px.tokenize(q, OBSERVATION.format(text))
        if opts["drop_results"]:
            used = (len(kv.tokens), len(kv.tokens) + len(observation))
        kv.fill(observation)
        steps.append({"thought": thought, "url": url, "status": status, "observation": body})
    kv.fill(px.tokenize(q, ANSWER))  # the answer reads the last observation: it is kept
    answer = await kv.generate(opts["answer_tokens"])
    await kv.sync()
    return json.dumps(
        {
            "steps": steps,
            "answer": answer,
            "tokens": len(kv.tokens),
            "forwarded": kv.forwarded,
            "tools_cache": cache,
            "max_pages_held": kv.max_pages,
        }
    )


def tool_url(base: str, step: int, tokens: Sequence[int]) -> str:
    """The tool call of step ``step``, derived from the thought tokens before it."""
    sep = "&" if "?" in base else "?"
    return f"{base}{sep}step={step}&tokens={','.join(map(str, tokens))}"


def tools_export_name(model: str, tools: Sequence[int]) -> str:
    digest = hashlib.sha256(f"{model}\n{list(tools)}".encode()).hexdigest()
    return f"react-tools/{digest}"


async def _shared_tools(kv: Transcript, model: str, tools: list[int], wait_s: float) -> str:
    """Start ``kv`` with the tool documentation: imported if exported, else prefilled and
    exported. One agent prefills (holding the lock); the others that start meanwhile wait
    for its broadcast."""
    q = kv.q
    name = tools_export_name(model, tools)
    lock = name + "/lock"

    def exported() -> bool:
        return name in dict(px.list_exported_kvpages(q))

    sub = px.subscribe(name)  # before looking: the exporter's broadcast cannot be missed
    try:
        if not exported() and px.store_exists(lock):
            with contextlib.suppress(TimeoutError):  # then prefill our own
                await asyncio.wait_for(px.next_message(sub), wait_s)
        if exported():
            kv.adopt(px.import_kvpages(q, name), tools)
            return "hit"
        exporting = not px.store_exists(lock)
        if exporting:
            px.store_set(lock, str(px.get_instance_id()))
        try:
            kv.fill(tools)
            kv.close_page()
            await kv.sync()
            if not exporting:
                return "own"
            try:
                await px.export_kvpages(q, kv.pages, name, True)
            except ApiError:
                return "own"  # exported by another agent meanwhile: keep our pages
            return "miss"
        finally:
            if exporting:
                px.store_delete(lock)
                px.broadcast(name, "done")  # waiters look again, exported or not
    finally:
        px.unsubscribe(sub)


def _options(args: list[str]) -> dict:
    opts = options(args, DEFAULTS, prompt_keys=())
    if not isinstance(opts["tool_url"], str) or not opts["tool_url"]:
        raise ValueError('"tool_url" is required: the URL of the tool (http or https)')
    for key in ("steps", "thought_tokens", "answer_tokens"):
        if not isinstance(opts[key], int) or opts[key] < 0:
            raise ValueError(f'"{key}" must be a non-negative integer, got {opts[key]!r}')
    if opts["thought_tokens"] < 1:
        raise ValueError(f'"thought_tokens" must be at least 1, got {opts["thought_tokens"]}')
    if opts["call_after"] is None:
        opts["call_after"] = opts["thought_tokens"]
    if not isinstance(opts["call_after"], int) or not (
        1 <= opts["call_after"] <= opts["thought_tokens"]
    ):
        raise ValueError(
            f'"call_after" must be an integer in 1..thought_tokens ({opts["thought_tokens"]}), '
            f"got {opts['call_after']!r}"
        )
    return opts


def _tokens(q: int, value, key: str, allow_empty: bool = False) -> list[int]:
    if isinstance(value, str) and (value or allow_empty):
        return px.tokenize(q, value) if value else []
    if (
        isinstance(value, list)
        and (value or allow_empty)
        and all(isinstance(t, int) for t in value)
    ):
        return list(value)
    raise ValueError(f'"{key}" must be non-empty text or a list of token ids, got {value!r}')
