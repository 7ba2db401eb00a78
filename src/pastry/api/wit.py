"""``wit/pastry.wit``, generated from the request table.

    python -m pastry.api.wit           # rewrite wit/pastry.wit from the table
    python -m pastry.api.wit --check   # exit 1 if the file differs from the table

The ``api`` interface is the table (:data:`pastry.api.SPECS`): one function per request
kind, its parameters the record's fields (kebab-case), its documentation the record's
docstring, its result from how the request answers (a value now: ``result<T, string>``;
queued: a ``pending`` handle whose outcome ``take`` returns as a case of ``value``). The
``sampling`` record, the ``value`` variant, the three waiting functions of the binding
(``wait``, ``take``, ``wait-take``) and the worlds are written here. The build of the
Python runtime component (:mod:`pastry.runtime.build_pyrt`) and every other guest read the
file; ``tests/test_api_table.py`` fails when it is not what this module writes.
"""

from __future__ import annotations

import argparse
import dataclasses
import re
import sys
import textwrap
import typing
from pathlib import Path

from pastry.api.sampling import Sampling
from pastry.api.table import SPECS, VALUES, Spec
from pastry.api.types import wit_text, wit_type

PATH = Path(__file__).resolve().parents[3] / "wit" / "pastry.wit"
WIDTH = 94

HEADER = """\
/// The Pastry inferlet API for sandboxed (WebAssembly) inferlets. Generated from the request
/// table of src/pastry/api/ by `python -m pastry.api.wit`: do not edit by hand.
///
/// Handles (queues, KV pages, embeddings, subscriptions, pending calls) are small integers
/// private to the calling instance. Misuse returns `err` with a message naming the bad
/// value; it never ends the instance by itself.
///
/// Queued calls (those taking a queue `q`, and the waits: receive, next-message, http) do
/// not block: they submit the call and return a `pending` handle at once, so that several
/// calls can be issued before waiting (embed, forward and sample of one step then share an
/// engine batch). `wait` is the only call that blocks: the host suspends the guest (a
/// Wasmtime fiber) until one of the pending calls has completed, and runs other inferlets
/// meanwhile; `take` then returns the outcome.
package pastry:inferlet@0.1.0;
"""

WAITING = """\
    // ------------------------------------------------------------ waiting
    /// Block until at least one of `pendings` has completed, or `timeout-ns` has passed;
    /// returns the completed ones (possibly none on a timeout).
    wait: func(pendings: list<pending>, timeout-ns: option<u64>) -> list<pending>;
    /// The outcome of a completed pending call; the handle is freed.
    take: func(p: pending) -> result<value, string>;
    /// `wait` for any of this instance's pending calls, then `take` every completed one:
    /// one call per wake-up (the Python runtime's event loop blocks here). Returns no
    /// outcome when `timeout-ns` passed first, or when nothing is pending (then it only
    /// sleeps for `timeout-ns`; the host's timer, not the guest, does the waiting).
    wait-take: func(timeout-ns: option<u64>) -> list<tuple<pending, result<value, string>>>;
"""

WORLDS = """\
/// A compiled inferlet (C, Zig, Rust, ...): `run` is its `main`.
world inferlet {
    import api;
    /// Runs the inferlet; `ok(some(text))` is its result, `err` its error (a traceback).
    export run: func(args: list<string>) -> result<option<string>, string>;
}

/// How a pre-started Python runtime instance gets its inferlet (world `python-runtime`).
/// Each is called once, in this order, by the runtime: a pre-started instance parks in
/// `load-inferlet`; one loaded ahead of its launch parks in `start-inferlet`.
interface launcher {
    /// Block until the host gives this instance an inferlet: its name and compiled code
    /// (what `compile-source` returned). The runtime executes the module, then:
    load-inferlet: func() -> tuple<string, string>;
    /// Block until a launch starts the loaded inferlet: its arguments.
    start-inferlet: func() -> list<string>;
    /// The inferlet's source text (only read to show source lines in its tracebacks).
    inferlet-source: func() -> string;
    /// Where this instance's runtime put `marker` in its linear memory (before any
    /// inferlet code runs): how the host finds the memory to report its size.
    memory-probe: func(offset: u32, marker: list<u8>);
}

/// The generic Python runtime ("pyrt"): runs the `async def main(args)` of Python source,
/// with `pastry.sdk` bound to the imports. The host never parses tenant source itself.
world python-runtime {
    import api;
    import launcher;
    /// Check and compile an inferlet's source: `ok(code)` (marshalled, as latin-1 text)
    /// or `err(message)` (a syntax error, no `async def main(args)`, ...). Runs nothing.
    export compile-source: func(name: string, source: string) -> result<string, string>;
    /// Warm up, wait in `load-inferlet` and `start-inferlet`, then run the inferlet's
    /// `main`: its result or its traceback.
    export serve: func() -> result<option<string>, string>;
}
"""


def kebab(name: str) -> str:
    return name.replace("_", "-")


def doc_lines(doc: str, indent: str = "    ") -> list[str]:
    """A docstring as ``///`` comment lines (RST's ``code`` as `code`)."""
    text = re.sub(r":\w+:`~?([\w.]+)`", r"`\1`", doc).replace("``", "`")
    out = []
    for para in text.split("\n\n"):
        para = " ".join(para.split())
        if out:
            out.append(f"{indent}///")
        width = WIDTH - len(indent) - 4
        out += [f"{indent}/// {line}" for line in textwrap.wrap(para, width)]
    return out


def result_type(spec: Spec) -> str:
    now = None if spec.now is None else wit_text(spec.now_tree)
    inner = now
    if spec.queued:
        inner = f"tuple<{now}, pending>" if now else "pending"
    if spec.fallible:
        return f" -> result<{inner or '_'}, string>"
    return f" -> {inner}" if inner else ""


def function(spec: Spec) -> list[str]:
    params = ", ".join(f"{kebab(p.name)}: {wit_text(p.tree)}" for p in spec.params)
    return [*doc_lines(spec.doc), f"    {spec.wit}: func({params}){result_type(spec)};"]


def value_variant() -> list[str]:
    users: dict[str, list[str]] = {c: [] for c in VALUES}
    for spec in SPECS.values():
        for case in spec.queued:
            users[case].append(spec.wit)
    lines = ["    /// The outcome of a completed pending call.", "    variant value {"]
    for case, (tree, doc) in VALUES.items():
        lines += doc_lines(f"{', '.join(users[case])}: {doc}", " " * 8)
        lines.append(f"        {case}{'' if tree is None else f'({wit_text(tree)})'},")
    return [*lines, "    }"]


def sampling_record() -> list[str]:
    hints = typing.get_type_hints(Sampling, include_extras=True)
    lines = [*doc_lines(Sampling.__doc__ or ""), "    record sampling {"]
    for f in dataclasses.fields(Sampling):
        lines.append(f"        {kebab(f.name)}: {wit_text(wit_type(hints[f.name]))},")
    return [*lines, "    }"]


def generate() -> str:
    """The text of ``wit/pastry.wit``."""
    lines = [
        HEADER,
        "interface api {",
        "    /// A call in flight, private to this instance; consumed by `take`.",
        "    type pending = u32;",
        "",
        *value_variant(),
        "",
        *sampling_record(),
        "",
        WAITING.rstrip("\n"),
    ]
    group = None
    for spec in SPECS.values():
        if spec.group != group:
            group = spec.group
            lines += [
                "",
                f"    // ------------------------------------------------------------ {group}",
            ]
        lines += function(spec)
    lines += ["}", "", WORLDS]
    return "\n".join(lines).rstrip("\n") + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--check", action="store_true", help="only compare; exit 1 if it differs")
    p.add_argument("--path", type=Path, default=PATH)
    a = p.parse_args(argv)
    text = generate()
    if a.check:
        same = a.path.exists() and a.path.read_text() == text
        if not same:
            print(f"{a.path} is not what the request table gives: run python -m pastry.api.wit")
        return 0 if same else 1
    a.path.write_text(text)
    print(a.path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
