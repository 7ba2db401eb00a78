"""Stored Responses on disk: they survive the server being stopped or killed.

One file per stored response, ``<root>/<user>/<id>.json`` (the user's directory named by a
hash of the user's name), written whole or not at all (:func:`pastry.durable.
atomic_write`: temporary file, ``fsync``, rename, directory ``fsync``), readable by the
server's user only. Each file holds its contents' SHA-256: at start a file that does not
parse, does not match its digest or is not where its contents say it belongs is moved
aside (``*.corrupt``), logged and listed in :attr:`ResponseFiles.problems`, never loaded;
temporary files of writes a kill interrupted are removed. The KV a stored response kept
is the engine's and does not survive the server: a loaded response has no export, and a
follow-up computes its history again.

Writes and removals run in order on one thread of their own; the caller awaits the write
before answering, so a response the client received is on the disk.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import os
import re
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from pastry import durable

log = logging.getLogger(__name__)

VERSION = 1
_ID = re.compile(r"[A-Za-z0-9_-]{1,128}")


def _digest(payload: dict) -> str:
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()


def user_dir(user: str) -> str:
    """The directory name of ``user``'s responses (user names may hold any character)."""
    return hashlib.sha256(user.encode("utf-8", "surrogatepass")).hexdigest()[:32]


class ResponseFiles:
    """The stored responses under ``root`` (created, mode 0700, if absent)."""

    def __init__(self, root: Path) -> None:
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True, mode=0o700)
        self.problems: list[str] = []  # what the start found damaged (also logged)
        self._writer = ThreadPoolExecutor(1, thread_name_prefix="pastry responses")

    def load(self) -> list[dict]:
        """Every stored response's payload (``user``, ``id``, ``seq`` and the store's fields),
        oldest first; damaged files are moved aside and reported."""
        out = []
        for d in sorted(p for p in self.root.iterdir() if p.is_dir()):
            durable.leftovers(d)
            for path in sorted(d.glob("*.json")):
                payload = self._read(path)
                if payload is not None:
                    out.append(payload)
        out.sort(key=lambda p: p["seq"])
        return out

    def _read(self, path: Path) -> dict | None:
        try:
            doc = json.loads(path.read_text())
            payload = doc["payload"]
            ok = (
                doc.get("version") == VERSION
                and doc.get("sha256") == _digest(payload)
                and path.parent.name == user_dir(payload["user"])
                and path.name == f"{payload['id']}.json"
            )
        except (OSError, ValueError, KeyError, TypeError):
            ok = False
        if ok:
            return payload
        aside = path.with_name(path.name + ".corrupt")
        os.replace(path, aside)
        message = f"stored response {path} is damaged; moved aside to {aside.name}"
        log.error(message)
        self.problems.append(message)
        return None

    def _path(self, user: str, rid: str) -> Path:
        if not _ID.fullmatch(rid):
            raise ValueError(f"a response id must match {_ID.pattern}, got {rid!r}")
        return self.root / user_dir(user) / f"{rid}.json"

    async def write(self, payload: dict) -> None:
        """Store ``payload`` (with its ``user`` and ``id``) durably; a failure is logged (the
        response stays stored in memory)."""
        path = self._path(payload["user"], payload["id"])
        doc = json.dumps({"version": VERSION, "sha256": _digest(payload), "payload": payload})
        await self._run(self._write, path, doc, f"storing response {payload['id']}")

    async def remove(self, user: str, rid: str) -> None:
        await self._run(self._remove, self._path(user, rid), f"removing response {rid}")

    def discard(self, user: str, rid: str) -> None:
        """Remove a stored response's file now (at start, before any write is queued)."""
        self._remove(self._path(user, rid), "")

    async def _run(self, fn: Any, *args: Any) -> None:
        try:
            await asyncio.get_running_loop().run_in_executor(self._writer, fn, *args)
        except OSError as e:
            log.error("%s on disk failed: %s", args[-1], e)

    @staticmethod
    def _write(path: Path, doc: str, _what: str) -> None:
        path.parent.mkdir(exist_ok=True, mode=0o700)
        durable.atomic_write(path, doc)  # a temporary file of mode 0600, renamed

    @staticmethod
    def _remove(path: Path, _what: str) -> None:
        if path.exists():
            path.unlink()
            durable.fsync_dir(path.parent)

    def close(self) -> None:
        """Wait for the writes in flight."""
        self._writer.shutdown(wait=True)
