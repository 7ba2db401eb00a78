"""Encoded images as calls carry them: the formats taken and the one decoder.

An image travels as its encoded bytes (PNG, JPEG, WebP or GIF's first frame), from the
inferlet to the control layer, which checks it here before queuing anything, and on to the
engine, which decodes it here again for its image processor. Pillow decodes; nothing else
parses image bytes. Importing this module does not import Pillow.
"""

from __future__ import annotations

import hashlib
import io
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from PIL.Image import Image

FORMATS = ("PNG", "JPEG", "WEBP", "GIF")
# The prefix cache's keys for an image's positions (image_keys): ids from 2**32 on, where
# no token id is, so that an image matches the same image and nothing else.
KEY_BASE = 1 << 32
MAX_KEYED = 1 << 14  # embeddings per image that keys tell apart


class ImageError(ValueError):
    """Bytes that are not an image Pastry takes, or one over a limit; the text says which."""


def open_image(data: bytes, max_bytes: int | None = None, max_pixels: int | None = None) -> Image:
    """The image encoded in ``data``, header read and checked (format, size) but pixels not
    yet decoded: ``.size`` is free, :func:`decode_image` does the rest."""
    try:
        from PIL import Image as PILImage
    except ImportError:
        raise ImageError("image input needs Pillow: pip install 'pastry[vision]'") from None
    if not isinstance(data, bytes | bytearray | memoryview):
        raise ImageError(f"an image is its encoded bytes, got {type(data).__name__}")
    if max_bytes is not None and len(data) > max_bytes:
        raise ImageError(f"the image is {len(data)} bytes, over the limit of {max_bytes}")
    if not len(data):
        raise ImageError("the image is empty (0 bytes)")
    try:
        im = PILImage.open(io.BytesIO(bytes(data)), formats=FORMATS)
    except PILImage.UnidentifiedImageError:
        raise ImageError(
            f"not an image in a format Pastry takes ({', '.join(FORMATS)}); it starts "
            f"{bytes(data[:8])!r}"
        ) from None
    except (OSError, ValueError, PILImage.DecompressionBombError) as e:
        raise ImageError(f"the image cannot be read: {e}") from None
    w, h = im.size
    if w < 1 or h < 1:
        raise ImageError(f"the image is {w}x{h} pixels")
    if max_pixels is not None and w * h > max_pixels:
        raise ImageError(f"the image is {w}x{h} = {w * h} pixels, over the limit of {max_pixels}")
    return im


def decode_image(data: bytes, max_bytes: int | None = None, max_pixels: int | None = None) -> Image:
    """The pixels of the image in ``data`` (:func:`open_image`'s checks), as RGB."""
    im = open_image(data, max_bytes, max_pixels)
    try:
        im.load()
        return im.convert("RGB")
    except (OSError, ValueError, SyntaxError) as e:  # truncated or corrupt data
        raise ImageError(f"the image cannot be decoded: {e}") from None


def image_digest(data: bytes) -> bytes:
    """The SHA-256 of an image's encoded bytes: what names it in the prefix cache."""
    return hashlib.sha256(bytes(data)).digest()


def image_keys(digest: bytes, n: int) -> list[int]:
    """The prefix cache's keys of the ``n`` positions of the image with SHA-256 ``digest``
    (:func:`image_digest`): 48 bits of the digest and the position's index in the image,
    above :data:`KEY_BASE` (every key fits a signed 64-bit integer, as page records keep
    them). Two images share keys only if their digests share 48 bits."""
    if len(digest) != 32:
        raise ValueError(f"an image digest is 32 bytes (SHA-256), got {len(digest)}")
    if not 0 < n <= MAX_KEYED:
        raise ValueError(f"an image of {n} embeddings cannot be keyed (1 to {MAX_KEYED})")
    base = KEY_BASE + (int.from_bytes(digest[:6], "little") << 14)
    return list(range(base, base + n))


# ---------------------------------------------------------------------------- layout

# Idefics3's processor: no image side over this after its first resize.
_MAX_SIDE = 4096
_MAX_GRID = 6  # the row/column tags a tiling checkpoint has (<row_6_col_6> at most)


@dataclass(frozen=True)
class ImageLayout:
    """How an image becomes positions of a context on one model: the model's contract that
    ``num_embs_needed`` reports, the server counts prompts by and the engine fills.

    Every position of an image holds ``token`` in a context (the image is one opaque span
    there: the prefix cache keys all of it by the image's digest). What the engine writes
    at those positions is the image's *span* (:meth:`span`): the tower's embeddings where
    it has ``token``, and the embedding of the text token it has elsewhere. A LLaVA image
    is ``frame`` embeddings, whatever its size. An Idefics3 / SmolVLM image (``tile`` > 0)
    is resized so that its longest side is ``longest_edge``, cut into a grid of ``tile``
    squares (each ``frame`` embeddings, after a ``<fake_token_around_image>`` and its
    ``<row_r_col_c>`` tag; a newline ends each row) and followed by the whole image at one
    tile's size (``<fake_token_around_image><global-img>``, ``frame`` embeddings,
    ``<fake_token_around_image>``): ``Idefics3Processor``'s expansion of one ``<image>``,
    token for token."""

    token: int  # the placeholder: a chat template writes one per image
    frame: int  # embeddings per frame (a tile, or the whole image)
    tile: int = 0  # a tile's side in pixels; 0: one frame per image, no text in the span
    longest_edge: int = 0  # the longest side an image is resized to before tiling (0: kept)
    split: bool = False  # whether images are cut into tiles (else: the whole image alone)
    wrap: int = -1  # <fake_token_around_image>
    whole: int = -1  # <global-img>
    cells: tuple[int, ...] = ()  # <row_r_col_c>, row-major, _MAX_GRID x _MAX_GRID
    row_end: tuple[int, ...] = ()  # the tokens of "\n"
    grid_end: tuple[int, ...] = ()  # the tokens of "\n\n"

    @property
    def fixed(self) -> bool:
        """Whether every image takes the same positions (``frame``)."""
        return not self.tile

    def grid(self, width: int, height: int) -> tuple[int, int]:
        """The tiles ``(rows, cols)`` of a ``width`` x ``height`` image (``(0, 0)``: the
        whole image alone), as the checkpoint's image processor cuts it."""
        if not self.tile or not self.split:
            return 0, 0
        if self.longest_edge:  # the longest side to longest_edge, the other even
            if width >= height:
                height, width = int(self.longest_edge / (width / height)), self.longest_edge
                height += height % 2
            else:
                width, height = int(self.longest_edge * (width / height)), self.longest_edge
                width += width % 2
            height, width = max(height, 1), max(width, 1)
        if max(width, height) > _MAX_SIDE:  # then below the processor's bound
            if width >= height:
                height, width = max(int(_MAX_SIDE / (width / height)), 1), _MAX_SIDE
            else:
                width, height = max(int(_MAX_SIDE * (width / height)), 1), _MAX_SIDE
        t, aspect = self.tile, width / height  # then both sides up to whole tiles
        if width >= height:
            width = -(-width // t) * t
            height = -(-int(width / aspect) // t) * t
        else:
            height = -(-height // t) * t
            width = -(-int(height * aspect) // t) * t
        if height <= t and width <= t:
            return 0, 0
        return height // t, width // t

    def span(self, rows: int, cols: int) -> list[int]:
        """The tokens of an image cut into ``rows`` x ``cols`` tiles (:meth:`grid`):
        ``token`` where an embedding of the tower goes, the text tokens around them."""
        if not self.tile:
            return [self.token] * self.frame
        if not 0 <= rows <= _MAX_GRID or not 0 <= cols <= _MAX_GRID or (rows == 0) != (cols == 0):
            raise ValueError(f"an image of {rows} x {cols} tiles has no tags on this model")
        out: list[int] = []
        for r in range(rows):
            for c in range(cols):
                out += [self.wrap, self.cells[r * _MAX_GRID + c], *[self.token] * self.frame]
            out += self.row_end if r < rows - 1 else self.grid_end
        return [*out, self.wrap, self.whole, *([self.token] * self.frame), self.wrap]

    def positions(self, width: int, height: int) -> int:
        """The positions a ``width`` x ``height`` image takes (``num_embs_needed``)."""
        if not self.tile:
            return self.frame
        return len(self.span(*self.grid(width, height)))
