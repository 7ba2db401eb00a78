"""Content-addressed program store, one namespace per user.

Uploaded inferlets are stored under their SHA-256 (``<root>/<hash>.py``) with an index of
who uploaded what under which name (``index.json``), validated (compiled, ``main`` checked)
once at upload, and kept compiled in memory: a second launch of the same program neither
reads nor validates it again.

Built-in programs (``pastry/inferlets/*.py``) are registered by name at start-up and are
immutable: their names are reserved in every namespace, no upload can replace them, and
:meth:`ProgramRegistry.builtin` (what the OpenAI endpoints use) only ever returns them.

Each user sees the built-ins and its own uploads (names, hashes and hash prefixes resolve
among those only), under quotas on how many programs it keeps and their total size.
Whether an upload runs trusted (in the server process) or in the WebAssembly sandbox is
decided when it is uploaded and recorded with it: trusted only if the server allows trusted
uploads (``--trusted-uploads``) *and* the uploader is an operator; a program recorded as
sandboxed stays sandboxed whatever later servers allow, and one recorded as trusted runs
sandboxed on a server that does not allow trusted uploads.

Nothing is lost or half-written when the server is killed (``pastry/durable.py``): files
are written to a temporary name, flushed to the disk and renamed, program file before the
index entry naming it, and the index keeps its previous version (``index.json.prev``). At
start the store is checked: unfinished writes are removed, every program file must hash to
its name, a damaged file (or index) is moved aside as ``*.corrupt`` and reported in the log
and in :attr:`ProgramRegistry.problems`, never loaded; an upload killed before its index
entry was written was never acknowledged, and its file is removed.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import json
import logging
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, replace
from importlib import resources
from pathlib import Path

from pastry import durable
from pastry.control.users import LOCAL, LOCAL_USER, User
from pastry.runtime.trusted import Program, ProgramError

log = logging.getLogger(__name__)

MAX_NAME_CHARS = 128


class RegistryError(ValueError):
    """Unknown program, ambiguous hash prefix, a reserved or bad name, or an upload over a
    limit."""


class UploadQuotaError(RegistryError):
    """An upload would take its user over the program count or bytes quota."""


@dataclass(frozen=True)
class ProgramInfo:
    hash: str
    name: str
    size: int
    builtin: bool
    owner: str | None = None  # the uploading user (None: built-in)
    trusted: bool = False  # recorded at upload: may run in the server process


class ProgramRegistry:
    def __init__(
        self,
        root: Path,
        max_bytes: int = 1 << 20,
        trusted_uploads: bool = False,
        max_programs_per_user: int | None = None,
        max_bytes_per_user: int | None = None,
    ) -> None:
        self.root = Path(root)
        self.trusted_uploads = trusted_uploads
        self.root.mkdir(parents=True, exist_ok=True)
        self.max_bytes = max_bytes
        self.max_programs_per_user = max_programs_per_user
        self.max_bytes_per_user = max_bytes_per_user
        self._index_path = self.root / "index.json"
        self._builtins: dict[str, ProgramInfo] = {}  # name -> info
        self._uploads: dict[str, dict[str, ProgramInfo]] = {}  # user -> name -> info
        self._compiled: dict[tuple[str, bool], Program] = {}  # (hash, trusted) -> program
        self._lock = threading.Lock()  # _compiled is filled from the compile thread too
        self._compiler = ThreadPoolExecutor(max_workers=1, thread_name_prefix="pastry-compile")
        self.compiles = 0  # how many times source was compiled (tests check the cache)
        self.problems: list[str] = []  # what the start found damaged (also logged)
        left = durable.leftovers(self.root)
        if left:
            log.info("removed %d unfinished writes in %s: %s", len(left), self.root, left)
        if self._index_path.exists() or self._previous_index.exists():
            self._load_index()

    @property
    def _previous_index(self) -> Path:
        return self._index_path.with_name(self._index_path.name + ".prev")

    def _problem(self, message: str) -> None:
        self.problems.append(message)
        log.error("program store %s: %s", self.root, message)

    def _read_index(self) -> tuple[list, bool]:
        """The index's rows, and whether they are the current index (else the previous
        one, or none). A damaged file is moved aside (``*.corrupt``) and reported."""
        for path in (self._index_path, self._previous_index):
            if not path.exists():
                continue
            try:
                rows = json.loads(path.read_bytes().decode("utf-8", "surrogatepass"))
                if not isinstance(rows, list):
                    raise ValueError(f"a list of programs was expected, got {type(rows).__name__}")
            except ValueError as e:
                aside = path.with_name(f"{path.name}.corrupt")
                os.replace(path, aside)
                self._problem(f"{path.name} is damaged ({e}); moved to {aside.name}")
                continue
            if path != self._index_path:
                self._problem(
                    f"using {path.name}, the index before the last change: the last upload "
                    "or delete may be missing"
                )
            return rows, path == self._index_path
        return [], False

    def _load_index(self) -> None:
        rows, current = self._read_index()
        legacy = 0
        fields = {f.name for f in dataclasses.fields(ProgramInfo)}
        verified: dict[str, bool] = {}
        for raw in rows:
            if isinstance(raw, dict) and "owner" not in raw:  # written before users existed
                raw = {**raw, "owner": LOCAL, "trusted": False}
                legacy += 1
            try:
                if not isinstance(raw, dict) or set(raw) - fields:
                    raise TypeError("not a program entry")
                info = ProgramInfo(**raw)
                if not (isinstance(info.hash, str) and isinstance(info.name, str)):
                    raise TypeError("hash and name must be strings")
            except TypeError as e:
                self._problem(f"index entry {str(raw)[:200]} is damaged ({e}); skipped")
                continue
            if info.builtin:
                continue
            if info.hash not in verified:
                verified[info.hash] = self._verify(info.hash)
            if verified[info.hash]:
                self._uploads.setdefault(info.owner, {})[info.name] = info
            elif (self.root / f"{info.hash}.py.corrupt").exists():
                self._problem(
                    f"program {info.name!r} of user {info.owner} is lost (its file was damaged)"
                )
        if current and not self.problems:  # files no entry names: an upload killed
            # before its index entry was written (never acknowledged)
            named = {i.hash for names in self._uploads.values() for i in names.values()}
            for path in self.root.glob("*.py"):
                if path.stem not in named:
                    path.unlink(missing_ok=True)
        if legacy:
            log.warning(
                "%d programs stored before users existed now belong to user '%s' and run sandboxed",
                legacy,
                LOCAL,
            )

    def _verify(self, digest: str) -> bool:
        """Whether the stored file of ``digest`` is there and holds exactly its content (a
        damaged one is moved aside as ``*.corrupt`` and reported)."""
        path = self.root / f"{digest}.py"
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            return False
        if hashlib.sha256(data).hexdigest() == digest:
            return True
        aside = path.with_name(path.name + ".corrupt")
        os.replace(path, aside)
        self._problem(f"{path.name} does not hold the program of that hash; moved to {aside.name}")
        return False

    def add_builtins(self) -> None:
        """Register every ``pastry/inferlets/*.py`` by its name (underscores as dashes), and
        the routers of ``pastry/inferlets/routers/`` as ``router-NAME``.

        A built-in that fails to load is logged and left out rather than stopping the
        server (``tests/test_builtins.py`` checks that all of them load).
        """
        for package, prefix in (("pastry.inferlets", ""), ("pastry.inferlets.routers", "router-")):
            for entry in resources.files(package).iterdir():
                if not entry.name.endswith(".py") or entry.name.startswith("_"):
                    continue
                name = prefix + entry.name[:-3].replace("_", "-")
                text = entry.read_text()
                digest = hashlib.sha256(text.encode()).hexdigest()
                try:
                    self._compiled[(digest, True)] = self._compile(name, text, trusted=True)
                except ProgramError as e:
                    log.error("built-in inferlet %s does not load: %s", name, e)
                    continue
                self._builtins[name] = ProgramInfo(digest, name, len(text.encode()), True)

    # ------------------------------------------------------------------ uploads

    def upload(
        self, source: str | bytes, name: str | None = None, user: User = LOCAL_USER
    ) -> ProgramInfo:
        """Validate and store a program of ``user``; returns its info (idempotent for the
        same bytes and name). Compiles on the calling thread (see :meth:`upload_async`)."""
        text, digest, name, trusted = self._check_upload(source, name, user)
        self._ensure_compiled(digest, name, text, trusted)
        return self._commit(text, digest, name, user, trusted)

    async def upload_async(
        self, source: str | bytes, name: str | None = None, user: User = LOCAL_USER
    ) -> ProgramInfo:
        """:meth:`upload`, compiling on the registry's compile thread (one at a time)."""
        text, digest, name, trusted = self._check_upload(source, name, user)
        if (digest, trusted) not in self._compiled:
            loop = asyncio.get_running_loop()
            await loop.run_in_executor(
                self._compiler, self._ensure_compiled, digest, name, text, trusted
            )
        text, digest, name, trusted = self._check_upload(source, name, user)  # may have changed
        return self._commit(text, digest, name, user, trusted)

    def _check_upload(
        self, source: str | bytes, name: str | None, user: User
    ) -> tuple[str, str, str, bool]:
        """Everything an upload must pass before it is compiled (changes nothing)."""
        data = source.encode("utf-8", "surrogatepass") if isinstance(source, str) else source
        if len(data) > self.max_bytes:
            raise RegistryError(
                f"program is {len(data)} bytes, over the upload limit of {self.max_bytes} bytes"
            )
        try:
            text = bytes(data).decode()
        except UnicodeDecodeError as e:
            raise RegistryError(f"program is not UTF-8 text: {e}") from None
        digest = hashlib.sha256(data).hexdigest()
        name = name or f"program-{digest[:12]}"
        if name in self._builtins:
            raise RegistryError(f"'{name}' is a built-in program; upload under another name")
        if (
            not isinstance(name, str)
            or len(name) > MAX_NAME_CHARS
            or not name.isprintable()
            or any(c.isspace() for c in name)
            or name.startswith("~")
        ):
            raise RegistryError(
                f"program name {name[:MAX_NAME_CHARS]!r} is not valid: use 1 to "
                f"{MAX_NAME_CHARS} printable characters without spaces, not starting with '~'"
            )
        mine = self._uploads.get(user.name, {})
        old = mine.get(name)
        cap = self.max_programs_per_user
        if old is None and cap is not None and len(mine) >= cap:
            raise UploadQuotaError(
                f"user {user.name} already stores {len(mine)} programs, the most a user may "
                f"keep (--max-uploads-per-user {self.max_programs_per_user}); delete some "
                "with delete_program first"
            )
        if self.max_bytes_per_user is not None:
            digests = {i.hash: i.size for i in mine.values() if i.name != name}
            digests[digest] = len(data)
            total = sum(digests.values())
            if total > self.max_bytes_per_user:
                raise UploadQuotaError(
                    f"storing {name!r} ({len(data)} bytes) would take user {user.name}'s "
                    f"programs to {total} bytes, over the quota of {self.max_bytes_per_user} "
                    "bytes (--max-upload-bytes-per-user); delete some with delete_program first"
                )
        return text, digest, name, self.trusted_uploads and user.operator

    def _ensure_compiled(self, digest: str, name: str, text: str, trusted: bool) -> None:
        with self._lock:
            if (digest, trusted) in self._compiled:
                return
        program = self._compile(name, text, trusted)  # raises ProgramError / RegistryError
        with self._lock:
            self._compiled.setdefault((digest, trusted), program)

    def _commit(self, text: str, digest: str, name: str, user: User, trusted: bool) -> ProgramInfo:
        info = ProgramInfo(digest, name, len(text.encode("utf-8", "surrogatepass")), False,
                           user.name, trusted)  # fmt: skip
        mine = self._uploads.setdefault(user.name, {})
        old = mine.get(name)
        mine[name] = info
        self._store(digest, text, dropped=old.hash if old and old.hash != digest else None)
        return info

    def delete(self, ref: str, user: User = LOCAL_USER) -> ProgramInfo:
        """Forget ``user``'s program named ``ref`` (its file goes when nobody else has it)."""
        mine = self._uploads.get(user.name, {})
        if ref in self._builtins:
            raise RegistryError(f"'{ref}' is a built-in program and cannot be deleted")
        info = mine.pop(ref, None)
        if info is None:
            raise RegistryError(f"you have no program named '{ref}'")
        if not mine:
            del self._uploads[user.name]
        self._store(None, None, dropped=info.hash)
        return info

    def _compile(self, name: str, text: str, trusted: bool, deferred: bool = False) -> Program:
        """Trusted programs run in the server; the others in the WebAssembly sandbox
        (``deferred``: a stored upload, compiled off the event loop at its first launch)."""
        self.compiles += 1
        if trusted:
            return Program.from_source(name, text)  # raises ProgramError
        try:
            from pastry.runtime.wasm import (
                SandboxError,
                deferred_sandboxed_program,
                sandboxed_program,
            )

            if deferred:
                return deferred_sandboxed_program(name, text)
            return sandboxed_program(name, text)
        except (ImportError, SandboxError, FileNotFoundError) as e:
            raise RegistryError(
                f"uploads run in the WebAssembly sandbox, which is not available ({e}); build "
                "it with `python -m pastry.runtime.build_pyrt`, or let the operator run "
                "their uploads trusted with `pastry serve --trusted-uploads`"
            ) from None

    def _store(self, digest: str | None, text: str | None, dropped: str | None = None) -> None:
        if digest is not None:
            path = self.root / f"{digest}.py"
            if not path.exists():
                durable.atomic_write(path, text)
        rows = [asdict(i) for names in self._uploads.values() for i in names.values()]
        durable.atomic_write(self._index_path, json.dumps(rows, indent=1), keep_previous=True)
        if dropped is not None and not any(r["hash"] == dropped for r in rows):
            (self.root / f"{dropped}.py").unlink(missing_ok=True)
            with self._lock:
                for trusted in (False, True):
                    self._compiled.pop((dropped, trusted), None)

    # ------------------------------------------------------------------ lookups

    def resolve(self, ref: str, user: str = LOCAL) -> ProgramInfo:
        """The program ``user`` means by ``ref``: a built-in's name, one of its own names, or
        a full hash or unique hash prefix (8+ characters) among the built-ins and its
        own uploads."""
        if ref in self._builtins:
            return self._builtins[ref]
        mine = self._uploads.get(user, {})
        if ref in mine:
            return mine[ref]
        if len(ref) >= 8:
            hits: dict[str, ProgramInfo] = {}
            for info in [*mine.values(), *self._builtins.values()]:  # built-ins win a hash
                if info.hash.startswith(ref):
                    hits[info.hash] = info
            if len(hits) == 1:
                return next(iter(hits.values()))
            if len(hits) > 1:
                raise RegistryError(f"hash prefix '{ref}' is ambiguous ({len(hits)} programs)")
        known = ", ".join(sorted([*self._builtins, *mine])) or "none"
        raise RegistryError(f"no program '{ref}' (upload it first; known: {known})")

    def get(self, ref: str, user: str = LOCAL) -> Program:
        """The program to launch for ``user``'s ``ref`` (compiled at most once)."""
        info = self.resolve(ref, user)
        trusted = info.builtin or (info.trusted and self.trusted_uploads)
        prog = self._compiled.get((info.hash, trusted))
        if prog is None:  # stored by an earlier server run: compiled once, at its launch
            text = (self.root / f"{info.hash}.py").read_text()
            program = self._compile(info.name, text, trusted, deferred=True)
            with self._lock:
                prog = self._compiled.setdefault((info.hash, trusted), program)
        return prog if prog.name == info.name else replace(prog, name=info.name)

    def builtin(self, name: str) -> Program:
        """The built-in ``name``, whatever anyone uploaded."""
        info = self._builtins.get(name)
        if info is None:
            raise RegistryError(f"no built-in program '{name}'")
        return self._compiled[(info.hash, True)]

    def info(self, ref: str, user: str = LOCAL) -> ProgramInfo:
        return self.resolve(ref, user)

    def list(self, user: str = LOCAL) -> list[ProgramInfo]:
        """The built-ins, then ``user``'s uploads, by name."""
        mine = self._uploads.get(user, {})
        return [*sorted(self._builtins.values(), key=lambda i: i.name),
                *sorted(mine.values(), key=lambda i: i.name)]  # fmt: skip

    def usage(self, user: str) -> tuple[int, int]:
        """``(programs, bytes)`` that ``user`` stores."""
        mine = self._uploads.get(user, {})
        return len(mine), sum({i.hash: i.size for i in mine.values()}.values())

    def close(self) -> None:
        self._compiler.shutdown(wait=False, cancel_futures=True)


__all__ = ["ProgramError", "ProgramInfo", "ProgramRegistry", "RegistryError", "UploadQuotaError"]
