"""Encoded images as calls carry them: the formats taken and the one decoder.

An image travels as its encoded bytes (PNG, JPEG, WebP or GIF's first frame), from the
inferlet to the control layer, which checks it here before queuing anything, and on to the
engine, which decodes it here again for its image processor. Pillow decodes; nothing else
parses image bytes. Importing this module does not import Pillow.
"""

from __future__ import annotations

import hashlib
import io
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
