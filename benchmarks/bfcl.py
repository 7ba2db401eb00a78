"""Single-call tasks of the Berkeley Function Calling Leaderboard and its AST check, for
``benchmarks/agents.py``.

The ``bfcl-eval`` wheel is fetched with pip (``pastry.sched.datasets.fetch_wheel``) and
read, never installed: it pins numpy, pandas, sentence-transformers and every provider's
SDK. Per category it ships the questions (``bfcl_eval/data/BFCL_v4_<category>.json``, one
JSON object per line: the user's messages and the functions offered, in BFCL's dialect of
JSON Schema) and the possible answers (``possible_answer/``: per parameter, the values a
correct call may give; ``""`` marks an optional one that may be left out).
:func:`load_tasks` reads the categories whose answer is one call (``simple_python``,
``multiple``, ``live_simple``, ``live_multiple``); :func:`openai_tool` makes an OpenAI tool
of a function (BFCL writes ``dict``, ``float``, ``tuple`` and ``any`` where JSON Schema
has ``object``, ``number``, ``array`` and no type).

:func:`ast_check` is BFCL's own checker, ``bfcl_eval.eval_checker.ast_eval.ast_checker``,
imported from the wheel's files (extracted once under ``$PASTRY_HOME/sched/``). Its one
heavy import, ``bfcl_eval.constants.model_config`` (every provider's handler, used only to
undo the ``.`` → ``_`` renaming of function names some providers need), is given a table
in which our model keeps names as written: tools are offered and called by their names.
"""

from __future__ import annotations

import importlib
import json
import sys
import types
import zipfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pastry.paths import pastry_home
from pastry.sched.datasets import BFCL, fetch_wheel

MODEL = "pastry-agent"  # the model name the checker is told (names kept as written)
CATEGORIES = {  # category -> the checker's test_category (one call expected)
    "simple_python": "simple",
    "multiple": "multiple",
    "live_simple": "live_simple",
    "live_multiple": "live_multiple",
}
_TYPES = {"dict": "object", "float": "number", "tuple": "array"}
_KEEP = ("description", "enum", "required", "default", "minimum", "maximum")
_CHECKER_FILES = (
    "bfcl_eval/__init__.py",
    "bfcl_eval/constants/__init__.py",
    "bfcl_eval/constants/enums.py",
    "bfcl_eval/constants/type_mappings.py",
    "bfcl_eval/eval_checker/__init__.py",
    "bfcl_eval/eval_checker/ast_eval/",
)


@dataclass(frozen=True)
class Task:
    id: str
    category: str
    messages: tuple[dict[str, str], ...]  # the user's turn (live tasks may add a system one)
    functions: tuple[dict[str, Any], ...]  # BFCL's function documents
    answer: tuple[dict[str, Any], ...]  # the possible answers: [{name: {param: [values]}}]

    @property
    def question(self) -> str:
        return "\n".join(m["content"] for m in self.messages if m.get("role") == "user")


def wheel() -> Path:
    return fetch_wheel(*BFCL, hint="agents.py needs bfcl-eval's data (pip download)")


def load_tasks(category: str = "simple_python") -> list[Task]:
    """Every task of ``category`` (a key of :data:`CATEGORIES`) with its possible answer,
    in the file's order."""
    if category not in CATEGORIES:
        raise ValueError(f"category {category!r}: one of {sorted(CATEGORIES)}")
    with zipfile.ZipFile(wheel()) as z:
        questions = _lines(z.read(f"bfcl_eval/data/BFCL_v4_{category}.json"))
        answers = _lines(z.read(f"bfcl_eval/data/possible_answer/BFCL_v4_{category}.json"))
    truth = {a["id"]: a["ground_truth"] for a in answers}
    return [
        Task(
            q["id"],
            category,
            tuple(q["question"][0]),
            tuple(q["function"]),
            tuple(truth[q["id"]]),
        )
        for q in questions
        if q["id"] in truth and len(q["question"]) == 1
    ]


def json_schema(schema: Any) -> Any:
    """BFCL's parameter schema as JSON Schema (see the module docstring)."""
    if not isinstance(schema, Mapping):
        return schema
    out: dict[str, Any] = {}
    for key, value in schema.items():
        if key == "type":
            if value != "any":
                out["type"] = _TYPES.get(value, value)
        elif key == "properties" and isinstance(value, Mapping):
            out["properties"] = {name: json_schema(p) for name, p in value.items()}
        elif key in ("items", "additionalProperties"):
            out[key] = json_schema(value)
        elif key in _KEEP:
            out[key] = value
    return out


def openai_tool(function: Mapping[str, Any], url: str) -> dict[str, Any]:
    """An OpenAI tool (plus where it runs, ``pastry.sdk.tools``) for a BFCL function."""
    params = json_schema(function.get("parameters") or {"type": "dict", "properties": {}})
    params.setdefault("properties", {})
    params.setdefault("required", [])  # BFCL lists the required ones; absent: none
    return {
        "type": "function",
        "function": {
            "name": function["name"],
            "description": function.get("description", ""),
            "parameters": params,
        },
        "http": {"url": url},
    }


def ast_check(task: Task, calls: Sequence[Mapping[str, Any]]) -> tuple[bool, str]:
    """BFCL's verdict on ``calls`` (``[{name: arguments}]``, the calls the agent made) as
    the answer to ``task``: (valid, the checker's error or "")."""
    checker, language = _checker()
    out = checker.ast_checker(
        list(task.functions),
        [dict(c) for c in calls],
        list(task.answer),
        language.PYTHON,
        CATEGORIES[task.category],
        MODEL,
    )
    return bool(out["valid"]), "; ".join(map(str, out.get("error", [])))


_loaded: tuple[types.ModuleType, Any] | None = None


def _checker() -> tuple[types.ModuleType, Any]:
    global _loaded
    if _loaded is None:
        root = _extract()
        config = types.ModuleType("bfcl_eval.constants.model_config")
        config.MODEL_CONFIG_MAPPING = {MODEL: types.SimpleNamespace(underscore_to_dot=False)}
        sys.modules.setdefault("bfcl_eval.constants.model_config", config)
        sys.path.insert(0, str(root))
        try:
            checker = importlib.import_module("bfcl_eval.eval_checker.ast_eval.ast_checker")
            enums = importlib.import_module("bfcl_eval.constants.enums")
        finally:
            sys.path.remove(str(root))
        _loaded = (checker, enums.Language)
    return _loaded


def _extract() -> Path:
    whl = wheel()
    root = pastry_home() / "sched" / whl.stem
    done = root / ".complete"
    if not done.is_file():
        with zipfile.ZipFile(whl) as z:
            for name in z.namelist():
                if name.endswith(".py") and name.startswith(_CHECKER_FILES):
                    z.extract(name, root)
        done.write_text("")
    return root


def _lines(data: bytes) -> list[dict]:
    return [json.loads(line) for line in data.decode().splitlines() if line.strip()]
