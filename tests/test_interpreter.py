"""The restricted interpreter CodeAct runs a model's code in (``pastry.sdk.interpreter``):
it prints what Python prints for the Python a model writes; it refuses everything that
could reach outside the program before any of it runs; its limits stop runaway programs;
errors read like a traceback's last line; tools are functions of the program."""

from __future__ import annotations

import ast
import asyncio
import contextlib
import io

import pytest

from pastry.sdk.interpreter import Interpreter, Limits

# Programs of the kinds SmolLM2 writes for CodeAct (functions, loops, f-strings, slices).
PROGRAMS = [
    "def sum_squares(n):\n    return sum(i**2 for i in range(1, n + 1))\n\nprint(sum_squares(20))",
    'def count_vowels(word):\n    vowels = "aeiou"\n    count = 0\n    for char in word:\n'
    "        if char in vowels:\n            count += 1\n    return count\n\n"
    'word = "encyclopedia"\nprint(f"The word \'{word}\' has {count_vowels(word)} vowels.")',
    'def rev(s):\n    return s[::-1]\nprint(rev("pastry"), "pastry"[1:4], "a,b".split(","))',
    "def fib(n):\n    if n <= 1:\n        return n\n    return fib(n - 1) + fib(n - 2)\nprint(fib(15))",
    "seq = [0, 1]\nwhile len(seq) < 10:\n    seq.append(seq[-1] + seq[-2])\nprint(seq)",
    "import math\nprint(math.sqrt(16), math.pi > 3, math.factorial if False else 1)",
    "d = {k: v for k, v in zip('abc', range(3))}\nprint(sorted(d.items(), key=lambda kv: -kv[1]))",
    "x, y = 3, 4\nx, y = y, x\nprint(x, y, x ** 2 + y, 7 // 2, 7 % 3, -7 / 2, 2 ** 0.5)",
    "nums = [5, 3, 8]\nnums.sort()\nnums[0] = 10\nprint(nums, max(nums), min(nums), len(nums))",
    "for i in range(3):\n    if i == 1:\n        continue\n    print(i, end=' ')\nelse:\n    print('done')",
    "total = 0\nfor w in 'the quick brown fox'.split():\n    total += len(w)\nprint(f'{total:>5}|{3.14159:.2f}')",
    "print({1, 2} | {3}, (1, 2) + (3,), 'ab' * 3, [i * i for i in range(5) if i % 2])",
    "print(list(map(str, [1, 2])), list(filter(lambda v: v > 1, [1, 2, 3])), any([]), all([]))",
    "print(isinstance(3, int), type('x'), divmod(17, 5), round(2.675, 2), abs(-3), int('42'))",
    "x = 5\nx",  # the last expression's value is shown, as in a notebook
]


def python_prints(program: str) -> str:
    """What Python prints for ``program`` (the reference: our own test programs), with the
    value of a last expression (not a print) shown as in a notebook."""
    tree = ast.parse(program)
    last = tree.body[-1]
    shown = isinstance(last, ast.Expr) and "print(" not in ast.unparse(last)
    out, env = io.StringIO(), {}
    with contextlib.redirect_stdout(out):
        exec(compile(ast.Module(tree.body[:-1] if shown else tree.body, []), "p", "exec"), env)
        if shown:
            value = eval(ast.unparse(last), env)
            if value is not None:
                print(repr(value))
    return out.getvalue()


def run(program: str, interp: Interpreter | None = None):
    return asyncio.run((interp or Interpreter()).run(program))


@pytest.mark.parametrize("program", PROGRAMS)
def test_prints_what_python_prints(program):
    got = run(program)
    assert got.error is None and got.output == python_prints(program)


REFUSED = [
    ("import os", "import of os (only math) is not allowed (line 1)"),
    ("from math import sqrt", "import of sqrt (only math) is not allowed"),
    ("x = 1\nimport subprocess", "import of subprocess"),  # nothing runs
    ("(1).__class__", "attribute '__class__' is not allowed"),
    ("__import__('os')", "name '__import__' is not allowed"),
    ("class A:\n    pass", "class is not allowed (line 1)"),
    ("try:\n    x = 1\nexcept Exception:\n    pass", "try is not allowed"),
    ("with x:\n    pass", "with is not allowed"),
    ("def g():\n    yield 1", "yield is not allowed"),
    ("global x", "global is not allowed"),
    ("del x", "del is not allowed"),
]


@pytest.mark.parametrize("program,why", REFUSED)
def test_refuses_what_reaches_outside(program, why):
    interp = Interpreter()
    got = run(program, interp)
    assert got.output == "" and why in got.error
    assert interp.globals == {}


@pytest.mark.parametrize(
    "program,why",
    [
        ("open('/etc/passwd')", "NameError: name 'open' is not defined (line 1)"),
        ("eval('1')", "NameError: name 'eval' is not defined"),
        ("getattr(1, 'real')", "name 'getattr' is not defined"),
        ("'{0.__class__}'.format(1)", "no method 'format'"),
        ("x = [1]\nx.__len__()", "attribute '__len__' is not allowed"),
        ("import math\nmath.os", "module 'math' has no attribute 'os'"),
        ("print.__self__", "attribute '__self__' is not allowed"),
        ("1 / 0", "ZeroDivisionError: division by zero (line 1)"),
        ("[1][5]", "IndexError: list index out of range (line 1)"),
        ("{}['k']", "KeyError: 'k' (line 1)"),
        ("print(n)\n", "NameError: name 'n' is not defined (line 1)"),
        ("x = 1 +", "SyntaxError: invalid syntax (line 1)"),
    ],
)
def test_errors_read_like_a_traceback(program, why):
    assert why in run(program).error


@pytest.mark.parametrize(
    "program,why",
    [
        ("while True:\n    pass", "ran more than 2000 steps"),
        ("x = 2 ** 100000", "2 ** 100000 is too large"),
        ("s = 'a' * 10 ** 9", "a sequence of 1000000000 items"),
        ("x = list(range(10 ** 9))", "a value of 1000000000 items"),
        ("s = 'ab' * 400\ns.replace('a', s)", "replace would make a string"),
        ("f'{1:>999999999}'", "format width"),
        ("def f(n):\n    return f(n + 1)\nf(0)", "calls nested deeper than 50"),
        ("for i in range(1000):\n    print('xxxxxxxxxx')", "printed more than 5000 characters"),
    ],
)
def test_limits_stop_runaway_programs(program, why):
    limits = Limits(steps=2000, max_output=5000, max_len=10_000)
    got = run(program, Interpreter(limits=limits))
    assert got.error is not None and why in got.error


def test_time_limit():
    got = run("while True:\n    x = 1", Interpreter(limits=Limits(steps=10**9, seconds=0.2)))
    assert got.error == "ran longer than 0.2 s"


def test_variables_persist_and_tools_are_functions():
    calls = []

    async def weather(city: str) -> str:
        calls.append(city)
        return f"Sunny in {city}"

    interp = Interpreter({"weather": weather})
    assert run("x = 41", interp).error is None
    got = run("print(weather('Paris'), weather(city='Oslo'), x + 1)", interp)
    assert got == ("Sunny in Paris Sunny in Oslo 42\n", None)
    assert calls == ["Paris", "Oslo"]
