"""Files the server writes that must survive it being killed: written whole or not at all.

:func:`atomic_write` writes a temporary file next to the target, flushes it to the disk
(``fsync``), renames it over the target and flushes the directory: after a ``SIGKILL`` (or
a power cut) at any point, the target holds either its old or its new contents, never a
mix. :func:`leftovers` finds (and removes) the temporary files a killed writer left.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

TEMP_PREFIX = ".tmp-"


def atomic_write(path: Path, data: str | bytes, keep_previous: bool = False) -> None:
    """Replace ``path`` with ``data`` atomically and durably. ``keep_previous``: the old
    contents stay readable as ``<path>.prev`` (a second copy to fall back on)."""
    path = Path(path)
    raw = data.encode("utf-8", "surrogatepass") if isinstance(data, str) else data
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f"{TEMP_PREFIX}{path.name}-")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(raw)
            f.flush()
            os.fsync(f.fileno())
        if keep_previous and path.exists():
            prev = path.with_name(path.name + ".prev")
            link = f"{tmp}.prev"
            os.link(path, link)  # the old contents under a second name, then renamed: the
            os.replace(link, prev)  # target itself is never missing
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


def fsync_dir(directory: Path) -> None:
    """Make the directory's entries (a rename, a new file) durable."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def leftovers(directory: Path, remove: bool = True) -> list[str]:
    """Names of temporary files an interrupted :func:`atomic_write` left in ``directory``
    (removed, unless ``remove`` is false)."""
    found = sorted(p.name for p in Path(directory).glob(f"{TEMP_PREFIX}*"))
    if remove:
        for name in found:
            (Path(directory) / name).unlink(missing_ok=True)
    return found
