"""Content-addressed program store.

Uploaded inferlets are stored under their SHA-256 (``<root>/<hash>.py``) with a name index,
validated (compiled, ``main`` checked) once at upload, and kept compiled in memory: a
second launch of the same program neither reads nor validates it again. Built-in programs
(``pastry/inferlets/*.py``) are registered by name at start-up.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
from dataclasses import asdict, dataclass
from importlib import resources
from pathlib import Path

from pastry.runtime.trusted import Program, ProgramError

log = logging.getLogger(__name__)


class RegistryError(ValueError):
    """Unknown program, ambiguous hash prefix, or an upload that is too large."""


@dataclass(frozen=True)
class ProgramInfo:
    hash: str
    name: str
    size: int
    builtin: bool


class ProgramRegistry:
    def __init__(self, root: Path, max_bytes: int = 1 << 20, sandbox_uploads: bool = True) -> None:
        self.root = Path(root)
        self.sandbox_uploads = sandbox_uploads
        self.root.mkdir(parents=True, exist_ok=True)
        self.max_bytes = max_bytes
        self._index_path = self.root / "index.json"
        self._infos: dict[str, ProgramInfo] = {}  # hash -> info
        self._names: dict[str, str] = {}  # name -> hash (latest upload wins)
        self._compiled: dict[str, Program] = {}  # hash -> program
        self.compiles = 0  # how many times source was compiled (tests check the cache)
        if self._index_path.exists():
            for raw in json.loads(self._index_path.read_text()):
                info = ProgramInfo(**raw)
                if (self.root / f"{info.hash}.py").exists():
                    self._infos[info.hash] = info
                    self._names[info.name] = info.hash

    def add_builtins(self) -> None:
        """Register every ``pastry/inferlets/*.py`` by its name (underscores as dashes), and
        the routers of ``pastry/inferlets/routers/`` as ``router-NAME``.

        A built-in that fails to load is logged and left out rather than stopping the
        server (``tests/test_builtins.py`` checks that all of them load).
        """
        for package, prefix in (("pastry.inferlets", ""), ("pastry.inferlets.routers", "router-")):
            for entry in resources.files(package).iterdir():
                if entry.name.endswith(".py") and not entry.name.startswith("_"):
                    name = prefix + entry.name[:-3].replace("_", "-")
                    try:
                        self._add(entry.read_text(), name, builtin=True)
                    except ProgramError as e:
                        log.error("built-in inferlet %s does not load: %s", name, e)

    def upload(self, source: str | bytes, name: str | None = None) -> ProgramInfo:
        """Validate and store a program; returns its info (idempotent for the same bytes)."""
        data = source.encode() if isinstance(source, str) else bytes(source)
        if len(data) > self.max_bytes:
            raise RegistryError(
                f"program is {len(data)} bytes, over the upload limit of {self.max_bytes} bytes"
            )
        try:
            text = data.decode()
        except UnicodeDecodeError as e:
            raise RegistryError(f"program is not UTF-8 text: {e}") from None
        if name is not None and name in self._names and self._infos[self._names[name]].builtin:
            raise RegistryError(f"'{name}' is a built-in program; upload under another name")
        return self._add(text, name, builtin=False)

    def _add(self, text: str, name: str | None, builtin: bool) -> ProgramInfo:
        digest = hashlib.sha256(text.encode()).hexdigest()
        name = name or f"program-{digest[:12]}"
        if digest not in self._compiled:
            self._compiled[digest] = self._compile(name, text, sandboxed=not builtin)
        info = ProgramInfo(digest, name, len(text.encode()), builtin)
        known = self._infos.get(digest)
        if known is None or known.name != name:
            self._infos[digest] = info
        self._names[name] = digest
        if not builtin:
            self._store(digest, text)
        return self._infos[digest]

    def _compile(self, name: str, text: str, sandboxed: bool) -> Program:
        """Built-ins (and uploads when the operator allows it) run trusted, in the server;
        uploads run in the WebAssembly sandbox."""
        self.compiles += 1
        if not (sandboxed and self.sandbox_uploads):
            return Program.from_source(name, text)  # raises ProgramError
        try:
            from pastry.runtime.wasm import SandboxError, sandboxed_program

            return sandboxed_program(name, text)
        except (ImportError, SandboxError, FileNotFoundError) as e:
            raise RegistryError(
                f"uploads run in the WebAssembly sandbox, which is not available ({e}); build "
                "it with `python -m pastry.runtime.build_pyrt`, or let the operator run "
                "uploads trusted with `pastry serve --trusted-uploads`"
            ) from None

    def _store(self, digest: str, text: str) -> None:
        path = self.root / f"{digest}.py"
        if not path.exists():
            _atomic_write(path, text)
        rows = [asdict(i) for i in self._infos.values() if not i.builtin]
        _atomic_write(self._index_path, json.dumps(rows, indent=1))

    def resolve(self, ref: str) -> str:
        """The hash of a program given by name, full hash or unique hash prefix (≥ 8)."""
        if ref in self._names:
            return self._names[ref]
        if ref in self._infos:
            return ref
        if len(ref) >= 8:
            hits = [h for h in self._infos if h.startswith(ref)]
            if len(hits) == 1:
                return hits[0]
            if len(hits) > 1:
                raise RegistryError(f"hash prefix '{ref}' is ambiguous ({len(hits)} programs)")
        raise RegistryError(
            f"no program '{ref}' (upload it first; known: {', '.join(sorted(self._names)) or 'none'})"
        )

    def get(self, ref: str) -> Program:
        digest = self.resolve(ref)
        prog = self._compiled.get(digest)
        if prog is None:  # stored by an earlier server run: compile once now
            text = (self.root / f"{digest}.py").read_text()
            info = self._infos[digest]
            prog = self._compiled[digest] = self._compile(info.name, text, not info.builtin)
        return prog

    def info(self, ref: str) -> ProgramInfo:
        return self._infos[self.resolve(ref)]

    def list(self) -> list[ProgramInfo]:
        return sorted(self._infos.values(), key=lambda i: (not i.builtin, i.name))


def _atomic_write(path: Path, text: str) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-")
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.replace(tmp, path)


__all__ = ["ProgramError", "ProgramInfo", "ProgramRegistry", "RegistryError"]
