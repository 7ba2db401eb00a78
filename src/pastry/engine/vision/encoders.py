"""The image encoder of a vision-language checkpoint, by its family."""

from __future__ import annotations


def load_encoder(model_dir, spec, dtype, device, tokenizer):
    """The image encoder of the vision-language checkpoint at ``model_dir`` (``spec``: its
    :func:`vision_spec`; ``tokenizer``: its :class:`~pastry.wire.tokenizer.Tokenizer`):
    an object with ``layout`` (:class:`~pastry.wire.images.ImageLayout`) and
    ``spans(images, embed_tokens)``, each decoded image's embeddings."""
    if spec.family == "idefics3":
        from pastry.engine.vision.idefics3 import Idefics3Encoder as Encoder
    else:
        from pastry.engine.vision.llava import ImageEncoder as Encoder
    return Encoder.load(model_dir, spec, dtype, device, tokenizer)
