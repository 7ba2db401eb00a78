"""The names of the pastry.lang library, for what is shipped to a server.

``pastry.lang`` registers its public namespace here when it is imported
(:func:`register`); :mod:`pastry.lang.ship` reads it to write a shipped program's imports
(the library's objects it uses become ``pastry.lang.NAME``).
"""

from __future__ import annotations

from typing import Any

NAMES: dict[str, Any] = {}


def register(namespace: dict[str, Any]) -> None:
    NAMES.update({k: v for k, v in namespace.items() if not k.startswith("_")})
