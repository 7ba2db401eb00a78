"""The image side of a :class:`~pastry.sdk.Context`: where its filled images sit among its
tokens, and the embed calls that write a run of tokens and images.

A context keeps the images it has filled but not yet forwarded as ``position -> (encoded
bytes, embeddings)``: the image's placeholder tokens fill positions ``position ..
position + embeddings - 1``; and every image it holds as ``(position, embeddings,
SHA-256)``, what a prefill names them by (the prefix cache matches an image by its digest).
"""

from __future__ import annotations

from collections.abc import Sequence

from pastry.api import ApiError, InferletApi

Images = dict[int, tuple[bytes, int]]


def placeholders(
    a: InferletApi, queue: int, tokens: Sequence[int], images: Sequence[bytes]
) -> list[int]:
    """The positions in ``tokens`` of the model's image placeholder token, one per image of
    ``images``; ``ValueError`` unless there is exactly one per image."""
    mark = a.get_image_token(queue)
    at = [i for i, t in enumerate(tokens) if t == mark]
    if len(at) != len(images):
        raise ValueError(
            f"the prompt has {len(at)} image placeholders (token {mark}) for {len(images)} images"
        )
    return at


def in_image(images: Images, position: int) -> bool:
    """Whether ``position`` is one of a pending image's."""
    return any(at <= position < at + n for at, (_, n) in images.items())


def embed_calls(
    a: InferletApi, queue: int, images: Images, tokens: Sequence[int], start: int, ins: list
) -> list:
    """The calls that embed ``tokens`` at positions ``start..`` into the slots ``ins``:
    ``embed_txt`` for each run of text, ``embed_img`` for each image of ``images`` there
    (taken out of ``images``: it is embedded once)."""
    futs, i, n = [], 0, len(tokens)

    def text(j: int) -> None:
        if j > i:
            futs.append(a.embed_txt(queue, list(tokens[i:j]), list(range(start + i, start + j)), ins[i:j]))  # fmt: skip

    for at in sorted(p for p in images if start <= p < start + n):
        image, size = images.pop(at)
        text(at - start)
        futs.append(a.embed_img(queue, image, at, ins[at - start : at - start + size]))
        i = at - start + size
    text(n)
    return futs


def prefill_images(
    spans: list[tuple[int, int, bytes]], images: Images, start: int, end: int
) -> tuple[list[int], list[bytes], list[bytes], list[int]]:
    """A prefill's image arguments for positions ``start..end`` of a context
    (:class:`pastry.api.Prefill`): where each image of ``..end`` starts, each one's
    digest, the bytes of those from ``start`` on (taken out of ``images``: the prefill
    embeds them, or finds them cached) and the positions each one takes."""
    if not spans:
        return [], [], [], []
    mine = [span for span in spans if span[0] < end]
    data = [images.pop(at)[0] for at, _, _ in mine if at >= start]
    return [at for at, _, _ in mine], [d for _, _, d in mine], data, [n for _, n, _ in mine]


def cut_images(
    spans: list[tuple[int, int, bytes]], images: Images, length: int
) -> list[tuple[int, int, bytes]]:
    """The images of a context cut at ``length`` (``images`` loses those after it too);
    ``ApiError`` for a cut through one."""
    for at, n, _ in spans:
        if at < length < at + n:
            raise ApiError(f"cannot cut the context at {length}: inside an image ({at}..{at + n - 1})")  # fmt: skip
    for at in [at for at in images if at >= length]:
        del images[at]
    return [span for span in spans if span[0] < length]
