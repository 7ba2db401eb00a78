"""A program as the source of one inferlet, for running it on a server from a client.

:func:`program_source` writes a module holding the program's function, every function
and ``@function`` it calls (found through the globals their code reads, transitively),
the modules they import, and the constants they read (written as literals), followed by
an entry point that runs the program with the arguments of a launch
(:mod:`pastry.lang.inferlet`). A global that is none of these (an open file, a client
object...) cannot travel: the error names it; pass it as an argument instead, or define
it inside the function. The same program gives the same source, so the server compiles
it once and every later run is a launch.
"""

from __future__ import annotations

import ast
import builtins
import inspect
import textwrap
import types
from typing import Any

from pastry.lang import library
from pastry.lang.function import Function

LIBRARY_MODULES = ("pastry.lang", "sglang")  # imported in the shipped module as pastry.lang


class ShipError(ValueError):
    """The program reads something that cannot be sent to the server."""


def _is_literal(value: Any) -> bool:
    if value is None or isinstance(value, bool | int | float | str | bytes):
        return True
    if isinstance(value, list | tuple | set | frozenset):
        return all(_is_literal(v) for v in value)
    if isinstance(value, dict):
        return all(_is_literal(k) and _is_literal(v) for k, v in value.items())
    return False


def _code_names(code: types.CodeType) -> set[str]:
    out = set(code.co_names)
    for c in code.co_consts:
        if isinstance(c, types.CodeType):
            out |= _code_names(c)
    return out


class _Collector:
    def __init__(self, root: Function) -> None:
        self.root = root
        self.lang = {id(v): k for k, v in library.NAMES.items()}
        self.imports: dict[str, str] = {}  # name -> import statement
        self.constants: dict[str, str] = {}  # name -> assignment
        self.defs: dict[str, str] = {}  # name -> source (functions and classes)
        self.seen: set[int] = set()

    def add_function(self, func: types.FunctionType, program: str | None) -> None:
        if id(func) in self.seen:
            return
        self.seen.add(id(func))
        try:
            source = textwrap.dedent(inspect.getsource(func))
        except (OSError, TypeError) as e:
            raise ShipError(
                f"cannot read the source of {func.__qualname__} ({e}): define programs and "
                "the functions they call in a .py file"
            ) from None
        tree = ast.parse(source)
        node = tree.body[0]
        if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            raise ShipError(f"{func.__qualname__} is not a plain function definition")
        node.decorator_list = []
        node.name = func.__name__
        text = ast.unparse(node)
        if program is not None:
            text += f"\n\n\n{program} = _pastry_lang_function({func.__name__})"
        self.defs[program or func.__name__] = text
        names = _code_names(func.__code__)
        for d in [*node.args.defaults, *(d for d in node.args.kw_defaults if d is not None)]:
            names |= {n.id for n in ast.walk(d) if isinstance(n, ast.Name)}
        closure = dict(zip(func.__code__.co_freevars, func.__closure__ or (), strict=False))
        for name in sorted(names):
            if name in func.__globals__:
                self.add_global(name, func.__globals__[name], func)
        for name, cell in closure.items():
            self.add_global(name, cell.cell_contents, func)

    def add_global(self, name: str, value: Any, user: types.FunctionType) -> None:
        if name in self.imports or name in self.constants or name in self.defs:
            return
        if isinstance(value, Function):
            self.add_function(value.func, name)
        elif isinstance(value, types.ModuleType):
            mod = value.__name__
            if mod.split(".")[0] in ("sglang",) or mod.startswith("pastry.lang"):
                mod = "pastry.lang"
            self.imports[name] = f"import {mod} as {name}" if mod != name else f"import {mod}"
        elif id(value) in self.lang:
            self.imports[name] = f"from pastry.lang import {self.lang[id(value)]} as {name}"
        elif isinstance(value, types.FunctionType) and value.__module__ == user.__module__:
            self.add_function(value, None)
        elif isinstance(value, type | types.FunctionType | types.BuiltinFunctionType) and getattr(
            value, "__module__", None
        ) not in (None, user.__module__):
            self.imports[name] = f"from {value.__module__} import {value.__qualname__} as {name}"
        elif isinstance(value, type) and value.__module__ == user.__module__:
            self.defs[name] = textwrap.dedent(inspect.getsource(value))
        elif _is_literal(value):
            self.constants[name] = f"{name} = {value!r}"
        elif hasattr(builtins, name):
            return
        else:
            raise ShipError(
                f"{user.__qualname__} reads the global {name!r} ({type(value).__name__}), "
                "which cannot be sent to the server with the program: pass it as an "
                "argument, or define it inside the function"
            )


def program_source(function: Function) -> str:
    """The source of an inferlet that runs ``function`` (see the module docstring)."""
    c = _Collector(function)
    c.add_function(function.func, function.__name__)
    parts = [
        f'"""pastry.lang program {function.__name__!r}, shipped from a client."""',
        "from __future__ import annotations",
        "\n".join(sorted(c.imports.values())),
        "from pastry.lang import function as _pastry_lang_function",
        "from pastry.lang.inferlet import serve as _pastry_lang_serve",
        "\n".join(c.constants[k] for k in sorted(c.constants)),
        *(c.defs[k] for k in sorted(c.defs)),
        "async def main(args):\n    return await _pastry_lang_serve(globals(), args)",
    ]
    return "\n\n\n".join(p for p in parts if p) + "\n"
