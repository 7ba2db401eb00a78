"""Reading a GGUF file (llama.cpp's single-file format) through the ``gguf`` package.

:func:`is_gguf` and :func:`check_magic` look at the first bytes; :func:`read_gguf` parses the
file (memory-mapped) and checks that every tensor is all there, so that a truncated
download fails naming the file and the tensor; :class:`Metadata` reads its key-value
fields with errors that name the file and the key. What the fields and tensors mean is
read by :mod:`~pastry.engine.gguf_config`, :mod:`~pastry.engine.gguf_tokenizer` and
:mod:`~pastry.engine.gguf_weights`. The ``gguf`` package is imported only when a file is parsed.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from pastry.wire.config import CheckpointError

if TYPE_CHECKING:
    import gguf

MAGIC = b"GGUF"


def is_gguf(path: str | Path) -> bool:
    """Whether ``path`` is a file that starts with the GGUF magic."""
    try:
        with open(path, "rb") as f:
            return f.read(4) == MAGIC
    except OSError:
        return False


class Metadata:
    """The key-value metadata of a GGUF file, with errors that name the file and the key."""

    def __init__(self, reader: gguf.GGUFReader, path: Path) -> None:
        self.fields = reader.fields
        self.path = path

    def get(self, key: str, default: Any = None) -> Any:
        field = self.fields.get(key)
        return default if field is None else field.contents()

    def need(self, key: str, why: str = "") -> Any:
        if key not in self.fields:
            raise CheckpointError(
                f"{self.path}: metadata field '{key}' is missing" + (f" ({why})" if why else "")
            )
        return self.get(key)

    def integer(self, key: str, default: int | None = None) -> int:
        value = self.need(key) if default is None else self.get(key, default)
        if isinstance(value, bool) or not isinstance(value, int | np.integer):
            raise CheckpointError(
                f"{self.path}: metadata field '{key}' is {value!r:.60}, expected an integer"
                + (" (per-layer values are not supported)" if isinstance(value, list) else "")
            )
        return int(value)

    def number(self, key: str, default: float) -> float:
        value = self.get(key, default)
        if isinstance(value, bool) or not isinstance(value, int | float | np.number):
            raise CheckpointError(f"{self.path}: metadata field '{key}' is {value!r:.60}, "
                                  "expected a number")  # fmt: skip
        return float(value)


def read_gguf(path: Path) -> gguf.GGUFReader:
    """The parsed file; :class:`CheckpointError` for a file that is not (all) there."""
    check_magic(path)
    size = path.stat().st_size
    try:
        import gguf

        reader = gguf.GGUFReader(path, "r")
    except (ValueError, IndexError, KeyError, OSError, UnicodeDecodeError) as e:
        raise CheckpointError(
            f"{path}: truncated or corrupt GGUF file ({size:,} bytes; the reader failed with "
            f"{type(e).__name__}: {e}); an interrupted download is the usual cause: download "
            "it again"
        ) from e
    for t in reader.tensors:  # the reader maps the file; a short tensor means a short file
        if t.data.nbytes != t.n_bytes or t.data_offset + t.n_bytes > size:
            raise CheckpointError(
                f"{path}: truncated: tensor '{t.name}' needs bytes {t.data_offset:,} to "
                f"{t.data_offset + t.n_bytes:,} but the file has {size:,}; download it again"
            )
    return reader


def check_magic(path: Path) -> None:
    """:class:`CheckpointError` unless ``path`` starts with the GGUF magic."""
    if not is_gguf(path):
        with open(path, "rb") as f:
            head = f.read(4)
        raise CheckpointError(f"{path}: not a GGUF file (it starts with {head!r}, not {MAGIC!r})")
