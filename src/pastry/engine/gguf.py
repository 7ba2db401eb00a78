"""GGUF checkpoints: llama.cpp's single-file format, converted once into a cached directory.

A GGUF file holds a model's hyper-parameters and tokenizer as metadata and its tensors,
usually quantized, under llama.cpp's names. :func:`load_gguf` turns one into a
:class:`~pastry.engine.hf_checkpoint.Checkpoint` like a Hugging Face directory's; the file
is parsed by :mod:`~pastry.engine.gguf_file`, and what it holds is mapped by

- :mod:`~pastry.engine.gguf_config`: ``{arch}.block_count``, ``{arch}.attention.head_count``,
  ... written as an HF ``config.json`` and normalised by
  :class:`~pastry.wire.config.ModelConfig` (llama, mistral, qwen2, qwen3; q/k/v biases and
  q/k norms from the tensors present; tied embeddings when there is no ``output.weight``;
  Llama 3 RoPE scaling from ``rope_freqs``).
- :mod:`~pastry.engine.gguf_tokenizer`: a ``tokenizers`` object rebuilt from
  ``tokenizer.ggml.*``: byte-level BPE (``gpt2``) with the file's merges and the
  pre-tokenizer llama.cpp applies for ``tokenizer.ggml.pre``, or SentencePiece-style BPE
  (``llama``) whose merges follow the token scores, with byte fallback; control tokens are
  special, BOS/EOS as the file says (``add_bos_token``, else llama.cpp's default for the
  vocabulary), and the chat template.
- :mod:`~pastry.engine.gguf_weights`: the weights, dequantized by ``gguf.quants``
  (``SUPPORTED_TYPES``) into the engine's dtype, renamed to HF names, with the rotary row
  permutation that llama.cpp's converter applies to the Q and K projections of llama
  models undone.

This module is the cache. Converting takes seconds to minutes (reading the metadata alone
takes seconds when the vocabulary is large), so it happens once: the result is a directory
under ``$PASTRY_HOME/models/gguf-cache/<sha256[:16]>-v<CONVERTER_VERSION>/`` with
``config.json``, ``generation_config.json``, ``tokenizer.json``, ``tokenizer_config.json``,
``gguf.json`` (where it came from) and one ``model.<dtype>.safetensors`` per dtype asked
for; later starts read only that (a safetensors load), whatever the file's name or place
(the model is named after the file's stem). The key is the file's SHA-256; hashing a
multi-GB file takes seconds, so the digest is remembered per (path, size, mtime, ctime,
inode) in ``gguf-cache/digests/``: a start with a warm cache only stats the file.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING

from pastry.engine.gguf_config import hf_config
from pastry.engine.gguf_file import Metadata, check_magic, read_gguf
from pastry.engine.gguf_tokenizer import build_tokenizer
from pastry.engine.gguf_weights import convert_weights
from pastry.engine.hf_checkpoint import (
    Checkpoint,
    expected_shapes,
    load_hf_checkpoint,
    read_weights,
)
from pastry.paths import models_dir, publish_dir
from pastry.wire.config import CheckpointError, ModelConfig

if TYPE_CHECKING:  # torch and gguf load only when a file is converted (not from the cache)
    import gguf
    import torch

log = logging.getLogger(__name__)

CONVERTER_VERSION = 2  # part of the cache key: bump when the conversion's output changes
_TORCH_DTYPES = ("float32", "bfloat16", "float16")


# -- the cache ---------------------------------------------------------------------------------


def cache_root() -> Path:
    """Where converted GGUF files are kept: ``$PASTRY_HOME/models/gguf-cache``."""
    return models_dir() / "gguf-cache"


def file_digest(path: Path) -> str:
    """The SHA-256 of ``path``'s content, hashed once per (path, size, mtime, ctime, inode)
    and remembered under ``gguf-cache/digests/``."""
    st = path.stat()
    ident = f"{path.resolve()}\0{st.st_size}\0{st.st_mtime_ns}\0{st.st_ctime_ns}\0{st.st_ino}"
    memo = cache_root() / "digests" / hashlib.sha256(ident.encode()).hexdigest()[:32]
    try:
        digest = memo.read_text().strip()
        if len(digest) == 64:
            return digest
    except OSError:
        pass
    with open(path, "rb") as f:
        digest = hashlib.file_digest(f, "sha256").hexdigest()
    try:
        _write_text(memo, digest + "\n")
    except OSError as e:
        log.warning("cannot remember the digest of %s in %s: %s", path, memo, e)
    return digest


def cache_dir(path: Path) -> Path:
    """The conversion cache directory of the GGUF file ``path``."""
    return cache_root() / f"{file_digest(path)[:16]}-v{CONVERTER_VERSION}"


def _write_text(target: Path, text: str) -> None:
    """Write ``target`` atomically (a temporary sibling renamed into place)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}-", dir=target.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.chmod(tmp, 0o644)  # $PASTRY_HOME may be shared
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


@lru_cache(maxsize=1)
def _reader(path: Path, digest: str) -> gguf.GGUFReader:
    """The parsed file, kept between reading the metadata and converting the weights of one
    first start (parsing takes seconds); ``digest`` keys out a changed file."""
    return read_gguf(path)


def _write_metadata(path: Path, target: Path) -> None:
    """Write the config, tokenizer and provenance files of ``path`` into ``target``."""
    t0 = time.perf_counter()
    print(f"reading {path.name} (GGUF) once; later starts use {target}", file=sys.stderr)
    reader = _reader(path, file_digest(path))
    meta = Metadata(reader, path)
    tensors = {t.name: t for t in reader.tensors}
    tok, tok_config = build_tokenizer(meta)
    config = hf_config(meta, tensors, path.stem)
    ModelConfig.from_dict(config, source=str(path))  # fail here, before anything is written
    tok_config["model_max_length"] = config["max_position_embeddings"]
    eos = config["eos_token_id"]
    files = {
        "config.json": config,
        "generation_config.json": {"bos_token_id": config["bos_token_id"], "eos_token_id": eos},
        "tokenizer_config.json": tok_config,
        "gguf.json": {
            "source": str(path),
            "sha256": file_digest(path),
            "converter_version": CONVERTER_VERSION,
            "general.name": meta.get("general.name"),
            "tensor_types": dict(Counter(t.tensor_type.name for t in reader.tensors)),
        },
    }

    def fill(tmp: Path) -> None:
        for name, data in files.items():
            (tmp / name).write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n")
        tok.save(str(tmp / "tokenizer.json"))

    publish_dir(target, fill, marker="gguf.json")
    log.info("read the metadata of %s in %.1fs", path, time.perf_counter() - t0)


@dataclass(frozen=True, eq=False)
class GgufCheckpoint(Checkpoint):
    """A GGUF file (``path``) and its conversion cache directory (``cache``)."""

    cache: Path

    def load_state_dict(
        self, dtype: torch.dtype, device: str | torch.device = "cpu"
    ) -> dict[str, torch.Tensor]:
        """The weights in ``dtype`` on ``device``: read from the cache, or converted from the
        file (and cached) on first use."""
        import torch
        from safetensors.torch import save_file

        name = str(dtype).removeprefix("torch.")
        if name not in _TORCH_DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(_TORCH_DTYPES)}, got {name}")
        file = self.cache / f"model.{name}.safetensors"
        if file.is_file():
            return read_weights(file, dict.fromkeys(expected_shapes(self.config), file),
                                self.config, dtype, device)  # fmt: skip
        t0 = time.perf_counter()
        reader = _reader(self.path, file_digest(self.path))
        weights = convert_weights(reader, self.path, self.config, dtype)
        secs = time.perf_counter() - t0
        tmp = self.cache / f".{file.name}-{os.getpid()}"
        try:
            save_file(weights, tmp, metadata={"format": "pt", "source": self.path.name})
            tmp.chmod(0o644)
            os.replace(tmp, file)
        except OSError as e:
            tmp.unlink(missing_ok=True)
            log.warning("cannot cache the converted weights in %s (%s); the next start "
                        "converts again", file, e)  # fmt: skip
        _reader.cache_clear()  # the conversion is done: unmap the file
        print(f"converted {self.path.name} to {name} in {secs:.1f}s (cached: {file})",
              file=sys.stderr)  # fmt: skip
        if torch.device(device).type != "cpu":
            weights = {k: v.to(device) for k, v in weights.items()}
        return weights


def load_gguf(path: str | Path) -> GgufCheckpoint:
    """The checkpoint of a GGUF file: config and tokenizer now (from the cache, written on
    first use), weights when asked (:meth:`GgufCheckpoint.load_state_dict`). The model's
    name is the file's stem."""
    path = Path(os.path.abspath(path))
    if not path.is_file():
        raise CheckpointError(f"{path}: file not found")
    check_magic(path)
    target = cache_dir(path)
    if not (target / "gguf.json").is_file():
        _write_metadata(path, target)
    ckpt = load_hf_checkpoint(target)
    config = dataclasses.replace(ckpt.config, name=path.stem)  # copies share the cache
    return GgufCheckpoint(
        path=path, config=config, tokenizer=ckpt.tokenizer, name=path.stem, cache=target
    )
