"""Tokenizing without stalling the server: :class:`Tokenization`, one per model.

A tokenizer holds Python's global lock while it encodes, and the server's one event loop
serves everyone: tokenizing a few megabytes on it stalls every client for seconds. So:

- Endpoints that take text from a request (``/v1/completions`` ...) count its tokens with
  :meth:`Tokenization.encode_batch` in a worker thread: the ``tokenizers`` library releases
  the lock while it encodes a batch. Large texts (``cache_min_chars`` and up) are remembered
  (a few, least recently used first out), so that the built-in inferlet serving the request,
  which tokenizes the same text again on the loop, finds them ready.
- :meth:`Tokenization.encode`, the inferlet API's ``tokenize``, runs on the loop: it returns
  a remembered text at once and refuses texts over ``max_bytes`` (``Quotas.tokenize_bytes``).
  :meth:`Tokenization.encode_async` is the same for a caller that can wait (a sandboxed
  inferlet's ``tokenize`` of a long text suspends only that instance): a worker thread
  encodes.
- :meth:`Tokenization.count` does not tokenize a text that cannot fit a limit anyway (no
  token covers more than ``NORMALIZE_FACTOR`` times the longest token's bytes of input);
  large texts are tokenized one at a time, and the allocator is then asked to give the
  memory back (a megabyte of text takes hundreds of megabytes to tokenize, which glibc
  would otherwise keep per worker thread).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import ctypes
import ctypes.util
import functools
import math
import threading
from collections import OrderedDict
from collections.abc import Sequence

import numpy as np

from pastry.wire.tokenizer import Tokenizer

NORMALIZE_FACTOR = 4  # input characters one token may cover per byte of its own (margin
# for normalizers that compose characters)
LARGE_CHARS = 64 << 10  # texts tokenized one at a time, with the memory returned after


class TokenizeTooLarge(ValueError):
    """A text over the size one ``tokenize`` call may take on the event loop."""


class Tokenization:
    def __init__(
        self,
        tokenizer: Tokenizer,
        max_bytes: int | None = None,
        cache_min_chars: int = 16 << 10,
        cache_chars: int = 32 << 20,
    ) -> None:
        self.tokenizer = tokenizer
        self.max_bytes = max_bytes
        self.cache_min_chars = cache_min_chars
        self.cache_chars = cache_chars
        # (text, add_special_tokens) -> ids
        self._cache: OrderedDict[tuple[str, bool], np.ndarray] = OrderedDict()
        self._cached_chars = 0
        self._lock = threading.Lock()  # encode_batch runs in worker threads
        self._large = threading.Semaphore(1)  # one large text at a time (memory)
        self.hits = 0
        self._worker: concurrent.futures.ThreadPoolExecutor | None = None  # encode_async's

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Token ids of ``text`` on the calling thread; ``add_special_tokens`` as in
        :meth:`Tokenizer.encode` (e.g. a BOS for a text that starts a sequence)."""
        ids = self._recall(text, add_special_tokens)
        if ids is not None:
            return ids
        self._check_size(text)
        return self.tokenizer.encode(text, add_special_tokens)

    async def encode_async(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """:meth:`encode` without stalling the event loop, for a caller that can wait (a
        sandboxed inferlet's ``tokenize`` suspends only its own instance): a remembered
        text at once, any other in this model's inferlet-tokenizing thread (one: what
        inferlets tokenize takes at most one core, and never the threads that parse
        requests). The same size limit (:class:`TokenizeTooLarge`, before tokenizing)."""
        ids = self._recall(text, add_special_tokens)
        if ids is not None:
            return ids
        self._check_size(text)
        if self._worker is None:
            self._worker = concurrent.futures.ThreadPoolExecutor(
                max_workers=1, thread_name_prefix="pastry-tokenize"
            )
        loop = asyncio.get_running_loop()
        out = await loop.run_in_executor(
            self._worker, self.encode_batch, [text], bool(add_special_tokens)
        )
        return out[0]

    def _recall(self, text: str, add_special_tokens: bool) -> list[int] | None:
        """The remembered ids of a large text, or None."""
        if len(text) >= self.cache_min_chars:
            key = (text, bool(add_special_tokens))
            with self._lock:
                ids = self._cache.get(key)
                if ids is not None:
                    self._cache.move_to_end(key)
                    self.hits += 1
                    return ids.tolist()
        return None

    def _check_size(self, text: str) -> None:
        if self.max_bytes is not None and len(text) > self.max_bytes:
            n = len(text.encode("utf-8", "surrogatepass"))
            if n > self.max_bytes:
                raise TokenizeTooLarge(
                    f"tokenize takes at most {self.max_bytes} bytes of text at once (the "
                    f"server's tokenize quota), got {n}: split the text"
                )

    def encode_batch(
        self, texts: Sequence[str], add_special_tokens: bool = False
    ) -> list[list[int]]:
        """Token ids of each text; meant for a worker thread (the tokenizer releases the
        global lock while it encodes). Large texts are remembered for :meth:`encode`."""
        large = sum(len(t) for t in texts) >= LARGE_CHARS
        if large:
            self._large.acquire()
        try:
            out = self.tokenizer.encode_batch(list(texts), add_special_tokens)
        finally:
            if large:
                self._large.release()
        for text, ids in zip(texts, out, strict=True):
            if self.cache_min_chars <= len(text) <= self.cache_chars:
                self._remember((text, bool(add_special_tokens)), np.asarray(ids, np.int32))
        if large:
            _give_memory_back()
        return out

    def count(
        self, texts: Sequence[str], limit: int | None = None, add_special_tokens: bool = False
    ) -> list[int]:
        """How many tokens each text has (worker thread, like :meth:`encode_batch`, with the
        same ``add_special_tokens``). A text that certainly has more than ``limit`` is not
        tokenized: its count is then a lower bound, already over ``limit``."""
        counts: list[int | None] = [None] * len(texts)
        if limit is not None:
            for i, text in enumerate(texts):
                least = self.fewest_tokens(text)
                if least > limit:
                    counts[i] = least
        todo = [i for i, c in enumerate(counts) if c is None]
        if todo:
            encoded = self.encode_batch([texts[i] for i in todo], add_special_tokens)
            for i, ids in zip(todo, encoded, strict=True):
                counts[i] = len(ids)
        return counts  # type: ignore[return-value]

    def fewest_tokens(self, text: str) -> int:
        """A lower bound on the tokens of ``text``."""
        return math.ceil(len(text) / (NORMALIZE_FACTOR * self.longest_token_bytes))

    @functools.cached_property
    def longest_token_bytes(self) -> int:
        return max(1, max(len(b) for b in self.tokenizer.get_vocabs()))

    def _remember(self, key: tuple[str, bool], ids: np.ndarray) -> None:
        with self._lock:
            if key in self._cache:
                self._cache.move_to_end(key)
                return
            self._cache[key] = ids
            self._cached_chars += len(key[0])
            while self._cached_chars > self.cache_chars:
                (old, _), _ = self._cache.popitem(last=False)
                self._cached_chars -= len(old)


def _give_memory_back() -> None:
    """Return freed heap memory to the system (glibc keeps it per thread arena)."""
    if _malloc_trim is not None:
        _malloc_trim(0)


def _load_malloc_trim():
    name = ctypes.util.find_library("c")
    try:
        return getattr(ctypes.CDLL(name), "malloc_trim", None) if name else None
    except OSError:
        return None


_malloc_trim = _load_malloc_trim()
