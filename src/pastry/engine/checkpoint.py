"""Loading a checkpoint: a Hugging Face directory or a GGUF file, told apart by the path.

:func:`load_checkpoint` is the one door: a directory is read by
:func:`pastry.engine.hf_checkpoint.load_hf_checkpoint` (config, tokenizer, safetensors
weights checked against the config), a ``.gguf`` file by :func:`pastry.engine.gguf.load_gguf`,
which converts it once into a cached directory of the same form. Both return a
:class:`~pastry.engine.hf_checkpoint.Checkpoint`; every error is a
:class:`~pastry.wire.config.CheckpointError` naming the file and the field or tensor.
Importing this module does not import torch (nor the GGUF reader until a file is given).
"""

from __future__ import annotations

import os
from pathlib import Path

from pastry.engine.hf_checkpoint import Checkpoint, load_hf_checkpoint
from pastry.wire.config import CheckpointError


def load_checkpoint(model_dir: str | Path) -> Checkpoint:
    """The checkpoint at ``model_dir``: a Hugging Face checkpoint directory
    (:func:`~pastry.engine.hf_checkpoint.load_hf_checkpoint`) or the metadata of a GGUF file
    (:func:`pastry.engine.gguf.load_gguf`)."""
    model_dir = Path(os.path.abspath(model_dir))  # keeps a symlinked directory's own name
    if model_dir.is_file():
        from pastry.engine.gguf import load_gguf
        from pastry.engine.gguf_file import is_gguf

        if is_gguf(model_dir) or model_dir.suffix.lower() == ".gguf":
            return load_gguf(model_dir)  # (which says what is wrong with a broken .gguf)
        raise CheckpointError(
            f"{model_dir}: not a checkpoint (give a Hugging Face checkpoint directory or a "
            ".gguf file)"
        )
    if not model_dir.is_dir():
        raise CheckpointError(f"{model_dir}: not a directory or a .gguf file")
    return load_hf_checkpoint(model_dir)
