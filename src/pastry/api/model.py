"""Requests that run the model: forward, text in and out, the next token."""

from __future__ import annotations

from collections.abc import Sequence

from pastry.api.sampling import Sampling
from pastry.api.table import alias, request
from pastry.api.types import I32, Count, Handle, Token

# ---------------------------------------------------------------------------- forward


@request("forward", trait="forward", queued=("none", "logprobs"))
class Forward:
    """Queued: the model over ``in_embeds`` (positions stored with them by
    ``embed_txt``) on top of the context in ``in_kv`` (all tokens of every page, of the
    last only ``in_kv_last_len``). New K/V go to ``out_kv`` from slot ``out_kv_offset``;
    ``out_embeds`` receive the outputs of the last ``len(out_embeds)`` inputs. ``mask``:
    one row per input over context + inputs, True = attend (default: all context, causal
    among inputs). Leaving a page out of ``in_kv`` masks its tokens.

    Prompt log-probabilities: with ``logprob_targets`` (one token id per input, -1 for
    none; to score a prompt, each input's next token), resolves to ``(logprobs, top_ids,
    top_logprobs)``: per input the target's log-probability under the model (NaN for -1)
    and the ``logprob_top`` (at most 20) most likely tokens with theirs. ``adapter``: the
    name of a LoRA adapter loaded on the model (``get_adapters``), applied to this call."""

    q: Handle
    in_kv: Sequence[Handle]
    in_kv_last_len: Count
    in_embeds: Sequence[Handle]
    out_kv: Sequence[Handle]
    out_kv_offset: Count
    out_embeds: Sequence[Handle]
    mask: list[list[bool]] | None = None
    logprob_targets: Sequence[I32] | None = None
    logprob_top: Count = 0
    adapter: str | None = None


_ADAPTER_ORDER = ("q", "adapter", "in_kv", "in_kv_last_len", "in_embeds", "out_kv")
alias(
    "forward_with_adapter",
    Forward,
    (*_ADAPTER_ORDER, "out_kv_offset", "out_embeds", "mask", "logprob_targets", "logprob_top"),
    "forward_with_adapter",
    "Queued: ``forward`` with the LoRA adapter named ``adapter`` applied.",
)


@request("forward", trait="forward_with_adapter", now=list[str])
class GetAdapters:
    """Names of the LoRA adapters loaded on the queue's model."""

    q: Handle


@request("forward", trait="forward", queued=("none",))
class MaskKvpage:
    """Queued: ``mask[i]`` True makes token ``i`` of ``page`` not attendable."""

    q: Handle
    page: Handle
    mask: list[bool]


# ---------------------------------------------------------------------------- input text


@request("input text, tokenize", trait="input_text", queued=("none",))
class EmbedTxt:
    """Queued: embed ``tokens`` at ``positions`` into ``embeds``."""

    q: Handle
    tokens: Sequence[Token]
    positions: Sequence[Count]
    embeds: Sequence[Handle]


@request("input text, tokenize", trait="input_text", now=list[Handle], queued=("token",))
class Prefill:
    """Queued: the K/V of text through the automatic prefix cache (RadixAttention).

    ``tokens`` is the whole sequence, from position 0; ``pages`` (in order) hold the K/V
    of its first ``kv_len`` tokens. Returns, at once, new page handles for the page indices
    after ``pages``, enough for ``len(tokens) + reserve`` tokens (``reserve``: room for
    tokens to come, e.g. the generation budget, taken with the prompt so that a program
    admitted under memory pressure can finish), and an awaitable of how many of the new
    tokens came from the cache. When the call is admitted (it may wait for KV pages), the
    longest cached prefix of ``tokens`` that starts at a page boundary of the context fills
    new pages (full pages shared by reference, the slots of a partial one copied) and the
    rest is embedded and forwarded; ``out_embeds`` receive the outputs of the last
    ``len(out_embeds)`` tokens (always computed). The pages then hold what ``embed_txt`` +
    ``forward`` would write. A page shared through the cache is read-only while another
    inferlet uses it: writing it (``forward`` into it, ``mask_kvpage``, ``copy_kvpage`` onto
    it) raises ``ApiError``; copy it into a page of your own first.

    Images (a model with the ``input_image`` trait): ``image_at`` is where each image of
    ``tokens`` starts (its ``num_embs_needed`` positions hold the image token,
    ``get_image_token``), ``image_digests`` each one's SHA-256, and ``images`` the encoded
    bytes of those at or after ``kv_len``, in order (an image is never split by
    ``kv_len``), and ``image_lens`` how many positions each one takes (its
    ``num_embs_needed``; may be left empty on a model whose images all take the same
    number, e.g. LLaVA, and is needed where an image takes positions by its size, e.g.
    Idefics3 / SmolVLM). An image is matched in the cache by its digest, so the same image asked
    about again is not encoded again, and what follows it is matched too; one not cached
    is embedded (``embed_img``) and forwarded with the rest."""

    q: Handle
    tokens: Sequence[Token]
    kv_len: Count
    pages: Sequence[Handle]
    out_embeds: Sequence[Handle]
    reserve: Count = 0
    image_at: Sequence[Count] = ()
    image_digests: Sequence[bytes] = ()
    images: Sequence[bytes] = ()
    image_lens: Sequence[Count] = ()


@request("input text, tokenize", trait="tokenize", now=list[Token])
class Tokenize:
    """Token ids of ``text``. ``add_special_tokens``: as the start of a sequence, with the
    special tokens the model's tokenizer adds there (a BOS for models that want one, e.g.
    Llama; none for SmolLM2 or Qwen). ``Context.fill`` sets it on an empty context."""

    q: Handle
    text: str
    add_special_tokens: bool = False


@request("input text, tokenize", trait="tokenize", now=str)
class Detokenize:
    """The text of ``tokens``."""

    q: Handle
    tokens: Sequence[Token]


@request("input text, tokenize", trait="tokenize", now=list[bytes])
class GetVocabs:
    """The bytes of every token id."""

    q: Handle


@request("input text, tokenize", trait="tokenize", now=list[Token])
class GetEosTokenIds:
    """The model's end-of-sequence token ids."""

    q: Handle


@request("input text, tokenize", trait="tokenize", now=Count)
class GetVocabSize:
    """Rows of the model's output distribution (may exceed the tokenizer's vocabulary)."""

    q: Handle


@request("input text, tokenize", trait="tokenize", now=str)
class ApplyChatTemplate:
    """Render (role, content) messages with the model's chat template."""

    q: Handle
    messages: Sequence[tuple[str, str]]
    add_generation_prompt: bool = True


# ---------------------------------------------------------------------------- input image


@request("input image", trait="input_image", now=Count)
class NumEmbsNeeded:
    """How many embeddings ``embed_img`` writes for ``image`` (its encoded bytes: PNG,
    JPEG, WebP or GIF) on the queue's model: the positions the image takes in a context.
    Every image takes the same number on a LLaVA model; on Idefics3 / SmolVLM an image
    takes positions by its size (its tiles' embeddings with their tags and newlines, then
    the whole image's: the processor's expansion of one ``<image>``). Raises ``ApiError`` for bytes that are not such an
    image, or one over the image quotas (``--max-image-bytes``, ``--max-image-pixels``)."""

    q: Handle
    image: bytes


@request("input image", trait="input_image", now=Token)
class GetImageToken:
    """The placeholder token id the model's chat template writes for an image (LLaVA's
    ``<image>``, ``image_token_index`` in its config): an image's embeddings take the
    place of ``num_embs_needed`` of them, and ``Context.fill_image`` keeps that many in
    ``tokens``, so a context's token list stays position for position."""

    q: Handle


@request("input image", trait="input_image", queued=("none",))
class EmbedImg:
    """Queued: the embeddings of ``image`` (encoded bytes, checked as ``num_embs_needed``
    checks them, at once) into ``embeds`` (``num_embs_needed(image)`` of them), at
    positions ``position``, ``position + 1``, ...; ``forward`` reads them as it reads
    ``embed_txt``'s. The model's image processor and vision tower run in the engine,
    batched with the other images of the step."""

    q: Handle
    image: bytes
    position: Count
    embeds: Sequence[Handle]


# ---------------------------------------------------------------------------- output


@request("output", trait="output_text", queued=("dist",))
class GetNextDist:
    """Queued: the top-``k`` next-token distribution at ``embed`` (ids, probabilities),
    after ``sampling``'s logit processing (forbidden tokens: probability 0)."""

    q: Handle
    embed: Handle
    k: Count = 256
    sampling: Sampling | None = None


@request("output", trait="output_text", queued=("token", "sampled"))
class Sample:
    """Queued: sample a token on the device with ``sampling`` (default: greedy, no logit
    processing; see :class:`~pastry.api.sampling.Sampling`). Resolves to the token id, or
    with ``sampling.logprobs`` to ``(token, logprob, top_ids, top_logprobs)``."""

    q: Handle
    embed: Handle
    sampling: Sampling | None = None


@request("output", trait="output_text", queued=("token", "sampled"))
class Step:
    """Queued: one decode step as one command, the same as the three calls
    ``embed_txt(q, tokens, positions, in_embeds)``, ``forward(q, in_kv, in_kv_last_len,
    in_embeds, out_kv, out_kv_offset, [out_embed])`` and ``sample(q, out_embed,
    sampling)`` issued together: they run in one engine batch and the step resolves once,
    to ``sample``'s value. The first error among the three fails the step (as with the
    three calls, those before it took effect). Cheaper than the three calls (one
    submission, one translation, one wake-up); programs that want the parts (a custom
    mask, an adapter, several outputs, the distribution) use them."""

    q: Handle
    tokens: Sequence[Token]
    positions: Sequence[Count]
    in_embeds: Sequence[Handle]
    in_kv: Sequence[Handle]
    in_kv_last_len: Count
    out_kv: Sequence[Handle]
    out_kv_offset: Count
    out_embed: Handle
    sampling: Sampling | None = None


@request("output", trait="output_text", queued=("generated",))
class Generate:
    """Queued: a whole generation loop run by the control layer, without waking the
    program per token. From ``token`` (the context's one pending token) at ``position``,
    it repeats the decode step (``step``: embed, forward over the context pages ``kv``,
    sample into ``out_embed`` through ``in_embed``) and appends each sampled token, until
    a token of ``stop_tokens`` is sampled, a string of ``stop`` appears in the text of
    ``recent`` (tokens generated before this call) followed by the new tokens, the grammar
    of ``sampling.constraint`` can take nothing but end-of-sequence, or ``max_tokens``
    tokens were sampled. Each step's sampling is ``sampling`` with the seed advanced by
    one per token and the new tokens appended to ``penalty_tokens``; before
    ``min_tokens`` tokens, ``stop_tokens`` are banned (unless the grammar is complete) and
    stop strings do not count (vLLM's ``min_tokens``).
    Pages for the tokens beyond ``kv`` are allocated on the way (as ``alloc_kvpages``).

    Resolves to ``(tokens, new pages, finish, error, logprobs, top ids, top logprobs)``:
    the sampled tokens (the last one is not forwarded: it is the next pending token), the
    handles of the pages it allocated (the context's now), why it ended (``length``,
    ``stop``: a stop token or string, ``grammar``, or ``error``) and the error's message,
    and with ``sampling.logprobs`` per token what ``sample`` returns with them. A failure
    after the first step ends the loop with what was done (``error``), so the caller
    keeps a consistent context; the results are exactly those of the same ``step`` calls
    made one by one.

    ``every``: 0 (the default) resolves when the loop ends; ``k`` >= 1 resolves as soon as
    ``k`` tokens are sampled, with finish ``""`` (still running), and the loop runs on
    meanwhile: ``generate_more`` takes the tokens sampled since (one loop per queue at a
    time; a loop is over for the queue once an answer with a finish was taken)."""

    q: Handle
    token: Token
    position: Count
    in_embed: Handle
    out_embed: Handle
    kv: Sequence[Handle]
    max_tokens: Count
    sampling: Sampling | None = None
    stop_tokens: Sequence[Token] = ()
    stop: Sequence[str] = ()
    min_tokens: Count = 0
    recent: Sequence[Token] = ()
    every: Count = 0


@request("output", trait="output_text", queued=("generated",))
class GenerateMore:
    """Queued: the next part of the generation loop running on ``q`` (a ``generate`` with
    ``every`` k): resolves as ``generate`` does, to everything the loop did since the last
    answer, once it sampled ``k`` more tokens or ended (a program that reads slower than
    the loop samples gets the tokens merged, never one answer per token). ``stop``: the
    loop ends now, finish ``cancelled`` (the step in flight completes first and its token
    is part of the answer, so the context stays consistent)."""

    q: Handle
    stop: bool = False
