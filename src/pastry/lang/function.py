"""``@function``: an SGLang program, and the ways to run it.

- Inside an inferlet (in the server, trusted or sandboxed): ``await f.arun(**args)``,
  ``await f.arun_batch([...])``; or make the program's file an inferlet with
  ``async def main(args): return await f.main(args)`` and run it with
  ``pastry run file.py -- key=value ...``.
- From a client process: ``f.run(**args)`` / ``f.run_batch([...])`` with a backend
  (``set_default_backend(Endpoint(url))``): each call ships the program to the server and
  runs it there as one inferlet (:mod:`pastry.lang.endpoint`).
- Called from inside another program's body, ``f(**args)`` runs as a nested program: a new
  state, concurrent with its caller.
"""

from __future__ import annotations

import asyncio
import inspect
import json
from collections.abc import Callable, Sequence
from dataclasses import fields
from typing import Any

from pastry.lang.expr import SamplingParams
from pastry.lang.run import Run, active_run
from pastry.lang.state import ProgramState
from pastry.sdk.current import api

SAMPLING = frozenset(f.name for f in fields(SamplingParams))
_default_backend: list[Any] = [None]


def set_default_backend(backend: Any) -> None:
    """The backend ``run`` / ``run_batch`` use when none is given (an :class:`Endpoint`)."""
    _default_backend[0] = backend


def get_default_backend() -> Any:
    return _default_backend[0]


class Function:
    """A program: ``func(s, *args)`` where ``s`` is the prompt state."""

    def __init__(
        self,
        func: Callable[..., Any],
        num_api_spec_tokens: int | None = None,
        bind_arguments: dict[str, Any] | None = None,
    ) -> None:
        params = list(inspect.signature(func).parameters)
        if not params or params[0] != "s":
            raise TypeError(
                f"{func.__name__}: the first parameter of a pastry.lang function must be "
                f"`s` (the prompt state), got {params[:1]}"
            )
        if num_api_spec_tokens is not None:
            raise ValueError(
                f"{func.__name__}: num_api_spec_tokens is SGLang's speculative execution of "
                "calls to an OpenAI-style API backend, which pastry.lang does not have (every "
                "gen runs on the server's engine, inside the program): leave it unset"
            )
        self.func = func
        self.num_api_spec_tokens = num_api_spec_tokens
        self.bind_arguments = dict(bind_arguments or {})
        self.arg_names = params[1:]
        self.__name__ = func.__name__
        self.__doc__ = func.__doc__

    def __repr__(self) -> str:
        return f"<pastry.lang function {self.__name__}>"

    def bind(self, **kwargs: Any) -> Function:
        unknown = sorted(set(kwargs) - set(self.arg_names))
        if unknown:
            raise TypeError(f"{self.__name__} has no arguments {unknown}")
        return Function(self.func, self.num_api_spec_tokens, {**self.bind_arguments, **kwargs})

    # ------------------------------------------------------------------ running

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        run = active_run()
        if run is not None:
            return self._nested(run, args, kwargs)
        return self.run(*args, **kwargs)

    def run(
        self,
        *args: Any,
        stream: bool = False,
        backend: Any = None,
        adapter: str | None = None,
        **kwargs: Any,
    ):
        """Run the program to completion and return its state (``state["x"]``,
        ``state.text()``). Keyword arguments named like sampling parameters
        (``max_new_tokens``, ``temperature``, ``stop``...) are the defaults of every
        ``gen``; the others are the program's arguments. ``stream=True`` returns at once; the
        state's ``text_iter()`` yields the text as it is generated. ``adapter``: a LoRA
        adapter loaded on the server's model (``/v1/models`` lists them), applied to every
        generation and score of the run; None: the backend's (``Endpoint(adapter=...)``)."""
        run = active_run()
        if run is not None and backend is None:
            if adapter is not None:
                raise TypeError(
                    f"{self.__name__}: a nested call runs with its run's adapter; "
                    "adapter= is for a run of its own"
                )
            return self._nested(run, args, kwargs)
        sampling, kw = _split(kwargs)
        backend = backend or get_default_backend()
        if backend is None:
            raise RuntimeError(
                f"{self.__name__}.run() needs a backend: pastry.lang.set_default_backend("
                "pastry.lang.Endpoint('http://HOST:PORT')) in a client; inside an inferlet "
                f"use `await {self.__name__}.arun(...)`"
            )
        return backend.run(self, self._arguments(args, kw), sampling, stream, adapter=adapter)

    def run_batch(
        self,
        batch_kwargs: Sequence[dict[str, Any] | Sequence[Any]],
        *,
        backend: Any = None,
        num_threads: int | str = "auto",
        progress_bar: bool = False,
        adapter: str | None = None,
        **sampling: Any,
    ) -> list[Any]:
        """Run the program once per argument set, ``num_threads`` at a time; the states in
        order. ``adapter``: as for :meth:`run`."""
        bad = sorted(set(sampling) - SAMPLING)
        if bad:
            raise TypeError(f"unknown sampling parameters {bad}")
        backend = backend or get_default_backend()
        if backend is None:
            raise RuntimeError(
                f"{self.__name__}.run_batch() needs a backend (see run()); inside an inferlet "
                f"use `await {self.__name__}.arun_batch(...)`"
            )
        batch = [self._batch_args(b) for b in batch_kwargs]
        return backend.run_batch(self, batch, sampling, num_threads, progress_bar, adapter=adapter)

    async def arun(
        self,
        *args: Any,
        on_text: Callable[[str], None] | None = None,
        model: str | None = None,
        adapter: str | None = None,
        **kwargs: Any,
    ) -> ProgramState:
        """Run the program in this inferlet (next to its KV) and return its state once
        everything it submitted has run. ``on_text`` receives the program's text as it
        grows (what ``stream=True`` sends a client). ``adapter``: a LoRA adapter of the
        model (``get_adapters``) that every context of the run applies (a name the model
        does not have is an ``ApiError`` listing the loaded ones)."""
        sampling, kw = _split(kwargs)
        defaults = SamplingParams().override(sampling)
        a = api()
        run = Run(model or a.available_models()[0], defaults, on_text=on_text, adapter=adapter)
        # with an adapter the first context opens now: a name the model lacks fails here
        state = ProgramState(run.stream(top=True, ctx=None if adapter is None else run.context()))
        arguments = self._arguments(args, kw)
        try:
            await run.driver.run(lambda: run.execute(self.func, state, (), arguments))
        finally:
            await run.finish()
        return state

    async def arun_batch(
        self,
        batch_kwargs: Sequence[dict[str, Any] | Sequence[Any]],
        num_threads: int | str = "auto",
        adapter: str | None = None,
        **sampling: Any,
    ) -> list[ProgramState]:
        """``arun`` for each argument set, at most ``num_threads`` at once."""
        limit = len(batch_kwargs) if num_threads == "auto" else max(1, int(num_threads))
        gate = asyncio.Semaphore(max(1, limit))

        async def one(b):
            async with gate:
                return await self.arun(**self._batch_args(b), adapter=adapter, **sampling)

        return list(await asyncio.gather(*(one(b) for b in batch_kwargs)))

    @property
    def main(self) -> Callable[[list[str]], Any]:
        """An inferlet entry point for a program's file::

            async def main(args):
                return await my_program.main(args)

        then ``pastry run file.py -- key=value ...`` (or one JSON object of arguments). Values
        are parsed as JSON when they are JSON, else taken as text; sampling parameters
        (``temperature=0``) are accepted too. Returns ``{"text", "variables"}`` as JSON."""
        program = self

        async def main(args: list[str]) -> str:
            state = await program.arun(**parse_args(args))
            variables = plain(state.stream.variables)
            return json.dumps({"text": state.text(), "variables": variables})

        return main

    # ------------------------------------------------------------------ internals

    def _nested(self, run: Run, args: Sequence[Any], kwargs: dict[str, Any]) -> ProgramState:
        _, kw = _split(kwargs)  # a nested call's sampling defaults are its run's
        state = ProgramState(run.stream())
        run.execute(self.func, state, (), self._arguments(args, kw))
        return state

    def _arguments(self, args: Sequence[Any], kwargs: dict[str, Any]) -> dict[str, Any]:
        if len(args) > len(self.arg_names):
            raise TypeError(
                f"{self.__name__} takes {len(self.arg_names)} arguments after s, got {len(args)}"
            )
        given = dict(zip(self.arg_names, args, strict=False))
        dup = sorted(set(given) & set(kwargs))
        if dup:
            raise TypeError(f"{self.__name__} got multiple values for {dup}")
        return {**self.bind_arguments, **given, **kwargs}

    def _batch_args(self, b: dict[str, Any] | Sequence[Any]) -> dict[str, Any]:
        if isinstance(b, dict):
            return dict(b)
        return self._arguments(tuple(b), {})


def function(func: Callable[..., Any] | None = None, num_api_spec_tokens: int | None = None):
    """Decorator: ``@function`` or ``@function(num_api_spec_tokens=...)``."""
    if func is not None:
        return Function(func, num_api_spec_tokens)
    return lambda f: Function(f, num_api_spec_tokens)


def _split(kwargs: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    sampling = {k: v for k, v in kwargs.items() if k in SAMPLING}
    return sampling, {k: v for k, v in kwargs.items() if k not in SAMPLING}


def parse_args(args: list[str]) -> dict[str, Any]:
    """``['{"a": 1}']`` or ``['a=1', 'b=some text']`` -> keyword arguments."""
    if len(args) == 1 and args[0].lstrip().startswith("{"):
        value = json.loads(args[0])
        if not isinstance(value, dict):
            raise ValueError(f"arguments must be one JSON object, got {args[0]!r}")
        return value
    out: dict[str, Any] = {}
    for a in args:
        key, eq, text = a.partition("=")
        if not eq or not key.isidentifier():
            raise ValueError(
                f"arguments are key=value pairs or one JSON object, got {a!r} (e.g. "
                "topic='staying healthy' or '{\"topic\": \"staying healthy\"}')"
            )
        try:
            out[key] = json.loads(text)
        except ValueError:
            out[key] = text
    return out


def plain(value: Any) -> Any:
    """``value`` as JSON-ready data (tuples as lists)."""
    if isinstance(value, dict):
        return {str(k): plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [plain(v) for v in value]
    return value
