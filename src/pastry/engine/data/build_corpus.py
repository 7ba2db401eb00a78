"""Rebuild ``corpus.txt``, the tokenizer training text for tiny checkpoints.

The corpus is committed; this script only documents how it was made and is never run at
import or training time. It concatenates ``prose.txt`` (text written for this project)
with docstrings and function sources from a fixed list of CPython standard-library
modules, read with ``ast`` (nothing is imported). The output depends on the Python
version; ``corpus.txt`` was built with CPython 3.11.7. Usage::

    python src/pastry/engine/data/build_corpus.py
"""

from __future__ import annotations

import ast
import inspect
import sysconfig
from pathlib import Path

HERE = Path(__file__).resolve().parent

# Modules with plenty of English prose in their docstrings.
DOC_MODULES = (
    "argparse", "asyncio/events", "asyncio/queues", "asyncio/tasks", "base64", "bisect",
    "calendar", "cmd", "codecs", "collections/__init__", "configparser", "contextlib", "copy",
    "csv", "dataclasses", "datetime", "decimal", "difflib", "doctest", "email/message",
    "enum", "fileinput", "fnmatch", "fractions", "ftplib", "functools", "getopt", "gettext",
    "glob", "gzip", "heapq", "hmac", "html/parser", "http/client", "http/cookiejar",
    "imaplib", "inspect", "ipaddress", "json/__init__", "json/decoder", "locale",
    "logging/__init__", "mailbox", "netrc", "numbers", "operator", "optparse", "os",
    "pathlib", "pdb", "pickle", "pprint", "queue", "random", "re/__init__", "sched",
    "secrets", "shlex", "shutil", "smtplib", "socket", "statistics", "string", "subprocess",
    "tarfile", "tempfile", "textwrap", "threading", "timeit", "tokenize", "trace",
    "traceback", "typing", "unittest/case", "urllib/parse", "urllib/request", "uuid",
    "warnings", "weakref", "zipfile",
)  # fmt: skip
# Modules whose functions are included as source code.
CODE_MODULES = (
    "bisect", "heapq", "fnmatch", "textwrap", "shlex", "colorsys", "base64", "statistics",
    "string", "graphlib", "difflib", "calendar", "fractions", "functools", "queue", "sched",
)  # fmt: skip
DOC_BUDGET = 190_000
CODE_BUDGET = 90_000


def _source(module: str) -> str:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    return (stdlib / f"{module}.py").read_text(encoding="utf-8")


def docstrings(budget: int) -> str:
    """Module, class and function docstrings, cleaned, at most ``budget`` characters."""
    parts: list[str] = []
    seen: set[str] = set()
    size = 0
    per_module = budget // len(DOC_MODULES) * 2
    for module in DOC_MODULES:
        tree = ast.parse(_source(module))
        taken = 0
        for node in ast.walk(tree):
            if not isinstance(
                node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef
            ):
                continue
            doc = ast.get_docstring(node)
            if not doc or len(doc) < 80:
                continue
            doc = inspect.cleandoc(doc)
            if doc in seen or taken + len(doc) > per_module or size + len(doc) > budget:
                continue
            seen.add(doc)
            parts.append(doc)
            taken += len(doc)
            size += len(doc) + 2
    return "\n\n".join(parts)


def functions(budget: int) -> str:
    """Source of top-level functions and classes, at most ``budget`` characters."""
    parts: list[str] = []
    size = 0
    per_module = budget // len(CODE_MODULES) * 3 // 2
    for module in CODE_MODULES:
        text = _source(module)
        taken = 0
        for node in ast.parse(text).body:
            if not isinstance(node, ast.FunctionDef | ast.ClassDef):
                continue
            seg = ast.get_source_segment(text, node)
            if not seg or taken + len(seg) > per_module or size + len(seg) > budget:
                continue
            parts.append(seg)
            taken += len(seg)
            size += len(seg) + 2
    return "\n\n".join(parts)


def main() -> None:
    prose = (HERE / "prose.txt").read_text(encoding="utf-8").strip()
    text = "\n\n".join([prose, docstrings(DOC_BUDGET), functions(CODE_BUDGET)]) + "\n"
    (HERE / "corpus.txt").write_text(text, encoding="utf-8")
    print(f"wrote {HERE / 'corpus.txt'}: {len(text.encode())} bytes")


if __name__ == "__main__":
    main()
