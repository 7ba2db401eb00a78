"""Image URLs in requests, fetched by the server only from the hosts its operator allows.

``pastry serve --image-url-allow HOST ...`` (off by default: with no host, an ``http(s)``
image URL is refused naming its part, :mod:`pastry.server.chat_images`) lets requests name
images by URL: OpenAI chat ``image_url`` parts, Responses ``input_image`` parts and
Anthropic ``image`` blocks with a ``url`` source. Before the request is checked, each such
URL is fetched once, all of a request's at once, by
:class:`~pastry.control.http.HttpClient` under its policy (the allowlist's entry forms, no
redirect followed, a deadline; docs/security.md), the body capped at the image-bytes quota,
and the part is rewritten in place to carry the image inline (a data URL; a base64 source)
— so everything after (decoding under the quotas, the prefix cache's digest, a stored
conversation) is what an inline image gets. A URL it cannot fetch is a 400 naming the part.
"""

from __future__ import annotations

import asyncio
import base64
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from pastry.control.http import HttpClient, HttpDenied, HttpError, HttpTimeout, HttpTooLarge
from pastry.server.openai_options import OpenAIError

_MEDIA = {"PNG": "image/png", "JPEG": "image/jpeg", "WEBP": "image/webp", "GIF": "image/gif"}
TIMEOUT_S = 10.0

Site = tuple[str, str, Callable[[bytes, str], None]]  # (where, url, set the fetched image)


class ImageFetcher:
    """Fetches the image URLs of requests from the hosts in ``allow`` (none: nothing)."""

    def __init__(self, allow: Sequence[str], max_bytes: int, timeout: float = TIMEOUT_S) -> None:
        self.allow = tuple(allow)
        self.client = None
        if self.allow:
            self.client = HttpClient(self.allow, timeout=timeout, max_response_bytes=max_bytes)
        self.max_bytes = max_bytes

    async def inline(self, body: Any, kind: str) -> None:
        """Rewrite ``body`` (a ``kind`` request: ``chat``, ``responses`` or ``messages``)
        in place, each ``http(s)`` image URL replaced by the image; ``OpenAIError`` naming
        the part of the first URL that cannot be fetched."""
        if self.client is None or not isinstance(body, dict):
            return
        sites = list(_SITES[kind](body))
        if sites:
            await asyncio.gather(*(self._fetch(*site) for site in sites))

    async def _fetch(self, where: str, url: str, put: Callable[[bytes, str], None]) -> None:
        try:
            r = await self.client.get(url, headers={"accept": "image/*"})
        except HttpDenied:
            raise OpenAIError(
                f"'{where}': the host is not one this server fetches images from "
                f"(--image-url-allow: {', '.join(self.allow)})",
                where,
            ) from None
        except HttpTooLarge:
            raise OpenAIError(f"'{where}': the image is over {self.max_bytes} bytes", where) from None  # fmt: skip
        except HttpTimeout:
            raise OpenAIError(f"'{where}': fetching the image timed out", where) from None
        except (HttpError, ValueError, OSError) as e:
            raise OpenAIError(f"'{where}': the image cannot be fetched: {e}", where) from None
        if r.status != 200:
            raise OpenAIError(
                f"'{where}': the image URL answered {r.status} {r.reason} (redirects are "
                "not followed)",
                where,
            )
        put(r.body, _media_type(r.body, r.headers.get("content-type", "")))


def _media_type(data: bytes, given: str) -> str:
    """The image's type, as its bytes say (Pillow reads the header), else as it was sent."""
    try:
        from pastry.wire.images import open_image

        return _MEDIA.get(open_image(data).format, "image/png")
    except Exception:  # not an image: the request's check says so, naming the part
        return given.split(";")[0].strip() or "application/octet-stream"


def _remote(url: Any) -> bool:
    return isinstance(url, str) and url.startswith(("http://", "https://"))


def _data_url(data: bytes, media: str) -> str:
    return f"data:{media};base64,{base64.b64encode(data).decode()}"


def _parts(body: dict, field: str) -> Iterator[tuple[str, dict]]:
    """``(where, part)`` of each content part of ``body[field]``'s items."""
    items = body.get(field)
    for i, item in enumerate(items if isinstance(items, list) else []):
        content = item.get("content") if isinstance(item, dict) else None
        for j, part in enumerate(content if isinstance(content, list) else []):
            if isinstance(part, dict):
                yield f"{field}[{i}].content[{j}]", part


def _chat(body: dict) -> Iterator[Site]:
    for where, p in _parts(body, "messages"):
        spec = p.get("image_url")
        if p.get("type") == "image_url" and isinstance(spec, dict) and _remote(spec.get("url")):
            yield f"{where}.image_url.url", spec["url"], lambda d, m, s=spec: s.update(url=_data_url(d, m))  # fmt: skip


def _responses(body: dict) -> Iterator[Site]:
    for where, p in _parts(body, "input"):
        if p.get("type") == "input_image" and _remote(p.get("image_url")):
            yield f"{where}.image_url", p["image_url"], lambda d, m, p=p: p.update(image_url=_data_url(d, m))  # fmt: skip


def _messages(body: dict) -> Iterator[Site]:
    for where, p in _parts(body, "messages"):
        src = p.get("source")
        if p.get("type") == "image" and isinstance(src, dict) and src.get("type") == "url" and _remote(src.get("url")):  # fmt: skip

            def put(d: bytes, m: str, p=p) -> None:
                p["source"] = {"type": "base64", "media_type": m, "data": base64.b64encode(d).decode()}  # fmt: skip

            yield f"{where}.source.url", src["url"], put


def _generate(body: dict) -> Iterator[Site]:
    """SGLang's ``image_data``: a URL, a list of them, or per prompt of a batch either."""
    given = body.get("image_data")
    if _remote(given):
        yield "image_data", given, lambda d, m: body.update(image_data=_data_url(d, m))
        return
    for i, row in enumerate(given if isinstance(given, list) else []):
        if _remote(row):
            yield f"image_data[{i}]", row, lambda d, m, i=i: given.__setitem__(i, _data_url(d, m))  # fmt: skip
        for j, v in enumerate(row if isinstance(row, list) else []):
            if _remote(v):
                yield f"image_data[{i}][{j}]", v, lambda d, m, r=row, j=j: r.__setitem__(j, _data_url(d, m))  # fmt: skip


_SITES: dict[str, Callable[[dict], Iterator[Site]]] = {
    "chat": _chat,
    "responses": _responses,
    "messages": _messages,
    "generate": _generate,
}
