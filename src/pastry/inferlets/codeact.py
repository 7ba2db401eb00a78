"""CodeAct (Wang et al. 2024): an agent whose actions are programs, run inside the inferlet
by a restricted interpreter, their output fed back into the context (Pie §7.1).

The tiny random models write gibberish, so the program of each step is derived from the
tokens the agent generates (:func:`derive_program`: a one-line arithmetic assignment whose
numbers and operators come from the token ids and which uses the previous step's result),
unless the args give the programs. Each step the agent generates ``code_tokens`` tokens
greedily, runs the program in a :class:`Sandbox` (variables persist across steps) and
appends the program and its output (or its error) to the same context, whose KV cache is
kept: only the new tokens are forwarded. After ``steps`` steps it generates
``answer_tokens`` tokens. The transcript::

    prompt "\\nCode:" tokens_0 "\\n```\\n<program 0>\\n```\\nOutput: <value or error>\\n"
    "\\nCode:" tokens_1 ... "\\nAnswer:" answer

The sandbox evaluates a small subset of Python by walking its syntax tree (nothing is
compiled or executed by Python): integer, float and boolean literals; names (not starting
with ``_``); assignments and augmented assignments to names; arithmetic, comparison,
boolean and conditional expressions; calls of ``abs``, ``min``, ``max``, ``round``,
``int``, ``float`` and ``bool`` with positional arguments. Everything else — imports,
attribute access, subscripts, strings, other calls (``open``, ``exec``, ``__import__``),
functions, loops — is rejected before any statement runs, with :class:`SandboxError`
naming the construct and its line. Sizes are bounded (source length, syntax nodes, integer
bits, exponents), so every program ends quickly.

Args (one JSON object; ``prompt`` is text or a list of token ids)::

    {"prompt": ..., "steps": 3, "code_tokens": 6, "answer_tokens": 8, "model": null,
     "programs": null (a list: the program of step k instead of the derived one)}

Result (JSON)::

    {"steps": [{"tokens": [generated ids], "program": "...", "output": "...", "ok": bool}],
     "answer": [ids], "variables": {name: value}, "tokens": context length}
"""

from __future__ import annotations

import ast
import json
import math
import operator
from collections.abc import Callable, Sequence

from pastry.sdk import Context, MaxTokens, Sampler
from pastry.sdk.args import options

CODE = "\nCode:"
RESULT = "\n```\n{}\n```\nOutput: {}\n"
ANSWER = "\nAnswer:"

DEFAULTS = {
    "prompt": None,
    "steps": 3,
    "code_tokens": 6,
    "answer_tokens": 8,
    "model": None,
    "programs": None,
}


class SandboxError(ValueError):
    """A program was rejected (a construct that is not allowed, a limit) or failed (an
    undefined name, division by zero); the message says which, with the line."""


Number = int | float | bool

_BINARY: dict[type, Callable[[Number, Number], Number]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_UNARY: dict[type, Callable[[Number], Number]] = {
    ast.UAdd: operator.pos,
    ast.USub: operator.neg,
    ast.Not: operator.not_,
}
_COMPARE: dict[type, Callable[[Number, Number], bool]] = {
    ast.Eq: operator.eq,
    ast.NotEq: operator.ne,
    ast.Lt: operator.lt,
    ast.LtE: operator.le,
    ast.Gt: operator.gt,
    ast.GtE: operator.ge,
}
FUNCTIONS: dict[str, Callable[..., Number]] = {
    "abs": abs,
    "min": min,
    "max": max,
    "round": round,
    "int": int,
    "float": float,
    "bool": bool,
}
# The syntax nodes a program may contain (operators are checked by the tables above).
_ALLOWED = (
    ast.Module,
    ast.Assign,
    ast.AugAssign,
    ast.Expr,
    ast.Constant,
    ast.Name,
    ast.Load,
    ast.Store,
    ast.BinOp,
    ast.UnaryOp,
    ast.BoolOp,
    ast.And,
    ast.Or,
    ast.Compare,
    ast.IfExp,
    ast.Call,
    *_BINARY,
    *_UNARY,
    *_COMPARE,
)


class Sandbox:
    """Runs restricted arithmetic programs (see the module docstring); ``variables`` keep
    their values from one program to the next."""

    MAX_SOURCE = 2000  # characters
    MAX_NODES = 300  # syntax nodes per program
    MAX_INT_BITS = 4096  # magnitude of any integer value
    MAX_EXPONENT = 10_000

    def __init__(self) -> None:
        self.variables: dict[str, Number] = {}

    def run(self, source: str) -> Number | None:
        """Check the whole program, then run it; the value of its last statement (an
        expression or an assignment), ``None`` for an empty program."""
        tree = self.check(source)
        env = dict(self.variables)  # committed only if every statement succeeds
        value = None
        for stmt in tree.body:
            value = self._statement(stmt, env)
        self.variables = env
        return value

    def check(self, source: str) -> ast.Module:
        """Parse and validate ``source`` without running it."""
        if not isinstance(source, str):
            raise SandboxError(f"a program is a string, got {type(source).__name__}")
        if len(source) > self.MAX_SOURCE:
            raise SandboxError(f"program of {len(source)} characters (at most {self.MAX_SOURCE})")
        try:
            tree = ast.parse(source, mode="exec")
        except SyntaxError as e:
            raise SandboxError(f"syntax error at line {e.lineno}: {e.msg}") from None
        nodes = list(ast.walk(tree))
        if len(nodes) > self.MAX_NODES:
            raise SandboxError(f"program of {len(nodes)} syntax nodes (at most {self.MAX_NODES})")
        for node in nodes:
            self._check_node(node)
        return tree

    # ------------------------------------------------------------------ checking

    def _check_node(self, node: ast.AST) -> None:
        line = getattr(node, "lineno", 1)
        if not isinstance(node, _ALLOWED):
            raise SandboxError(f"{_describe(node)} is not allowed (line {line}); {_ALLOWED_TEXT}")
        if isinstance(node, ast.Name) and node.id.startswith("_"):
            raise SandboxError(
                f"name {node.id!r} is not allowed (line {line}): names start with a letter"
            )
        if isinstance(node, ast.Constant) and type(node.value) not in (int, float, bool):
            raise SandboxError(
                f"{type(node.value).__name__} constant {node.value!r} is not allowed (line {line}): "
                "only numbers and booleans"
            )
        if isinstance(node, ast.Assign) and (
            len(node.targets) != 1 or not isinstance(node.targets[0], ast.Name)
        ):
            raise SandboxError(f"only assignments to one name are allowed (line {line})")
        if isinstance(node, ast.AugAssign) and not isinstance(node.target, ast.Name):
            raise SandboxError(f"only assignments to one name are allowed (line {line})")
        if isinstance(node, ast.Call) and (
            not isinstance(node.func, ast.Name)
            or node.func.id not in FUNCTIONS
            or node.keywords
            or any(isinstance(a, ast.Starred) for a in node.args)
        ):
            name = node.func.id if isinstance(node.func, ast.Name) else _describe(node.func)
            raise SandboxError(
                f"call of {name} is not allowed (line {line}): only "
                f"{', '.join(FUNCTIONS)} with positional arguments"
            )

    # ------------------------------------------------------------------ running

    def _statement(self, stmt: ast.stmt, env: dict[str, Number]) -> Number:
        if isinstance(stmt, ast.Assign):
            value = self._eval(stmt.value, env)
            env[stmt.targets[0].id] = value
            return value
        if isinstance(stmt, ast.AugAssign):
            name = stmt.target.id
            current = self._name(name, env, stmt.lineno)
            value = self._binary(stmt.op, current, self._eval(stmt.value, env), stmt.lineno)
            env[name] = value
            return value
        assert isinstance(stmt, ast.Expr), stmt  # nothing else passes the check
        return self._eval(stmt.value, env)

    def _eval(self, node: ast.expr, env: dict[str, Number]) -> Number:
        if isinstance(node, ast.Constant):
            return node.value
        if isinstance(node, ast.Name):
            if node.id in FUNCTIONS:
                raise SandboxError(f"{node.id} can only be called (line {node.lineno})")
            return self._name(node.id, env, node.lineno)
        if isinstance(node, ast.BinOp):
            left, right = self._eval(node.left, env), self._eval(node.right, env)
            return self._binary(node.op, left, right, node.lineno)
        if isinstance(node, ast.UnaryOp):
            return self._limit(_UNARY[type(node.op)](self._eval(node.operand, env)), node.lineno)
        if isinstance(node, ast.BoolOp):
            value = self._eval(node.values[0], env)
            for operand in node.values[1:]:
                if bool(value) == isinstance(node.op, ast.Or):
                    break
                value = self._eval(operand, env)
            return value
        if isinstance(node, ast.Compare):
            left = self._eval(node.left, env)
            for op, operand in zip(node.ops, node.comparators, strict=True):
                right = self._eval(operand, env)
                if not _COMPARE[type(op)](left, right):
                    return False
                left = right
            return True
        if isinstance(node, ast.IfExp):
            branch = node.body if self._eval(node.test, env) else node.orelse
            return self._eval(branch, env)
        if isinstance(node, ast.Call):
            args = [self._eval(a, env) for a in node.args]
            return self._limit(self._call(node.func.id, args, node.lineno), node.lineno)
        raise AssertionError(f"unchecked node {node!r}")  # the check rejects everything else

    def _name(self, name: str, env: dict[str, Number], line: int) -> Number:
        if name not in env:
            raise SandboxError(f"name {name!r} is not defined (line {line})")
        return env[name]

    def _binary(self, op: ast.operator, left: Number, right: Number, line: int) -> Number:
        if (
            isinstance(op, ast.Pow)
            and isinstance(right, int | float)
            and abs(right) > self.MAX_EXPONENT
        ):
            raise SandboxError(
                f"exponent {right} is too large (line {line}; at most {self.MAX_EXPONENT})"
            )
        if (
            isinstance(op, ast.Pow)
            and isinstance(left, int)
            and isinstance(right, int)
            and right > 0
            and abs(left).bit_length() * right > self.MAX_INT_BITS
        ):
            raise SandboxError(
                f"{left} ** {right} is too large (line {line}; at most {self.MAX_INT_BITS} bits)"
            )
        try:
            value = _BINARY[type(op)](left, right)
        except (ArithmeticError, ValueError, TypeError) as e:
            raise SandboxError(f"{type(e).__name__}: {e} (line {line})") from None
        return self._limit(value, line)

    def _call(self, name: str, args: list[Number], line: int) -> Number:
        try:
            return FUNCTIONS[name](*args)
        except (ArithmeticError, ValueError, TypeError) as e:
            raise SandboxError(f"{name}: {type(e).__name__}: {e} (line {line})") from None

    def _limit(self, value: Number, line: int) -> Number:
        if isinstance(value, int) and value.bit_length() > self.MAX_INT_BITS:
            raise SandboxError(
                f"integer of {value.bit_length()} bits (line {line}; at most {self.MAX_INT_BITS})"
            )
        if isinstance(value, float) and not math.isfinite(value):
            raise SandboxError(f"non-finite result {value} (line {line})")
        if not isinstance(value, int | float):  # bool is an int
            raise SandboxError(
                f"{type(value).__name__} result {value!r} (line {line}): only numbers"
            )
        return value


_ALLOWED_TEXT = (
    "programs are assignments to names and expressions over numbers, names, arithmetic, "
    "comparisons, and/or/not, if-else and calls of " + ", ".join(FUNCTIONS)
)


def _describe(node: ast.AST) -> str:
    names = {
        ast.Import: "import",
        ast.ImportFrom: "import",
        ast.Attribute: "attribute access",
        ast.Subscript: "subscript",
        ast.Lambda: "lambda",
        ast.FunctionDef: "def",
        ast.For: "for",
        ast.While: "while",
    }
    return names.get(type(node), type(node).__name__)


OPERATORS = ("+", "-", "*", "//", "%")


def derive_program(step: int, tokens: Sequence[int], previous: str | None = None) -> str:
    """The program of step ``step`` made from generated token ids (at least one):
    ``x<step> = (a op b) op c`` with ``a``, ``b`` in 1..97, the operators from
    :data:`OPERATORS`, and ``c`` the variable ``previous`` (the latest result) or, without
    one, a number in 0..9."""
    t = [tokens[i % len(tokens)] for i in range(5)]
    a, b = t[0] % 97 + 1, t[1] % 97 + 1
    op1, op2 = OPERATORS[t[2] % len(OPERATORS)], OPERATORS[t[3] % len(OPERATORS)]
    c = previous or str(t[4] % 10)
    return f"x{step} = ({a} {op1} {b}) {op2} {c}"


async def main(args: list[str]) -> str:
    opts = _options(args)
    ctx = Context(opts["model"])
    prompt = opts["prompt"]
    if isinstance(prompt, str):
        ctx.fill(prompt)
    else:
        ctx.fill_tokens(prompt)
    sandbox, steps, previous = Sandbox(), [], None
    for k in range(opts["steps"]):
        ctx.fill(CODE)
        start = len(ctx.tokens)
        await ctx.generate(Sampler(), MaxTokens(opts["code_tokens"]))
        tokens = ctx.tokens[start:]
        given = opts["programs"]
        program = given[k] if given else derive_program(k, tokens, previous)
        try:
            output, ok = repr(sandbox.run(program)), True
        except SandboxError as e:
            output, ok = f"Error: {e}", False
        if ok and f"x{k}" in sandbox.variables:
            previous = f"x{k}"
        ctx.fill(RESULT.format(program, output))
        steps.append({"tokens": tokens, "program": program, "output": output, "ok": ok})
    ctx.fill(ANSWER)
    start = len(ctx.tokens)
    await ctx.generate(Sampler(), MaxTokens(opts["answer_tokens"]))
    answer = ctx.tokens[start:]
    await ctx.release()
    return json.dumps(
        {
            "steps": steps,
            "answer": answer,
            "variables": sandbox.variables,
            "tokens": len(ctx.tokens),
        }
    )


def _options(args: list[str]) -> dict:
    opts = options(args, DEFAULTS, prompt_keys=())
    prompt = opts["prompt"]
    if not (
        (isinstance(prompt, str) and prompt)
        or (isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt))
    ):
        raise ValueError(f'"prompt" must be non-empty text or a list of token ids, got {prompt!r}')
    for key in ("steps", "answer_tokens"):
        if not isinstance(opts[key], int) or opts[key] < 0:
            raise ValueError(f'"{key}" must be a non-negative integer, got {opts[key]!r}')
    if not isinstance(opts["code_tokens"], int) or opts["code_tokens"] < 1:
        raise ValueError(f'"code_tokens" must be a positive integer, got {opts["code_tokens"]!r}')
    programs = opts["programs"]
    if programs is not None and (
        not isinstance(programs, list)
        or len(programs) < opts["steps"]
        or not all(isinstance(p, str) for p in programs)
    ):
        raise ValueError(f'"programs" must be a list of at least "steps" strings, got {programs!r}')
    return opts
