"""Who is who: users, their tokens, and what they share (``docs/security.md``).

A server's tenants are *users*, named by the tokens they present:

- no token configured: every client (loopback only) is the one local user ``local``;
- ``--auth-token T``: one user, ``admin``, an operator;
- ``--users FILE``: one ``name:token`` line per user (``name:token:operator`` for an
  operator); both may be given.

Every program upload, instance, KV export, store key and topic belongs to a user; the
control layer keys its shared state by the user's name (:class:`Session.user
<pastry.control.session.Session>`). Users see nothing of each other's unless the owner
*grants* it (``--grant OWNER:READER``, ``READER`` may be ``*``): the reader may then read
the owner's exports, store keys and topics by naming them ``~OWNER/NAME``
(:func:`split_scoped`), never write them. Operators differ from other users only in that
their uploads may run trusted (``--trusted-uploads``).

:class:`Directory` (tokens to users) lives in the server; the control layer only sees user
names and :class:`Grants`.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

LOCAL = "local"  # the user of a server without tokens
ADMIN = "admin"  # the user of --auth-token
_NAME_RE = re.compile(r"[A-Za-z0-9_.-]{1,64}")
_TOKEN_RE = re.compile(r"[!-~]+")  # printable ASCII, no spaces (HTTP header safe)
SCOPE_PREFIX = "~"


class UsersError(ValueError):
    """A users file, token or grant that the server cannot start with."""


@dataclass(frozen=True)
class User:
    name: str
    operator: bool = False


LOCAL_USER = User(LOCAL, operator=True)


@dataclass(frozen=True)
class Account:
    """A user and the token that names it (configuration; the token is never printed)."""

    user: User
    token: str = field(repr=False)

    def __post_init__(self) -> None:
        check_name(self.user.name)
        check_token(self.token, f"the token of user '{self.user.name}'")


def check_name(name: str) -> str:
    if not isinstance(name, str) or not _NAME_RE.fullmatch(name):
        raise UsersError(
            f"user name {name!r} is not valid: use 1 to 64 letters, digits, '_', '.' or '-'"
        )
    return name


def check_token(token: str, what: str = "the token") -> str:
    """A token must be printable ASCII without spaces: it travels in an HTTP header, and a
    token no client can send would lock everyone out."""
    if not isinstance(token, str) or not token:
        raise UsersError(f"{what} is empty")
    if not _TOKEN_RE.fullmatch(token):
        raise UsersError(
            f"{what} has characters other than printable ASCII (or spaces): clients send "
            "tokens in an HTTP header, so use letters, digits and punctuation only "
            "(e.g. `python -c 'import secrets; print(secrets.token_urlsafe())'`)"
        )
    return token


def parse_users(text: str, source: str = "users file") -> tuple[Account, ...]:
    """Accounts from ``name:token`` / ``name:token:operator`` lines (``#`` comments and
    blank lines allowed). Names and tokens must be unique."""
    accounts: list[Account] = []
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        parts = line.split(":")
        where = f"{source} line {number}"
        if len(parts) not in (2, 3) or (len(parts) == 3 and parts[2] != "operator"):
            raise UsersError(f"{where}: expected NAME:TOKEN or NAME:TOKEN:operator")
        try:
            check_name(parts[0])
            accounts.append(Account(User(parts[0], len(parts) == 3), parts[1]))
        except UsersError as e:
            raise UsersError(f"{where}: {e}") from None
    return tuple(accounts)


def read_users_file(path: str | Path) -> tuple[Account, ...]:
    try:
        text = Path(path).read_text()
    except (OSError, UnicodeDecodeError) as e:
        raise UsersError(f"cannot read the users file {path}: {e}") from None
    accounts = parse_users(text, str(path))
    if not accounts:
        raise UsersError(f"the users file {path} names no user")
    return accounts


def parse_grant(spec: str) -> tuple[str, str]:
    """``OWNER:READER`` (READER ``*``: every user) from ``--grant``."""
    owner, sep, reader = spec.partition(":")
    if not sep:
        raise UsersError(f"a grant is OWNER:READER (READER may be '*'), got {spec!r}")
    check_name(owner)
    if reader != "*":
        check_name(reader)
    return owner, reader


def split_scoped(name: str, prefix: bool = False) -> tuple[str | None, str]:
    """``("alice", "x")`` for ``"~alice/x"`` (a name in alice's namespace), ``(None, name)``
    for any other name (the caller's own namespace). A ``prefix`` (of names to list) may
    end right after the slash."""
    if not name.startswith(SCOPE_PREFIX):
        return None, name
    owner, sep, rest = name[1:].partition("/")
    if not sep or not (rest or prefix) or not _NAME_RE.fullmatch(owner):
        return None, name
    return owner, rest


class Grants:
    """Read access across users: ``may_read(reader, owner)``. A user always reads its own."""

    def __init__(self, grants: Iterable[tuple[str, str]] = ()) -> None:
        self._readers: dict[str, set[str]] = {}
        for owner, reader in grants:
            self._readers.setdefault(owner, set()).add(reader)

    def may_read(self, reader: str, owner: str) -> bool:
        if reader == owner:
            return True
        readers = self._readers.get(owner, ())
        return reader in readers or "*" in readers

    def __repr__(self) -> str:
        pairs = sorted((o, r) for o, rs in self._readers.items() for r in rs)
        return f"Grants({', '.join(f'{o}:{r}' for o, r in pairs)})"


def _digest(token: str) -> bytes:
    return hashlib.sha256(token.encode("ascii")).digest()


class Directory:
    """Tokens to users. Without any account, every client is the local user (the server
    then listens on loopback only); with accounts, a client must present a token.

    Lookup is by the token's SHA-256, so the time it takes does not depend on how much of a
    wrong token matches a right one.
    """

    def __init__(
        self,
        accounts: Sequence[Account] = (),
        grants: Iterable[tuple[str, str]] = (),
    ) -> None:
        self._by_digest: dict[bytes, User] = {}
        self.users: dict[str, User] = {}
        for a in accounts:
            if a.user.name in self.users:
                raise UsersError(f"user '{a.user.name}' is defined twice")
            digest = _digest(a.token)
            if digest in self._by_digest:
                raise UsersError(
                    f"users '{self._by_digest[digest].name}' and '{a.user.name}' have the same "
                    "token: every user needs its own"
                )
            self._by_digest[digest] = a.user
            self.users[a.user.name] = a.user
        grants = tuple(grants)
        for owner, reader in grants:
            for name in (owner, reader):
                if name != "*" and self.users and name not in self.users:
                    raise UsersError(f"grant {owner}:{reader} names an unknown user '{name}'")
        self.grants = Grants(grants)

    @classmethod
    def build(
        cls,
        auth_token: str | None = None,
        accounts: Sequence[Account] = (),
        grants: Iterable[tuple[str, str]] = (),
    ) -> Directory:
        """The server's directory: ``--auth-token`` (user ``admin``) plus ``--users``."""
        all_accounts = list(accounts)
        if auth_token is not None:
            all_accounts.insert(0, Account(User(ADMIN, operator=True), auth_token))
        return cls(all_accounts, grants)

    @property
    def open(self) -> bool:
        """No tokens: every client is the local user."""
        return not self.users

    @property
    def single_user(self) -> bool:
        return len(self.users) <= 1

    def authenticate(self, token: object) -> User | None:
        """The user a token names, or None (a wrong, missing or non-ASCII token)."""
        if self.open:
            return LOCAL_USER
        if not isinstance(token, str) or not token or not token.isascii():
            return None
        return self._by_digest.get(_digest(token))
