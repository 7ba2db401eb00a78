"""The answers of the OpenAI-compatible endpoints (:mod:`pastry.server.openai`): a job's
instances launched and their events relayed (:class:`JobRun`), written as the JSON of a
plain response or, with ``"stream": true``, as server-sent events (``data: {chunk}``, then
``data: [DONE]``). Log-probabilities come back as token ids and numbers and are written
here in the shape of each endpoint (:class:`Writer`); tool calls are read from the outputs
here (:mod:`pastry.server.openai_tools`). A client that goes away ends its instances.
"""

from __future__ import annotations

import json
import math
import time
import uuid
from collections.abc import Awaitable
from typing import Any

from starlette.types import Receive, Scope, Send

from pastry.control.events import Failed, Finished, Message, Terminated
from pastry.runtime.trusted import Instance
from pastry.server import errors, metrics
from pastry.server.auth import user_of
from pastry.server.openai_params import Job, OpenAIError
from pastry.server.openai_tools import RequiredCalls, ToolCall, new_call_id, parse_required
from pastry.server.relay import Events, relay, send_json
from pastry.server.service import PastryServer


class Writer:
    """Token ids and log-probabilities written in the OpenAI shapes of one request."""

    def __init__(self, tokenizer, job: Job) -> None:
        self.tok = tokenizer
        self.job = job
        self._vocab: list[bytes] | None = None
        self._text: dict[int, str] = {}

    def text(self, token: int) -> str:
        """A token's text as vLLM shows it (the decoding of that token alone)."""
        s = self._text.get(token)
        if s is None:
            raw = bytes(self.raw(token))
            s = self._text[token] = self.tok.decode([token]) if raw else ""
        return s

    def raw(self, token: int) -> list[int]:
        if self._vocab is None:
            self._vocab = self.tok.get_vocabs()
        return list(self._vocab[token]) if token < len(self._vocab) else []

    def completion_logprobs(self, entries: list, offset: int = 0) -> dict:
        """``{"tokens", "token_logprobs", "top_logprobs", "text_offset"}``: an entry is
        ``[token, logprob, [[id, logprob], ...]]`` or None (a prompt's first token, which
        needs the token id: given as ``[token, None, None]``)."""
        out: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}  # fmt: skip
        for token, lp, top in entries:
            s = self.text(token)
            out["tokens"].append(s)
            out["text_offset"].append(offset)
            offset += len(s)
            if lp is None:
                out["token_logprobs"].append(None)
                out["top_logprobs"].append(None)
                continue
            out["token_logprobs"].append(_finite(lp))
            tops = {self.text(t): _finite(v) for t, v in top}
            tops.setdefault(s, _finite(lp))  # vLLM also lists the chosen token
            out["top_logprobs"].append(tops)
        return out

    def chat_logprobs(self, entries: list) -> dict:
        def one(token: int, lp: float) -> dict:
            return {"token": self.text(token), "logprob": _finite(lp), "bytes": self.raw(token)}

        content = [
            {**one(token, lp), "top_logprobs": [one(t, v) for t, v in top]}
            for token, lp, top in entries
        ]
        return {"content": content, "refusal": None}

    def logprobs(self, entries: list | None, offset: int = 0) -> dict | None:
        if entries is None or self.job.logprobs is None:
            return None
        if self.job.chat:
            return self.chat_logprobs(entries)
        return self.completion_logprobs(entries, offset)


def _finite(x: float) -> float:
    return -9999.0 if x == -math.inf or math.isnan(x) else x


def _prompt_entries(prompt: dict) -> list:
    lps = prompt.get("logprobs")
    if lps is None:
        return [[t, None, None] for t in prompt["tokens"]]
    return [[t, None, None] if e is None else e for t, e in zip(prompt["tokens"], lps, strict=True)]


SSE_HEADERS = [
    (b"content-type", b"text/event-stream; charset=utf-8"),
    (b"cache-control", b"no-cache"),
]


async def send_event(send: Send, data: dict | str) -> None:
    """One server-sent event ``data: {json}`` (or ``data: [DONE]``) of a stream."""
    text = data if isinstance(data, str) else json.dumps(data)
    body = f"data: {text}\n\n".encode()
    await send({"type": "http.response.body", "body": body, "more_body": True})


class JobRun:
    """The answer to one request, as an ASGI response: launches the job's instances, relays
    their events to ``_reply`` (a JSON body) or ``_stream`` (server-sent events), and ends
    them if the client goes away. The endpoints' answers (chat and completions here, the
    Responses and Messages APIs in their modules) are subclasses."""

    prefix = "req-"

    def __init__(
        self, server: PastryServer, job: Job, session: str | None = None, endpoint: str = ""
    ) -> None:
        self.server = server
        self.job = job
        self.id = self.prefix + uuid.uuid4().hex
        self.program = session or f"request:{self.id}"  # its entry in the process table
        self.created = int(time.time())
        self.writer = Writer(server.controller.models[job.model].tokenizer, job)
        self.endpoint = endpoint or job.endpoint  # for the metrics
        self.clock = metrics.RequestClock(self.endpoint)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        user = user_of(scope)

        def launch(arg: str) -> Instance:
            program = self.job.program
            instance = self.server.launch(program, [arg], owner=self, user=user, builtin=True)
            self.server.controller.programs.join(instance.id, self.program)
            self.clock.watch(instance.id)
            return instance

        def answer(events: Events) -> Awaitable[None]:
            return self._stream(events, send) if self.job.stream else self._reply(events, send)

        try:
            await relay(self.server, self, self.job.args, launch, answer, receive)
        finally:
            self.clock.close()

    async def _reply(self, events: Events, send: Send) -> None:
        raise NotImplementedError

    async def _stream(self, events: Events, send: Send) -> None:
        raise NotImplementedError


class Run(JobRun):
    """Chat and completions."""

    def __init__(self, server: PastryServer, job: Job, session: str | None = None) -> None:
        self.prefix = "chatcmpl-" if job.chat else "cmpl-"
        super().__init__(server, job, session)

    # ------------------------------------------------------------------ plain answers

    async def _reply(self, events: Events, send: Send) -> None:
        results: dict[int, dict] = {}
        while len(results) < len(self.job.args):
            k, ev = await events.get()
            match ev:
                case Finished(result):
                    results[k] = json.loads(result)
                case Failed() | Terminated():
                    error = instance_error(ev)
                    metrics.request_done(self.job.endpoint, error.status)
                    await send_json(send, error.status, error.body())
                    return
        n = self.job.n
        choices = [
            self._choice(k * n + c["index"], c, results[k]["prompt"])
            for k in sorted(results)
            for c in results[k]["choices"]
        ]
        usage = _total(r["usage"] for r in results.values())
        body = {
            "id": self.id,
            "object": "chat.completion" if self.job.chat else "text_completion",
            "created": self.created,
            "model": self.job.served,
            "system_fingerprint": None,
            "choices": choices,
            "usage": usage,
        }
        metrics.request_done(self.job.endpoint, 200, usage)
        await send_json(send, 200, body)

    def _choice(self, index: int, c: dict, prompt: dict) -> dict:
        w, finish = self.writer, c["finish_reason"]
        if self.job.chat:
            message, finish = self._message(c["text"], finish)
            body = {"message": message, "logprobs": w.logprobs(c["logprobs"])}
        elif self.job.echo:
            prompt_text = w.tok.decode(prompt["tokens"])
            entries = None
            if c["logprobs"] is not None:
                entries = _prompt_entries(prompt) + c["logprobs"]
            body = {"text": prompt_text + c["text"], "logprobs": w.logprobs(entries)}
        else:
            body = {"text": c["text"], "logprobs": w.logprobs(c["logprobs"])}
        return {"index": index, **body, "finish_reason": finish}

    def _message(self, text: str, finish: str) -> tuple[dict, str]:
        return chat_message(self.job, text, finish)

    # ------------------------------------------------------------------ streams

    async def _stream(self, events: Events, send: Send) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": SSE_HEADERS})

        async def emit(data: dict | str) -> None:
            await send_event(send, data)

        n = self.job.n
        states: dict[int, ChoiceStream] = {}

        def state(i: int) -> ChoiceStream:
            if i not in states:
                states[i] = ChoiceStream(self.job, self.writer)
            return states[i]

        if self.job.chat:  # one prompt
            for i in range(n):
                await emit(self._chunk(i, {"role": "assistant", "content": ""}))
        usages, left, failed = [], len(self.job.args), False
        while left:
            k, ev = await events.get()
            match ev:
                case Message(text):
                    m = json.loads(text)
                    if "prompt" in m:  # the echo of a completion, first
                        for i in range(k * n, k * n + n):
                            await emit(self._echo(i, state(i), m["prompt"]))
                        continue
                    i = k * n + m["index"]
                    for delta, lps in state(i).feed(m["delta"], m["logprobs"]):
                        await emit(self._chunk(i, delta, logprobs=lps))
                case Finished(result):
                    done = json.loads(result)
                    usages.append(done["usage"])
                    for c in done["choices"]:
                        i = k * n + c["index"]
                        for delta, lps, end in state(i).finish(c, c["finish_reason"]):
                            await emit(self._chunk(i, delta, end, lps))
                    left -= 1
                case Failed() | Terminated():
                    error = instance_error(ev)
                    metrics.request_done(self.job.endpoint, error.status)
                    await emit(error.body())
                    failed = True
                    break
        if not failed:
            usage = _total(usages)
            metrics.request_done(self.job.endpoint, 200, usage)
            if self.job.include_usage:
                await emit({**self._chunk(0, None), "choices": [], "usage": usage})
        await emit("[DONE]")
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    def _echo(self, index: int, stream: ChoiceStream, prompt: dict) -> dict:
        """The chunk of a completion's echoed prompt (with its logprobs, when asked)."""
        entries = _prompt_entries(prompt) if prompt["logprobs"] else None
        lps = self.writer.logprobs(entries, stream.offset)
        text = self.writer.tok.decode(prompt["tokens"])
        stream.offset += len(text)
        return self._chunk(index, text, logprobs=lps)

    def _chunk(
        self,
        index: int,
        delta: str | dict | None,
        finish: str | None = None,
        logprobs: dict | None = None,
    ) -> dict:
        """One choice's piece of a stream: text (or, in chat, a delta object), or its finish."""
        if self.job.chat:
            piece = {"delta": {"content": delta} if isinstance(delta, str) else delta or {}}
        else:
            piece = {"text": delta or ""}
        choice = {"index": index, **piece, "logprobs": logprobs, "finish_reason": finish}
        chunk = {
            "id": self.id,
            "object": "chat.completion.chunk" if self.job.chat else "text_completion",
            "created": self.created,
            "model": self.job.served,
            "system_fingerprint": None,
            "choices": [choice],
        }
        if self.job.include_usage:
            chunk["usage"] = None
        return chunk


def chat_message(job: Job, text: str, finish: str) -> tuple[dict, str]:
    """The assistant message of a chat choice, with its tool calls read from the text, and
    its finish reason ("tool_calls" when it ended on calls)."""
    message: dict[str, Any] = {"role": "assistant", "content": text, "refusal": None}
    tools = job.tools
    calls: list[ToolCall] = []
    if tools is None:
        return message, finish
    if tools.mode == "auto":
        content, calls = tools.fmt.parse(text)
        calls = calls if tools.parallel else calls[:1]  # parallel_tool_calls false: one
    elif tools.mode == "named":
        content, calls = None, [ToolCall(tools.name, text, new_call_id())]
    else:  # the complete calls, also of an output cut short by max_tokens
        content, calls = None, parse_required(text)
        message["content"] = None
    if calls:
        message["content"] = content
        message["tool_calls"] = [c.to_openai() for c in calls]
        if tools.mode != "named" and finish == "stop":
            finish = "tool_calls"
    return message, finish


class ChoiceStream:
    """The stream of one choice: text deltas (or tool call deltas) and their logprobs."""

    def __init__(self, job: Job, writer: Writer) -> None:
        self.job, self.writer = job, writer
        self.sent_logprobs = 0  # log-probability entries streamed
        self.offset = 0  # characters streamed (completions' text_offset)
        self.text = ""
        self.calls = 0
        tools = job.tools
        self.tool_stream = tools.fmt.stream() if tools and tools.mode == "auto" else None
        self.required = RequiredCalls() if tools and tools.mode == "required" else None

    def _lps(self, entries: list | None) -> dict | None:
        if not entries:
            return None
        self.sent_logprobs += len(entries)
        lps = self.writer.logprobs(entries, self.offset)
        return lps

    def feed(self, delta: str, entries: list | None) -> list[tuple[Any, dict | None]]:
        """Chunks for a text delta of the inferlet."""
        lps = self._lps(entries)
        self.text += delta
        tools = self.job.tools
        if tools is None:
            self.offset += len(delta)
            return [(delta, lps)]
        if self.required is not None:  # each call once it is complete
            out = [({}, lps)] if lps else []
            for call in self.required.feed(delta):
                out.append(({"tool_calls": [call.to_openai(self.calls)]}, None))
                self.calls += 1
            return out
        if tools.mode == "named":
            first = self.calls == 0
            self.calls = 1
            fn: dict[str, Any] = {"arguments": delta}
            call: dict[str, Any] = {"index": 0, "function": fn}
            if first:
                call.update(id=new_call_id(), type="function")
                fn["name"] = tools.name
            return [({"tool_calls": [call]}, lps)]
        shown, calls = self.tool_stream.feed(delta)
        out: list[tuple[Any, dict | None]] = []
        if shown or lps:
            out.append((shown, lps))
        for c in calls if tools.parallel or not self.calls else []:
            out.append(({"tool_calls": [c.to_openai(self.calls)]}, None))
            self.calls += 1
            if not tools.parallel:
                break
        return out

    def finish(self, c: dict, finish: str) -> list[tuple[Any, dict | None, str | None]]:
        """The last chunks: what is left of the text and the logprobs, then the finish."""
        rest = c["logprobs"][self.sent_logprobs :] if c["logprobs"] is not None else None
        lps = self._lps(rest)
        out: list[tuple[Any, dict | None, str | None]] = []
        tools = self.job.tools
        if self.required is not None:  # the text's calls not yet sent (a stop string cut)
            for call in parse_required(c["text"])[self.calls :]:
                out.append(({"tool_calls": [call.to_openai(self.calls)]}, None, None))
                self.calls += 1
        elif tools is not None and tools.mode == "named" and self.calls == 0:
            call = ToolCall(tools.name, c["text"], new_call_id())
            out.append(({"tool_calls": [call.to_openai(0)]}, None, None))
            self.calls = 1
        elif self.tool_stream is not None:
            rest_text = self.tool_stream.close()
            if rest_text:
                out.append((rest_text, None, None))
        if self.calls and tools is not None and tools.mode != "named" and finish == "stop":
            finish = "tool_calls"
        empty: Any = {} if self.job.chat else ""
        out.append((empty, lps, finish))
        return out


def instance_error(ev: Failed | Terminated) -> OpenAIError:
    if isinstance(ev, Terminated):
        return OpenAIError(f"the request was ended: {ev.reason}", None, 503, None, "server_error")
    errors.note_failure(f"a built-in inferlet failed:\n{ev.error}")  # the log, not the client
    message = f"generation failed: {errors.failure_reason(ev.error)}"
    rid = errors.current_request_id()
    if rid is not None:
        message += f" (logged as request {rid})"
    return OpenAIError(message, None, 500, None, "server_error")


def _total(usages) -> dict:
    total = {"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0}
    cached = 0  # prompt tokens that came from the prefix cache
    for u in usages:
        for key in total:
            total[key] += u[key]
        cached += u.get("prompt_tokens_details", {}).get("cached_tokens", 0)
    return {**total, "prompt_tokens_details": {"cached_tokens": cached}}
