"""Images in chat requests: OpenAI's ``image_url`` content parts, checked into the images
the ``chat`` inferlet embeds.

A part is ``{"type": "image_url", "image_url": {"url": "data:image/png;base64,...",
"detail": "auto"}}`` (SGLang's ``image_data``: the same data URL, or the base64
alone; the Responses API's ``input_image`` and Anthropic's base64 ``image`` blocks: the
same bytes). Only inline images are taken: fetching ``http(s)`` URLs from the
server is off (it would let a request make the server reach any address; there is no
allowlist to turn it on yet), and the refusal says so. The bytes are decoded here, in the
request's worker thread, by :func:`pastry.wire.images.decode_image` under the image
quotas, so that an image that is not one, is truncated or is too large is a 400 naming its
part before anything runs; the engine decodes the same bytes again for its processor.
"""

from __future__ import annotations

import base64
import binascii
from typing import Any

from pastry.control.quotas import Quotas
from pastry.server.openai_options import OpenAIError
from pastry.wire.images import ImageError, decode_image, open_image

_DETAILS = ("auto", None)
# the image types Anthropic's Messages API takes (a base64 source's media_type)
ANTHROPIC_MEDIA = ("image/jpeg", "image/png", "image/gif", "image/webp")


def _takes_images(model, where: str) -> None:
    info = model.info
    if info.image_layout is None:
        raise OpenAIError(
            f"'{where}': the model '{info.model_name}' takes no images (serve a "
            "vision-language checkpoint)",
            where,
        )


def image_part(part: dict, where: str, model, quotas: Quotas) -> str:
    """The base64 text of the image in the ``image_url`` part ``part`` (at ``where``, for
    errors) for ``model`` (a served model: ``.info``), decoded and checked."""
    _takes_images(model, where)
    spec = part.get("image_url")
    extra = sorted(set(part) - {"type", "image_url"})
    if extra:
        raise OpenAIError(f"'{where}' has unknown field '{extra[0]}'", f"{where}.{extra[0]}")
    extra = sorted(set(spec) - {"url", "detail"}) if isinstance(spec, dict) else []
    if extra:
        raise OpenAIError(
            f"'{where}.image_url' has unknown field '{extra[0]}'", f"{where}.image_url.{extra[0]}"
        )
    if not isinstance(spec, dict) or not isinstance(spec.get("url"), str):
        raise OpenAIError(
            f'\'{where}.image_url\' must be {{"url": "data:image/...;base64,..."}}',
            f"{where}.image_url",
        )
    _check_detail(spec.get("detail"), f"{where}.image_url.detail")
    return _data_url(spec["url"], f"{where}.image_url.url", quotas)


def _check_detail(detail: object, where: str) -> None:
    if detail not in _DETAILS:
        raise OpenAIError(
            f"'{where}': this model sees every image at its one resolution; only 'auto' is "
            f"taken, got {detail!r:.40}",
            where,
        )


def _data_url(url: str, where: str, quotas: Quotas, bare: bool = False) -> str:
    """The checked base64 of the image in ``url``: a data URL (or, ``bare``, base64 text
    alone, as SGLang's ``image_data`` also takes it)."""
    head, comma, data = url.partition(",")
    if url.startswith(("http://", "https://")):
        raise OpenAIError(
            f"'{where}': this server does not fetch image URLs from this host (its operator "
            "allows hosts with --image-url-allow; none by default): send the image inline "
            "as a data: URL",
            where,
        )
    if bare and not url.startswith("data:"):
        data = url
    elif not (head.startswith("data:") and head.endswith(";base64") and comma):
        raise OpenAIError(
            f"'{where}' must be a data URL, 'data:image/<format>;base64,<data>', got {url[:40]!r}",
            where,
        )
    try:
        raw = base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError):
        raise OpenAIError(f"'{where}': the image's base64 is not valid", where) from None
    try:
        decode_image(raw, quotas.image_bytes, quotas.image_pixels)
    except ImageError as e:
        raise OpenAIError(f"'{where}': {e}", where) from None
    return data


def input_image(part: dict, where: str, model, quotas: Quotas) -> dict:
    """The Responses API's ``input_image`` part ``{"type": "input_image", "image_url":
    "data:...", "detail": "auto"}``, checked; the part as a response echoes it."""
    _takes_images(model, where)
    extra = sorted(k for k in part if k not in ("type", "image_url", "detail", "file_id"))
    if extra:
        raise OpenAIError(f"'{where}' has unknown field '{extra[0]}'", f"{where}.{extra[0]}")
    if part.get("file_id") is not None:
        raise OpenAIError(
            f"'{where}.file_id': this server has no Files API; send the image inline as a "
            "data: URL in 'image_url'",
            f"{where}.file_id",
        )
    url = part.get("image_url")
    if not isinstance(url, str):
        raise OpenAIError(
            f"'{where}.image_url' must be a data URL, 'data:image/<format>;base64,<data>'",
            f"{where}.image_url",
        )
    _check_detail(part.get("detail"), f"{where}.detail")
    _data_url(url, f"{where}.image_url", quotas)
    return {"type": "input_image", "image_url": url, "detail": "auto"}


def anthropic_image(block: dict, where: str, model, quotas: Quotas) -> dict:
    """Anthropic's image block ``{"type": "image", "source": {"type": "base64",
    "media_type": "image/png", "data": ...}}``, checked, as a chat ``image_url`` part."""
    _takes_images(model, where)
    source = block.get("source")
    if not isinstance(source, dict) or source.get("type") != "base64":
        kind = source.get("type") if isinstance(source, dict) else None
        raise OpenAIError(
            f"'{where}.source' has type {kind!r}: this server takes base64 image sources "
            "(it does not fetch URLs, and has no Files API)",
            f"{where}.source.type",
        )
    extra = sorted(k for k in source if k not in ("type", "media_type", "data"))
    if extra:
        raise OpenAIError(
            f"'{where}.source' has unknown field '{extra[0]}'", f"{where}.source.{extra[0]}"
        )
    media = source.get("media_type")
    if media not in ANTHROPIC_MEDIA:
        raise OpenAIError(
            f"'{where}.source.media_type' must be one of {', '.join(ANTHROPIC_MEDIA)}, "
            f"got {media!r:.40}",
            f"{where}.source.media_type",
        )
    data = source.get("data")
    if not isinstance(data, str) or not data:
        raise OpenAIError(f"'{where}.source.data' must be base64 text", f"{where}.source.data")
    _data_url(data, f"{where}.source.data", quotas, bare=True)
    return {"type": "image_url", "image_url": {"url": f"data:{media};base64,{data}"}}


def image_text(value: object, where: str, model, quotas: Quotas) -> str:
    """SGLang's ``image_data`` entry ``value`` (a data URL or bare base64; file paths and
    remote URLs are refused) for ``model``: the image's checked base64."""
    _takes_images(model, where)
    if not isinstance(value, str) or not value:
        raise OpenAIError(f"'{where}' must be an image as a data URL or base64 text", where)
    return _data_url(value, where, quotas, bare=True)


def content_parts(
    content: list, where: str, model, quotas: Quotas | None, images: list[str]
) -> Any:
    """A message's list ``content``: its text joined when it is all text; otherwise the
    parts as chat templates take them (``{"type": "text", "text"}``, ``{"type":
    "image"}``), each image's base64 appended to ``images``. ``quotas`` None: images are
    refused here (an endpoint without image input)."""
    out, texts_only = [], True
    for j, p in enumerate(content):
        at = f"{where}[{j}]"
        kind = p.get("type") if isinstance(p, dict) else None
        if kind == "text" and isinstance(p.get("text"), str):
            out.append({"type": "text", "text": p["text"]})
        elif kind == "image_url" and quotas is not None:
            images.append(image_part(p, at, model, quotas))
            out.append({"type": "image"})
            texts_only = False
        else:
            took = "text or image_url" if quotas is not None else "text"
            raise OpenAIError(f"'{at}' must be a {took} part, got {p!r:.100}", at)
    return "".join(p["text"] for p in out) if texts_only else out


def added_positions(model, images: list[str]) -> int:
    """How many positions ``images`` (checked base64, one placeholder token each in the
    prompt) add to a prompt on ``model``: each image's ``num_embs_needed`` less its
    placeholder. Only the images' headers are read."""
    layout = model.info.image_layout
    if layout is None or not images:
        return 0
    if layout.fixed:
        return len(images) * (layout.frame - 1)
    sizes = [open_image(base64.b64decode(b)).size for b in images]
    return sum(layout.positions(w, h) - 1 for w, h in sizes)
