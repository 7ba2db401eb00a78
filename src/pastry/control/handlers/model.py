"""Handlers of the requests that run the model: forward, embed, prefill, the next token.

Each checks its request once — counts, lengths, the mask's shape, token ids against the
vocabulary, the sampling record (:func:`pastry.control.sampling.sample_spec`) — snapshots
the handle lists (the caller may change its lists after the call) and queues the op that
the scheduler translates per batch. The decode step (``step``) and ``embed_txt`` queue
the batch-prepared ops of :mod:`pastry.control.steps`.
"""

from __future__ import annotations

import asyncio
from functools import partial

import numpy as np

from pastry import api
from pastry.api import MAX_LOGPROBS, ApiError
from pastry.control.commands import Stage
from pastry.control.handlers.caller import Caller, resource_call
from pastry.control.handlers.memory import alloc_kvpages
from pastry.control.handlers.registry import handles
from pastry.control.loops import GenerateLoop
from pastry.control.ops import (
    ForwardOp,
    ImageOp,
    MaskPage,
    NextDistOp,
    SampledOp,
    SampleOp,
    ScoringForward,
)
from pastry.control.sampling import Release, sample_spec
from pastry.control.steps import Embed, SampledStep, Step
from pastry.wire.calls import ids
from pastry.wire.images import ImageError, ImageLayout, image_digest, image_keys, open_image
from pastry.wire.kv_layout import KvNames, kv_write_error

_I64 = 1 << 63
_NO_TARGETS = ids(())
_NO_TARGETS.flags.writeable = False
_API_NAMES = KvNames("in_kv", "in_kv_last_len", "out_kv", "out_kv_offset")


def ints(values: object, what: str) -> list[int]:
    """``values`` as a new list of Python ints that fit an int64: the step and embed ops
    keep them as a list until their batch makes one array of every command's integers."""
    if type(values) is list or type(values) is tuple:
        for v in values:
            if type(v) is not int or not -_I64 <= v < _I64:
                break
        else:
            return list(values)
    try:
        return ids(values).tolist()
    except (TypeError, ValueError, OverflowError):
        raise ApiError(f"{what} must be a list of integers, got {values!r:.60}") from None


def token_ids(values: object, what: str, lo: int, hi: int) -> np.ndarray:
    try:
        arr = ids(values)
    except (TypeError, ValueError, OverflowError):
        raise ApiError(f"{what} must be a list of token ids") from None
    bad = arr[(arr < lo) | (arr >= hi)]
    if bad.size:
        raise ApiError(f"{what} has token id {int(bad[0])}, outside the vocabulary (0 to {hi - 1})")
    return arr


def check_kv(
    info, in_kv: list, last: object, out_kv: list, offset: object, n: int, overlap: bool = True
) -> None:
    """The context and output pages of ``n`` new tokens, by the rule the engine checks
    too (:mod:`pastry.wire.kv_layout`), so that the error names the request's fields, not
    a refused engine call. ``overlap``: also that the output pages do not overwrite the
    context (a pass over the context: the decode step leaves it to the engine)."""
    if n > info.max_batch_tokens:
        raise ApiError(
            f"{n} inputs exceed the engine's max_batch_tokens ({info.max_batch_tokens}): "
            "split the forward"
        )
    error = kv_write_error(
        info.page_size, in_kv, last, out_kv, offset, n, names=_API_NAMES, overlap=overlap
    )
    if error is not None:
        raise ApiError(error)


def check_tokens(info, tokens: list[int], positions: list[int]) -> None:
    """Token ids in the vocabulary, positions below the model's ``max_position``."""
    if (  # a decode step's one token, without min/max
        len(tokens) == len(positions) == 1
        and 0 <= tokens[0] < info.vocab_size
        and 0 <= positions[0] < info.max_position
    ):
        return
    if tokens and not (min(tokens) >= 0 and max(tokens) < info.vocab_size):
        bad = next(t for t in tokens if not 0 <= t < info.vocab_size)
        raise ApiError(f"token id {bad} is outside the vocabulary (0 to {info.vocab_size - 1})")
    if positions and not (min(positions) >= 0 and max(positions) < info.max_position):
        bad = next(t for t in positions if not 0 <= t < info.max_position)
        raise ApiError(f"position {bad} is outside the model's 0 to {info.max_position - 1}")


def _count(value: object, what: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ApiError(f"{what} must be a non-negative integer, got {value!r}")
    return value


# ---------------------------------------------------------------------------- forward


@handles(api.Forward)
def forward(s: Caller, r: api.Forward) -> asyncio.Future:
    """The model over ``in_embeds`` on top of the context in ``in_kv`` (see
    :class:`pastry.api.Forward`)."""
    ref = s.queue(r.q)
    model = ref.model
    in_kv, in_embeds = list(r.in_kv), list(r.in_embeds)
    out_kv, out_embeds = list(r.out_kv), list(r.out_embeds)
    n, m = len(in_embeds), len(out_embeds)
    if n == 0:
        raise ApiError("forward needs at least one input embedding")
    if m > n:
        raise ApiError(f"{m} output embeddings for {n} inputs")
    last = r.in_kv_last_len if in_kv else 0
    check_kv(model.info, in_kv, last, out_kv, r.out_kv_offset, n)
    mask = None
    if r.mask is not None:
        mask = np.asarray(r.mask, dtype=np.bool_)
        ctx = (len(in_kv) - 1) * model.info.page_size + last if in_kv else 0
        if mask.shape != (n, ctx + n):
            raise ApiError(
                f"mask must have one row per input over context + inputs ({n}, {ctx + n}), "
                f"got shape {mask.shape}"
            )
        if not mask.any(axis=1).all():
            raise ApiError("every input must attend to at least one token (a mask row is empty)")
    adapter = -1
    if r.adapter is not None:
        if r.adapter not in model.adapters:
            names = ", ".join(model.adapters) or "none"
            raise ApiError(f"no adapter named '{r.adapter}' on {model.name} (loaded: {names})")
        adapter = model.adapters[r.adapter]
    targets, top = _NO_TARGETS, 0
    if r.logprob_targets is not None:
        targets = token_ids(r.logprob_targets, "logprob_targets", -1, model.info.vocab_size)
        if len(targets) != n:
            raise ApiError(f"logprob_targets needs one token per input ({n}), got {len(targets)}")
        top = r.logprob_top
        if not isinstance(top, int) or isinstance(top, bool) or not 0 <= top <= MAX_LOGPROBS:
            raise ApiError(f"logprob_top must be an integer from 0 to {MAX_LOGPROBS}, got {top!r}")
    elif r.logprob_top:
        raise ApiError("logprob_top needs logprob_targets")
    cls = ScoringForward if len(targets) else ForwardOp
    op = cls(
        model.resources, s.instance, in_kv, int(last), in_embeds, out_kv, int(r.out_kv_offset),
        out_embeds, mask, adapter, targets, top,
    )  # fmt: skip
    return s.submit(ref, Stage.FORWARD, op, tokens=n)


@handles(api.GetAdapters)
def get_adapters(s: Caller, r: api.GetAdapters) -> list[str]:
    return list(s.queue(r.q).model.adapters)


@handles(api.MaskKvpage)
def mask_kvpage(s: Caller, r: api.MaskKvpage) -> asyncio.Future:
    """``mask[i]`` True makes token ``i`` of ``page`` not attendable."""
    ref = s.queue(r.q)
    op = MaskPage(ref.model.resources, s.instance, r.page, np.asarray(r.mask, dtype=np.bool_))
    return s.submit(ref, Stage.KV, op)


# ---------------------------------------------------------------------------- input text


@handles(api.EmbedTxt)
def embed_txt(s: Caller, r: api.EmbedTxt) -> asyncio.Future:
    ref = s.queue(r.q)
    if not len(r.tokens) == len(r.positions) == len(r.embeds):
        raise ApiError(
            f"embed_txt needs as many positions and embeddings as tokens ({len(r.tokens)} "
            f"tokens, {len(r.positions)} positions, {len(r.embeds)} embeds)"
        )
    tokens, positions = ints(r.tokens, "tokens"), ints(r.positions, "positions")
    check_tokens(ref.model.info, tokens, positions)
    op = Embed(ref.model.resources, s.instance, tokens, positions, list(r.embeds))
    return s.submit(ref, Stage.EMBED, op)


@handles(api.Prefill)
def prefill(s: Caller, r: api.Prefill) -> tuple[list[int], asyncio.Future]:
    """The K/V of ``tokens`` (positions ``0..``) through the prefix cache; see
    :class:`pastry.api.Prefill` and :mod:`pastry.control.prefill`."""
    ref = s.queue(r.q)
    kv_len, reserve = _count(r.kv_len, "kv_len"), _count(r.reserve, "reserve")
    submit = ref.model.prefiller.submit
    tokens, images = r.tokens, ()
    if len(r.image_at) or len(r.image_digests) or len(r.images) or len(r.image_lens):
        tokens, images = _prefill_images(s, ref, r, kv_len)
    try:
        return resource_call(
            submit, s.instance, ref.queue, tokens, kv_len, r.pages, r.out_embeds, reserve, images
        )
    except ApiError:
        raise
    except ValueError as e:
        raise ApiError(str(e)) from None


def _prefill_images(s: Caller, ref, r: api.Prefill, kv_len: int) -> tuple[list[int], list]:
    """The prefix cache's keys of a prefill's tokens (each image's positions keyed by its
    digest, :func:`pastry.wire.images.image_keys`) and the images it embeds: ``(first
    position, embeddings, bytes)`` of each one at or after ``kv_len``."""
    at, digests = ints(r.image_at, "image_at"), [bytes(d) for d in r.image_digests]
    keys, mark = ints(r.tokens, "tokens"), _layout(ref, "prefill").token
    if len(digests) != len(at):
        raise ApiError(f"prefill: {len(at)} image positions (image_at) for {len(digests)} image_digests")  # fmt: skip
    later = [i for i, a in enumerate(at) if a >= kv_len]
    if len(r.images) != len(later):
        raise ApiError(
            f"prefill: {len(later)} images start at or after kv_len ({kv_len}) and need their "
            f"bytes; {len(r.images)} images given"
        )
    lens = _image_lens(s, ref, r, at, later)
    end = 0
    for i, (a, n) in enumerate(zip(at, lens, strict=True)):
        if a < end or a + n > len(keys) or a < kv_len < a + n:
            raise ApiError(
                f"prefill: image_at[{i}] = {a}: an image takes its {n} positions, in order, "
                f"within the {len(keys)} tokens, none split by kv_len ({kv_len})"
            )
        if any(t != mark for t in keys[a : a + n]):
            raise ApiError(f"prefill: positions {a}..{a + n - 1} must hold the image token {mark}")  # fmt: skip
        try:
            keys[a : a + n] = image_keys(digests[i], n)
        except ValueError as e:
            raise ApiError(f"prefill: image_digests[{i}]: {e}") from None
        end = a + n
    images = []
    for j, i in enumerate(later):
        if image_digest(r.images[j]) != digests[i]:
            raise ApiError(f"prefill: image_digests[{i}] is not the SHA-256 of images[{j}]")
        images.append((at[i], lens[i], bytes(r.images[j])))
    return keys, images


def _image_lens(s: Caller, ref, r: api.Prefill, at: list[int], later: list[int]) -> list[int]:
    """The positions each image of a prefill takes: ``image_lens`` (which a model whose
    images take positions by their size needs), each one with bytes checked against
    ``num_embs_needed``."""
    layout, lens = ref.model.info.image_layout, ints(r.image_lens, "image_lens")
    if not len(lens):
        if not layout.fixed:
            raise ApiError(
                "prefill: image_lens is needed on this model (an image takes positions by "
                "its size: num_embs_needed)"
            )
        lens = [layout.frame] * len(at)
    if len(lens) != len(at):
        raise ApiError(f"prefill: {len(lens)} image_lens for {len(at)} images (image_at)")
    for j, i in enumerate(later):
        n = _image_positions(s, ref, r.images[j], f"prefill: images[{j}]")
        if lens[i] != n:
            raise ApiError(
                f"prefill: image_lens[{i}] is {lens[i]}, but images[{j}] takes {n} positions "
                "(num_embs_needed)"
            )
    return list(lens)


# ---------------------------------------------------------------------------- input image


def _layout(ref, what: str) -> ImageLayout:
    """How an image becomes positions on ``ref``'s model; an ``ApiError`` for a text model."""
    info = ref.model.info
    if info.image_layout is None:
        raise ApiError(
            f"{what}: the model '{info.model_name}' takes no images (it has no 'input_image' "
            "trait: serve a vision-language checkpoint)"
        )
    return info.image_layout


def _image_positions(s: Caller, ref, image: object, what: str) -> int:
    """How many positions ``image`` takes on ``ref``'s model (its embeddings), once the
    image passed the checks (a model that takes images; a format Pillow reads; the image
    quotas). Only the image's header is read."""
    layout = _layout(ref, what)
    q = s.controller.quotas
    try:
        im = open_image(image, q.image_bytes, q.image_pixels)
    except ImageError as e:
        raise ApiError(f"{what}: {e}") from None
    try:
        return layout.positions(*im.size)
    except ValueError as e:
        raise ApiError(f"{what}: {e}") from None


@handles(api.NumEmbsNeeded)
def num_embs_needed(s: Caller, r: api.NumEmbsNeeded) -> int:
    return _image_positions(s, s.queue(r.q), r.image, "num_embs_needed")


@handles(api.GetImageToken)
def get_image_token(s: Caller, r: api.GetImageToken) -> int:
    return _layout(s.queue(r.q), "get_image_token").token


@handles(api.EmbedImg)
def embed_img(s: Caller, r: api.EmbedImg) -> asyncio.Future:
    ref = s.queue(r.q)
    n = _image_positions(s, ref, r.image, "embed_img")
    embeds = ints(r.embeds, "embeds")
    if len(embeds) != n:
        raise ApiError(
            f"embed_img: the image takes {n} embeds (num_embs_needed), got {len(embeds)}"
        )
    position = _count(r.position, "position")
    if position + n > ref.model.info.max_position:
        raise ApiError(
            f"embed_img: positions {position}..{position + n - 1} pass the model's "
            f"max_position ({ref.model.info.max_position})"
        )
    op = ImageOp(ref.model.resources, s.instance, bytes(r.image), position, embeds)
    return s.submit(ref, Stage.EMBED, op)


# ---------------------------------------------------------------------------- output


@handles(api.GetNextDist)
def get_next_dist(s: Caller, r: api.GetNextDist) -> asyncio.Future:
    """Top-``k`` next-token distribution at ``embed``: (token ids, probabilities)."""
    ref = s.queue(r.q)
    k = _count(r.k, "k")
    spec = sample_spec(r.sampling, ref.model.info.vocab_size, s.constraints, distribution=True)
    op = NextDistOp(ref.model.resources, s.instance, r.embed, k, spec)
    return s.submit(ref, Stage.OUTPUT, op)


@handles(api.Sample)
def sample(s: Caller, r: api.Sample) -> asyncio.Future:
    """Sample a token on the device (see :class:`pastry.api.Sample`)."""
    ref = s.queue(r.q)
    spec = sample_spec(r.sampling, ref.model.info.vocab_size, s.constraints)
    if spec is None or not (spec.logprobs or spec.grammar is not None):
        return s.submit(ref, Stage.OUTPUT, SampleOp(ref.model.resources, s.instance, r.embed, spec))
    op = SampledOp(ref.model.resources, s.instance, r.embed, spec)
    return _with_grammar(s.submit(ref, Stage.OUTPUT, op), spec.grammar)


@handles(api.Step)
def step(s: Caller, r: api.Step) -> asyncio.Future:
    """``embed_txt``, ``forward`` (its last input's output to ``out_embed``) and ``sample``
    from it as one fused command (see :class:`pastry.api.Step`): one submission, one
    translation of its handles, one future."""
    ref = s.queue(r.q)
    n = len(r.tokens)
    if n == 0:
        raise ApiError("step needs at least one token")
    if not n == len(r.positions) == len(r.in_embeds):
        raise ApiError(
            f"step needs as many positions and input embeddings as tokens ({n} tokens, "
            f"{len(r.positions)} positions, {len(r.in_embeds)} embeds)"
        )
    spec = None
    if r.sampling is not None:
        spec = sample_spec(r.sampling, ref.model.info.vocab_size, s.constraints)
    info = ref.model.info
    in_kv, out_kv = list(r.in_kv), list(r.out_kv)  # snapshots, translated when batched
    n_ctx = len(in_kv)
    last = r.in_kv_last_len if n_ctx else 0
    check_kv(info, in_kv, last, out_kv, r.out_kv_offset, n, overlap=False)
    tokens, positions = ints(r.tokens, "tokens"), ints(r.positions, "positions")
    check_tokens(info, tokens, positions)
    cls = Step if spec is None or not (spec.logprobs or spec.grammar is not None) else SampledStep
    op = cls(
        ref.model.resources, s.instance, tokens, positions, [*r.in_embeds, r.out_embed],
        in_kv + out_kv, n_ctx, int(last), int(r.out_kv_offset), spec,
    )  # fmt: skip
    fut = s.submit(ref, Stage.EMBED, op, tokens=n, last_stage=Stage.OUTPUT)
    return fut if cls is Step else _with_grammar(fut, spec.grammar)


@handles(api.Generate)
def generate(s: Caller, r: api.Generate) -> asyncio.Future:
    """A generation loop run by the control layer (see :class:`pastry.api.Generate` and
    :mod:`pastry.control.loops`): checked here once, its steps queued as they complete."""
    ref = s.queue(r.q)
    if ref.loop is not None:
        raise ApiError(
            f"a generation loop runs on queue {r.q}: take its answers with generate_more "
            "(stop=True ends it)"
        )
    info = ref.model.info
    vocab = info.vocab_size
    max_tokens = _count(r.max_tokens, "max_tokens")
    if max_tokens == 0:
        raise ApiError("max_tokens must be at least 1")
    position, min_tokens = _count(r.position, "position"), _count(r.min_tokens, "min_tokens")
    token_ids([r.token], "token", 0, vocab)
    stop_tokens = frozenset(token_ids(r.stop_tokens, "stop_tokens", 0, vocab).tolist())
    recent = token_ids(r.recent, "recent", 0, vocab).tolist()
    stop = list(r.stop)
    if not all(isinstance(x, str) for x in stop):
        raise ApiError("stop must be a list of strings")
    kv = list(r.kv)
    if -(-position // info.page_size) > len(kv):
        raise ApiError(
            f"{len(kv)} KV pages cannot hold the {position} tokens before position {position}"
        )
    spec = sample_spec(r.sampling, vocab, s.constraints)
    loop = GenerateLoop(
        s, ref, token=r.token, position=position, embeds=(r.in_embed, r.out_embed), kv=kv,
        max_tokens=max_tokens, sampling=r.sampling, spec=spec, stop_tokens=stop_tokens,
        stop=[x for x in stop if x], min_tokens=min_tokens, recent=recent,
        alloc_page=partial(_one_page, s, r.q), every=_count(r.every, "every"),
    )  # fmt: skip
    return loop.start()


@handles(api.GenerateMore)
def generate_more(s: Caller, r: api.GenerateMore) -> asyncio.Future:
    """The next answer of the generation loop on the queue (see control/loops.py)."""
    loop = s.queue(r.q).loop
    if loop is None:
        raise ApiError(f"no generation loop runs on queue {r.q}: start one with generate")
    if not isinstance(r.stop, bool):
        raise ApiError(f"stop must be true or false, got {r.stop!r}")
    return loop.more(r.stop)


def _one_page(s: Caller, q: int) -> int:
    return alloc_kvpages(s, api.AllocKvpages(q, 1))[0]


def _with_grammar(fut: asyncio.Future, grammar) -> asyncio.Future:
    """A constrained sample holds its grammar until it settles (one at a time)."""
    if grammar is not None:
        grammar.busy = True
        fut.add_done_callback(Release(grammar))
    return fut
