"""Encoded images as calls carry them: the formats taken and the one decoder.

An image travels as its encoded bytes (PNG, JPEG, WebP or GIF's first frame), from the
inferlet to the control layer, which checks it here before queuing anything, and on to the
engine, which decodes it here again for its image processor. Pillow decodes; nothing else
parses image bytes. Importing this module does not import Pillow.
"""

from __future__ import annotations

import io
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from PIL.Image import Image

FORMATS = ("PNG", "JPEG", "WEBP", "GIF")


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
