"""Requests that allocate: KV pages, embedding slots, exports between inferlets."""

from __future__ import annotations

from collections.abc import Sequence

from pastry.api.table import request
from pastry.api.types import Count, Handle


@request("allocate", trait="allocate", now=Count)
class GetKvPageSize:
    """Token slots per KV page on the queue's model."""

    q: Handle


@request("allocate", trait="allocate", now=list[Handle])
class AllocKvpages:
    """``n`` new KV page handles (immediate). Every slot is not attendable until this
    inferlet writes it: a page may hold another inferlet's stale K/V."""

    q: Handle
    n: Count


@request("allocate", trait="allocate", queued=("none",))
class DeallocKvpages:
    """Queued: free pages once the calls queued before have run."""

    q: Handle
    pages: Sequence[Handle]


@request("allocate", trait="allocate", now=list[Handle])
class AllocEmbeds:
    """``n`` new embedding slot handles (immediate)."""

    q: Handle
    n: Count


@request("allocate", trait="allocate", queued=("none",))
class DeallocEmbeds:
    """Queued: free embedding slots once the calls queued before have run."""

    q: Handle
    embeds: Sequence[Handle]


@request("allocate", trait="allocate", queued=("none",))
class CopyKvpage:
    """Queued: copy ``size`` tokens of K/V (token level) from ``src`` to ``dst``."""

    q: Handle
    src: Handle
    dst: Handle
    src_offset: Count
    dst_offset: Count
    size: Count


@request("allocate", trait="allocate", queued=("none",))
class ExportKvpages:
    """Queued: publish pages under ``name`` (shared by reference count) in this user's
    namespace; a persistent export outlives this inferlet until unexported (or reclaimed
    when memory is short). ``~OWNER/NAME`` names another user's export, which
    ``import_kvpages`` may read where the owner granted it (``docs/security.md``)."""

    q: Handle
    pages: Sequence[Handle]
    name: str
    persistent: bool = False


@request("allocate", trait="allocate", now=list[Handle])
class ImportKvpages:
    """New handles to the pages exported as ``name``."""

    q: Handle
    name: str


@request("allocate", trait="allocate")
class UnexportKvpages:
    """Drop the export ``name`` (handles imported from it stay valid)."""

    q: Handle
    name: str


@request("allocate", trait="allocate", now=list[tuple[str, Count]])
class ListExportedKvpages:
    """(name, number of pages) of every export of this user."""

    q: Handle
