"""A restricted Python interpreter for code a model writes (CodeAct), run by walking its
syntax tree: nothing is compiled or executed by Python, and the program reaches nothing
but its own values, a few pure built-ins and the tools it is given.

What runs: numbers, strings, ``None``, lists, tuples, dicts and sets; assignment (to
names, subscripts and tuples), augmented assignment; ``if``, ``for``, ``while``,
``break``, ``continue``, ``pass``; ``def`` (positional and default arguments, recursion)
and ``lambda``; comprehensions and generator expressions; f-strings; arithmetic,
comparison and boolean operators; subscripts and slices; the built-ins of
:data:`BUILTINS` (``print`` writes to the captured output) and the pure methods of
:data:`METHODS` on built-in values; ``import math`` (its functions and constants). The
tools are functions: ``weather(city="Paris")`` awaits the call and returns the tool's text.

What does not: other imports, attribute access other than those methods (no dunder
names), files, classes, ``global``, ``try``, ``with``, ``yield``, ``async``, ``del``.
Such a program is rejected before any of it runs, with :class:`CodeError` naming the
construct and its line. Limits (:class:`Limits`): steps (syntax nodes evaluated: the CPU
bound), wall-clock seconds, the length of any string or collection and the bits of any
integer (the memory bound, checked before a value is built where it could be large),
call depth and captured output. Python's own errors (``NameError``, ``ZeroDivisionError``
...) are reported as ``Type: message (line N)``, as a traceback's last line.

Variables persist from one :meth:`Interpreter.run` to the next (as in a notebook).
"""

from __future__ import annotations

import ast
import asyncio
import operator
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any, NamedTuple

from pastry.sdk.interp_values import (
    BUILTINS,
    METHODS,
    MODULES,
    Builtin,
    Checked,
    CodeError,
    Limits,
    apply_builtin,
    call_method,
    check_size,
)

__all__ = ["BUILTINS", "METHODS", "CodeError", "Interpreter", "Limits", "Outcome"]

_BIN: dict[type, Callable[[Any, Any], Any]] = {
    ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
    ast.Div: operator.truediv, ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod,
    ast.Pow: operator.pow, ast.BitAnd: operator.and_, ast.BitOr: operator.or_,
    ast.BitXor: operator.xor, ast.LShift: operator.lshift, ast.RShift: operator.rshift,
}  # fmt: skip
_UN = {ast.UAdd: operator.pos, ast.USub: operator.neg, ast.Not: operator.not_,
       ast.Invert: operator.invert}  # fmt: skip
_CMP: dict[type, Callable[[Any, Any], bool]] = {
    ast.Eq: operator.eq, ast.NotEq: operator.ne, ast.Lt: operator.lt, ast.LtE: operator.le,
    ast.Gt: operator.gt, ast.GtE: operator.ge, ast.In: lambda a, b: a in b,
    ast.NotIn: lambda a, b: a not in b, ast.Is: operator.is_, ast.IsNot: operator.is_not,
}  # fmt: skip
_REFUSED = {
    ast.ClassDef: "class", ast.Global: "global", ast.Nonlocal: "nonlocal", ast.Try: "try",
    ast.With: "with", ast.Yield: "yield", ast.YieldFrom: "yield", ast.AsyncFunctionDef:
    "async def", ast.Await: "await", ast.Delete: "del", ast.Raise: "raise",
    ast.NamedExpr: ":=", ast.Starred: "*", ast.Match: "match", ast.AsyncFor: "async for",
    ast.AsyncWith: "async with",
}  # fmt: skip
_ERRORS = (ArithmeticError, LookupError, NameError, TypeError, ValueError, AttributeError)


class Outcome(NamedTuple):
    output: str  # what the program printed (and the last expression's value, if any)
    error: str | None  # the error that stopped it, as a traceback's last line


class _Break(Exception):
    pass


class _Continue(Exception):
    pass


class _Return(Exception):
    def __init__(self, value: Any) -> None:
        self.value = value


@dataclass
class Function:
    """A ``def`` or ``lambda`` of the program."""

    name: str
    args: ast.arguments
    body: list[ast.stmt] | ast.expr
    defaults: list[Any]
    scopes: list[dict[str, Any]]  # the scopes it closes over

    def __repr__(self) -> str:
        return f"<function {self.name}>"


class Interpreter:
    """Runs programs (see the module docstring); ``tools`` are async functions the
    program may call by name (with positional or keyword arguments)."""

    def __init__(
        self,
        tools: Mapping[str, Callable[..., Awaitable[Any]]] | None = None,
        limits: Limits | None = None,
    ) -> None:
        self.tools = dict(tools or {})
        self.limits = limits or Limits()
        self.globals: dict[str, Any] = {}

    async def run(self, source: str) -> Outcome:
        """Check ``source``, then run it; what it printed and the error that stopped it."""
        self._out: list[str] = []
        self._size, self._steps, self._depth = 0, 0, 0
        self._deadline = time.monotonic() + self.limits.seconds
        try:
            tree = self.check(source)
            for i, stmt in enumerate(tree.body):
                last = i == len(tree.body) - 1
                if last and isinstance(stmt, ast.Expr) and not _is_print(stmt.value):
                    try:
                        value = await self.eval(stmt.value, [self.globals])
                    except _ERRORS as e:
                        raise CodeError(f"{type(e).__name__}: {e} (line {stmt.lineno})") from None
                    if value is not None:
                        self._print([repr(value)])
                else:
                    await self.exec_block([stmt], [self.globals])
        except CodeError as e:
            return Outcome("".join(self._out), str(e))
        except (_Break, _Continue, _Return):
            return Outcome(
                "".join(self._out),
                "SyntaxError: break, continue or return outside a loop or function",
            )
        return Outcome("".join(self._out), None)

    def check(self, source: str) -> ast.Module:
        if len(source) > self.limits.max_source:
            raise CodeError(
                f"program of {len(source)} characters (at most {self.limits.max_source})"
            )
        try:
            tree = ast.parse(source)
        except SyntaxError as e:
            raise CodeError(f"SyntaxError: {e.msg} (line {e.lineno})") from None
        for node in ast.walk(tree):
            why = _REFUSED.get(type(node))
            if why is None and isinstance(node, ast.Import | ast.ImportFrom):
                names = [a.name for a in node.names]
                if isinstance(node, ast.ImportFrom) or any(n not in MODULES for n in names):
                    why = f"import of {', '.join(names)} (only {', '.join(MODULES)})"
            if why is None and isinstance(node, ast.Attribute) and node.attr.startswith("_"):
                why = f"attribute {node.attr!r}"
            if why is None and isinstance(node, ast.Name) and node.id.startswith("__"):
                why = f"name {node.id!r}"
            if why is not None:
                raise CodeError(f"{why} is not allowed (line {getattr(node, 'lineno', 1)})")
        return tree

    # ------------------------------------------------------------------ statements

    async def exec_block(self, body: list[ast.stmt], scopes: list[dict]) -> None:
        for stmt in body:
            await self._tick(stmt)
            try:
                await self._statement(stmt, scopes)
            except _ERRORS as e:
                raise CodeError(f"{type(e).__name__}: {e} (line {stmt.lineno})") from None

    async def _statement(self, s: ast.stmt, scopes: list[dict]) -> None:
        if isinstance(s, ast.Expr):
            await self.eval(s.value, scopes)
        elif isinstance(s, ast.Assign):
            value = await self.eval(s.value, scopes)
            for target in s.targets:
                await self.assign(target, value, scopes)
        elif isinstance(s, ast.AnnAssign) and s.value is not None:
            await self.assign(s.target, await self.eval(s.value, scopes), scopes)
        elif isinstance(s, ast.AugAssign):
            load = _as_load(s.target)
            value = self._binop(
                s.op, await self.eval(load, scopes), await self.eval(s.value, scopes)
            )
            await self.assign(s.target, value, scopes)
        elif isinstance(s, ast.If):
            branch = s.body if await self.eval(s.test, scopes) else s.orelse
            await self.exec_block(branch, scopes)
        elif isinstance(s, ast.For | ast.While):
            await self._loop(s, scopes)
        elif isinstance(s, ast.FunctionDef):
            defaults = [await self.eval(d, scopes) for d in s.args.defaults]
            scopes[-1][s.name] = Function(s.name, s.args, s.body, defaults, scopes)
        elif isinstance(s, ast.Return):
            raise _Return(None if s.value is None else await self.eval(s.value, scopes))
        elif isinstance(s, ast.Import):
            for alias in s.names:
                scopes[-1][alias.asname or alias.name] = MODULES[alias.name]
        elif isinstance(s, ast.Break | ast.Continue):
            raise _Break() if isinstance(s, ast.Break) else _Continue()
        elif isinstance(s, ast.Assert):
            if not await self.eval(s.test, scopes):
                msg = "" if s.msg is None else str(await self.eval(s.msg, scopes))
                raise CodeError(f"AssertionError: {msg} (line {s.lineno})")
        elif not isinstance(s, ast.Pass | ast.AnnAssign):
            raise CodeError(f"{type(s).__name__} is not allowed (line {s.lineno})")

    async def _loop(self, s: ast.For | ast.While, scopes: list[dict]) -> None:
        broke = False
        if isinstance(s, ast.For):
            items = await self.eval(s.iter, scopes)
            check_size(items, self.limits)
            iterator = iter(items)
        while True:
            if isinstance(s, ast.For):
                item = next(iterator, _END)
                if item is _END:
                    break
                await self.assign(s.target, item, scopes)
            elif not await self.eval(s.test, scopes):
                break
            try:
                await self.exec_block(s.body, scopes)
            except _Break:
                broke = True
                break
            except _Continue:
                pass
        if not broke:
            await self.exec_block(s.orelse, scopes)

    async def assign(self, target: ast.expr, value: Any, scopes: list[dict]) -> None:
        if isinstance(target, ast.Name):
            scopes[-1][target.id] = value
        elif isinstance(target, ast.Tuple | ast.List):
            values = list(value)
            if len(values) != len(target.elts):
                raise ValueError(f"cannot unpack {len(values)} values into {len(target.elts)}")
            for t, v in zip(target.elts, values, strict=True):
                await self.assign(t, v, scopes)
        elif isinstance(target, ast.Subscript):
            obj = await self.eval(target.value, scopes)
            obj[await self.eval(target.slice, scopes)] = value
            check_size(obj, self.limits)
        else:
            raise CodeError(
                f"assignment to {type(target).__name__} is not allowed (line {target.lineno})"
            )

    # ------------------------------------------------------------------ expressions

    async def eval(self, n: ast.expr, scopes: list[dict]) -> Any:
        await self._tick(n)
        t = type(n)
        if t is ast.Constant:
            return n.value
        if t is ast.Name:
            return self._lookup(n.id, scopes)
        if t is ast.BinOp:
            return self._binop(
                n.op, await self.eval(n.left, scopes), await self.eval(n.right, scopes)
            )
        if t is ast.UnaryOp:
            return _UN[type(n.op)](await self.eval(n.operand, scopes))
        if t is ast.BoolOp:
            value = await self.eval(n.values[0], scopes)
            for operand in n.values[1:]:
                if bool(value) == isinstance(n.op, ast.Or):
                    break
                value = await self.eval(operand, scopes)
            return value
        if t is ast.Compare:
            left = await self.eval(n.left, scopes)
            for op, operand in zip(n.ops, n.comparators, strict=True):
                right = await self.eval(operand, scopes)
                if not _CMP[type(op)](left, right):
                    return False
                left = right
            return True
        if t is ast.IfExp:
            return await self.eval(n.body if await self.eval(n.test, scopes) else n.orelse, scopes)
        if t is ast.Call:
            return await self._call(n, scopes)
        return await self._compound(n, scopes)

    async def _compound(self, n: ast.expr, scopes: list[dict]) -> Any:
        t = type(n)
        if t in (ast.List, ast.Tuple, ast.Set):
            items = [await self.eval(e, scopes) for e in n.elts]
            return {ast.List: list, ast.Tuple: tuple, ast.Set: set}[t](items)
        if t is ast.Dict:
            return {
                await self.eval(k, scopes): await self.eval(v, scopes)
                for k, v in zip(n.keys, n.values, strict=True)
            }
        if t is ast.Subscript:
            return (await self.eval(n.value, scopes))[await self.eval(n.slice, scopes)]
        if t is ast.Slice:
            parts = [
                None if p is None else await self.eval(p, scopes)
                for p in (n.lower, n.upper, n.step)
            ]
            return slice(*parts)
        if t is ast.JoinedStr:
            return await self._fstring(n, scopes)
        if t in (ast.ListComp, ast.GeneratorExp, ast.SetComp, ast.DictComp):
            return await self._comprehension(n, scopes)
        if t is ast.Lambda:
            defaults = [await self.eval(d, scopes) for d in n.args.defaults]
            return Function("<lambda>", n.args, n.body, defaults, scopes)
        if t is ast.Attribute:
            obj = await self.eval(n.value, scopes)
            if isinstance(obj, Checked):
                return obj.get(n.attr)
            raise CodeError(
                f"attribute {n.attr!r} can only be called as a method (line {n.lineno})"
            )
        raise CodeError(f"{t.__name__} is not allowed (line {n.lineno})")

    async def _fstring(self, n: ast.JoinedStr, scopes: list[dict]) -> str:
        parts = []
        for v in n.values:
            if isinstance(v, ast.Constant):
                parts.append(v.value)
                continue
            value = await self.eval(v.value, scopes)
            value = {115: str, 114: repr, 97: ascii}.get(v.conversion, lambda x: x)(value)
            spec = "" if v.format_spec is None else await self._fstring(v.format_spec, scopes)
            if (
                any(c.isdigit() for c in spec)
                and max(map(int, _numbers(spec))) > self.limits.max_len
            ):
                raise CodeError(f"format width in {spec!r} is too large (line {n.lineno})")
            parts.append(format(value, spec))
        return check_size("".join(parts), self.limits)

    async def _comprehension(self, n: ast.expr, scopes: list[dict]) -> Any:
        out: list[Any] = []
        await self._generate(n, n.generators, [*scopes, {}], out)
        if isinstance(n, ast.DictComp):
            return dict(out)
        return set(out) if isinstance(n, ast.SetComp) else out

    async def _generate(self, n: ast.expr, gens: list, scopes: list[dict], out: list) -> None:
        if not gens:
            if isinstance(n, ast.DictComp):
                out.append((await self.eval(n.key, scopes), await self.eval(n.value, scopes)))
            else:
                out.append(await self.eval(n.elt, scopes))
            check_size(out, self.limits)
            return
        g = gens[0]
        items = await self.eval(g.iter, scopes)
        check_size(items, self.limits)
        for item in items:
            await self.assign(g.target, item, scopes)
            if all([await self.eval(c, scopes) for c in g.ifs]):
                await self._generate(n, gens[1:], scopes, out)

    async def _call(self, n: ast.Call, scopes: list[dict]) -> Any:
        args = [await self.eval(a, scopes) for a in n.args]
        kwargs = {k.arg: await self.eval(k.value, scopes) for k in n.keywords if k.arg}
        if isinstance(n.func, ast.Attribute):
            obj = await self.eval(n.func.value, scopes)
            return check_size(await call_method(self, obj, n.func.attr, args, kwargs), self.limits)
        f = await self.eval(n.func, scopes)
        return await self.call(f, args, kwargs)

    async def call(self, f: Any, args: list, kwargs: dict) -> Any:
        """Call a value of the program: its function, a tool or a built-in."""
        if isinstance(f, Function):
            return await self._call_function(f, args, kwargs)
        if isinstance(f, _Tool):
            return await f.run(*args, **kwargs)
        if isinstance(f, Builtin):
            if f.name == "print":
                return self._print([str(a) for a in args], **kwargs)
            return check_size(await apply_builtin(self, f.name, args, kwargs), self.limits)
        raise TypeError(f"{type(f).__name__!r} object is not callable")

    async def _call_function(self, f: Function, args: list, kwargs: dict) -> Any:
        names = [a.arg for a in f.args.args]
        if len(args) > len(names):
            raise TypeError(f"{f.name}() takes {len(names)} arguments but {len(args)} were given")
        local = dict(zip(names[len(names) - len(f.defaults) :], f.defaults, strict=True))
        local.update(zip(names, args, strict=False))
        for k, v in kwargs.items():
            if k not in names:
                raise TypeError(f"{f.name}() got an unexpected keyword argument {k!r}")
            local[k] = v
        missing = [a for a in names if a not in local]
        if missing:
            raise TypeError(f"{f.name}() missing arguments: {', '.join(missing)}")
        if self._depth >= self.limits.max_depth:
            raise CodeError(f"calls nested deeper than {self.limits.max_depth} (in {f.name})")
        self._depth += 1
        try:
            if isinstance(f.body, ast.expr):
                return await self.eval(f.body, [*f.scopes, local])
            await self.exec_block(f.body, [*f.scopes, local])
        except _Return as r:
            return r.value
        finally:
            self._depth -= 1
        return None

    # ------------------------------------------------------------------ helpers

    def _lookup(self, name: str, scopes: list[dict]) -> Any:
        for scope in reversed(scopes):
            if name in scope:
                return scope[name]
        if name in self.tools:
            return _Tool(name, self.tools[name])
        if name in BUILTINS:
            return Builtin(name)
        raise NameError(f"name {name!r} is not defined")

    def _binop(self, op: ast.operator, a: Any, b: Any) -> Any:
        lim = self.limits
        ints = isinstance(a, int) and isinstance(b, int)
        if (
            isinstance(op, ast.Pow)
            and ints
            and b > 0
            and abs(a).bit_length() * b > lim.max_int_bits
        ):
            raise CodeError(f"{a} ** {b} is too large (at most {lim.max_int_bits} bits)")
        if isinstance(op, ast.LShift) and isinstance(b, int) and b > lim.max_int_bits:
            raise CodeError(f"<< {b} is too large (at most {lim.max_int_bits} bits)")
        if isinstance(op, ast.Mult):
            seq, k = (a, b) if isinstance(b, int) else (b, a)
            if (
                isinstance(seq, str | list | tuple)
                and isinstance(k, int)
                and len(seq) * k > lim.max_len
            ):
                raise CodeError(f"a sequence of {len(seq) * k} items (at most {lim.max_len})")
        return check_size(_BIN[type(op)](a, b), lim)

    def _print(self, parts: list[str], sep: str = " ", end: str = "\n", **_: Any) -> None:
        text = str(sep).join(parts) + str(end)
        self._size += len(text)
        if self._size > self.limits.max_output:
            raise CodeError(f"printed more than {self.limits.max_output} characters")
        self._out.append(text)

    async def _tick(self, node: ast.AST) -> None:
        self._steps += 1
        if self._steps > self.limits.steps:
            raise CodeError(
                f"ran more than {self.limits.steps} steps (line {getattr(node, 'lineno', '?')})"
            )
        if self._steps % 2000 == 0:
            if time.monotonic() > self._deadline:
                raise CodeError(f"ran longer than {self.limits.seconds} s")
            await asyncio.sleep(0)  # let the other inferlets of the loop run


@dataclass(frozen=True)
class _Tool:
    name: str
    fn: Callable[..., Awaitable[Any]]

    async def run(self, *args: Any, **kwargs: Any) -> Any:
        return await self.fn(*args, **kwargs)


_END = object()


def _is_print(e: ast.expr) -> bool:
    return isinstance(e, ast.Call) and isinstance(e.func, ast.Name) and e.func.id == "print"


def _as_load(target: ast.expr) -> ast.expr:
    node = ast.parse(ast.unparse(target), mode="eval").body
    return ast.copy_location(node, target)


def _numbers(spec: str) -> list[str]:
    out, cur = [], ""
    for c in spec + " ":
        if c.isdigit():
            cur += c
        elif cur:
            out.append(cur)
            cur = ""
    return out
