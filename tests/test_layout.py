"""The source keeps ARCHITECTURE.md's rules of thumb (issue 27), checked on its syntax trees.

- No import cycles between Pastry's modules, counting function-level and ``TYPE_CHECKING``
  imports (a module that needs another's name at run time and the other way round).
- No module reaches into another's ``_private`` names: an ``obj._name`` or
  ``from m import _name`` whose ``_name`` the module does not define itself (``self._x``
  and ``cls._x`` are always its own). Wasmtime's private C API is reached only through
  ``pastry.runtime.wasmtime_raw``, PyTorch's private kernels and dynamo knobs only through
  ``pastry.engine.torch_raw``.
- No source file over 500 lines, no function over 60.

What breaks a rule today is listed below with why: only library privates without a public
door (argparse's). The list only shrinks: a new breach fails, and a listed one that was
fixed fails until its entry is removed.
"""

from __future__ import annotations

import ast
import functools
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"
PKG = SRC / "pastry"
MAX_FILE_LINES = 500
MAX_FUNCTION_LINES = 60

# (file, private name) used across a module boundary today.
KNOWN_PRIVATE = {
    # argparse exposes the type of add_subparsers()'s result only under this name
    ("cli_common.py", "_SubParsersAction"),
}
# Private names a library exports for exactly this use: asyncio lists _set_running_loop in
# asyncio.__all__ for event-loop implementations (the guest's GuestLoop, wasm_pollers).
LIBRARY_DOORS = {"_set_running_loop"}
# The one module that may use wasmtime-py's private C API (and nothing else private).
WASMTIME_DOOR = "runtime/wasmtime_raw.py"
# The one module that may use PyTorch's private kernels and dynamo knobs.
TORCH_DOOR = "engine/torch_raw.py"
DOORS = {WASMTIME_DOOR, TORCH_DOOR}


@functools.cache
def sources() -> dict[str, tuple[str, ast.Module]]:
    """Every module of the package: dotted name -> (path relative to the package, tree)."""
    out = {}
    for path in sorted(PKG.rglob("*.py")):
        parts = list(path.relative_to(SRC).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = (path.relative_to(PKG).as_posix(), ast.parse(path.read_text()))
    return out


def imports(name: str, tree: ast.Module) -> set[str]:
    """The package's modules that module ``name`` imports anywhere in its body."""
    mods = sources()
    is_pkg = sources()[name][0].endswith("__init__.py")
    package = name if is_pkg else name.rpartition(".")[0]

    def resolve(dotted: str) -> str | None:
        while dotted and dotted not in mods:
            dotted = dotted.rpartition(".")[0]
        return dotted or None

    found = set()
    for node in ast.walk(tree):
        targets = []
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(up + ([base] if base else []))
            targets = [f"{base}.{a.name}" for a in node.names]
        found.update(m for t in targets if (m := resolve(t)) is not None)
    found.discard(name)
    return found


def cycles() -> set[frozenset[str]]:
    """The package's import cycles: :func:`components` of its import graph."""
    return components({name: imports(name, tree) for name, (_, tree) in sources().items()})


def components(graph: dict[str, set[str]]) -> set[frozenset[str]]:
    """The strongly connected components of more than one node (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: set[frozenset[str]] = set()

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = set()
            while True:
                w = stack.pop()
                on.discard(w)
                comp.add(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.add(frozenset(comp))

    for v in graph:
        if v not in index:
            visit(v)
    return out


def test_no_import_cycles():
    found = [sorted(c) for c in cycles()]
    assert not found, f"import cycles (a function-level or TYPE_CHECKING import counts): {found}"


def own_privates(tree: ast.Module) -> set[str]:
    """The ``_names`` a module defines itself (functions, classes, attributes, variables,
    parameters, slots)."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.add(node.name)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            names.add(node.attr)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
        elif isinstance(node, ast.arg):
            names.add(node.arg)
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            names.add(node.value)  # __slots__ entries, getattr names
    return {n for n in names if n.startswith("_")}


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def private_uses(tree: ast.Module) -> set[tuple[str, int]]:
    """``(name, line)`` of every private name the module takes from elsewhere."""
    mine = own_privates(tree)
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            out.update((a.name, node.lineno) for a in node.names if _private(a.name))
            for part in (node.module or "").split("."):
                if _private(part):
                    out.add((part, node.lineno))
        elif isinstance(node, ast.Import):
            for a in node.names:
                out.update((p, node.lineno) for p in a.name.split(".") if _private(p))
        elif isinstance(node, ast.Attribute) and _private(node.attr):
            base = node.value
            if isinstance(base, ast.Name) and base.id in ("self", "cls"):
                continue
            if isinstance(base, ast.Call) and getattr(base.func, "id", None) == "super":
                continue
            if node.attr not in mine:
                out.add((node.attr, node.lineno))
    return out


def test_no_private_reach_ins_across_modules():
    found, seen = [], set()
    for path, tree in sources().values():
        for name, line in sorted(private_uses(tree)):
            if path in DOORS or name in LIBRARY_DOORS:
                continue
            seen.add((path, name))
            if (path, name) not in KNOWN_PRIVATE:
                found.append(f"{path}:{line}: {name}")
    assert not found, f"private names used across modules (add a public door): {found}"
    fixed = sorted(KNOWN_PRIVATE - seen)
    assert not fixed, f"no longer used: remove them from KNOWN_PRIVATE: {fixed}"


def test_only_the_door_module_touches_wasmtimes_private_api():
    users = []
    for path, tree in sources().values():
        for node in ast.walk(tree):
            names = []
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("wasmtime"):
                names = [node.module, *(a.name for a in node.names)]
            elif isinstance(node, ast.Attribute) and getattr(node.value, "id", "") == "wasmtime":
                names = [node.attr]
            if any(_private(p) for n in names for p in n.split(".")) and path != WASMTIME_DOOR:
                users.append(f"{path}:{node.lineno}")
    assert not users, f"wasmtime's private API outside {WASMTIME_DOOR}: {users}"


def lengths() -> tuple[dict[str, int], dict[str, int]]:
    """Lines per source file, and per function (``file:Class.method``; nested ones too)."""
    files, functions = {}, {}
    for path, tree in sources().values():
        files[path] = (PKG / path).read_text().count("\n")

        _walk(tree, path + ":", functions)
    return files, functions


def _walk(node: ast.AST, prefix: str, functions: dict[str, int]) -> None:
    for child in ast.iter_child_nodes(node):
        if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef):
            name = prefix + child.name
            functions[name] = child.end_lineno - child.lineno + 1
            _walk(child, name + ".", functions)
        elif isinstance(child, ast.ClassDef):
            _walk(child, prefix + child.name + ".", functions)
        else:
            _walk(child, prefix, functions)


def test_no_file_over_500_lines_and_no_function_over_60():
    files, functions = lengths()
    for sizes, limit, what in ((files, MAX_FILE_LINES, "source files"),
                               (functions, MAX_FUNCTION_LINES, "functions")):  # fmt: skip
        over = [f"{k} ({n} lines)" for k, n in sorted(sizes.items()) if n > limit]
        assert not over, f"{what} over {limit} lines: {over}; split them"


def test_the_checks_see_what_they_look_for(tmp_path):
    """The finders find: a cycle, a private reach-in, a long function (on made-up code)."""
    tree = ast.parse(
        "import a._hidden\nfrom b import _x\nobj._secret\nself._mine\n"
        "class C:\n    __slots__ = ('_slot',)\n    def f(self):\n        return other._slot\n"
    )
    assert {name for name, _ in private_uses(tree)} == {"_hidden", "_x", "_secret"}
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a", "e"}, "e": {"d"}, "f": set()}
    assert components(graph) == {frozenset("abc"), frozenset("de")}
    files, functions = lengths()
    assert functions["api/table.py:request"] > 1 and files["api/table.py"] > 1
