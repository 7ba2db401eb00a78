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
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence

import numpy as np

from pastry.engine.tokenizer import Tokenizer


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
        self._cache: OrderedDict[str, np.ndarray] = OrderedDict()
        self._cached_chars = 0
        self._lock = threading.Lock()  # encode_batch runs in worker threads
        self.hits = 0

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` (no special tokens added), on the calling thread."""
        if len(text) >= self.cache_min_chars:
            with self._lock:
                ids = self._cache.get(text)
                if ids is not None:
                    self._cache.move_to_end(text)
                    self.hits += 1
                    return ids.tolist()
        if self.max_bytes is not None and len(text) > self.max_bytes:
            n = len(text.encode("utf-8", "surrogatepass"))
            if n > self.max_bytes:
                raise TokenizeTooLarge(
                    f"tokenize takes at most {self.max_bytes} bytes of text at once (the "
                    f"server's tokenize quota), got {n}: split the text"
                )
        return self.tokenizer.encode(text)

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        """Token ids of each text; meant for a worker thread (the tokenizer releases the
        global lock while it encodes). Large texts are remembered for :meth:`encode`."""
        out = self.tokenizer.encode_batch(list(texts))
        for text, ids in zip(texts, out, strict=True):
            if self.cache_min_chars <= len(text) <= self.cache_chars:
                self._remember(text, np.asarray(ids, dtype=np.int32))
        return out

    def _remember(self, text: str, ids: np.ndarray) -> None:
        with self._lock:
            if text in self._cache:
                self._cache.move_to_end(text)
                return
            self._cache[text] = ids
            self._cached_chars += len(text)
            while self._cached_chars > self.cache_chars:
                old, _ = self._cache.popitem(last=False)
                self._cached_chars -= len(old)
