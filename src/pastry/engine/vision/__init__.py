"""Image input: the vision half of a vision-language checkpoint.

A vision-language checkpoint (``config.json`` with a ``vision_config`` and a
``text_config``) is a language model Pastry already serves plus an image encoder whose
outputs are embeddings in the language model's hidden space. The engine keeps the two
apart: the language model runs as any other (:mod:`pastry.engine.model`, paged KV, the
compiled step); :class:`~pastry.engine.vision.llava.ImageEncoder` turns encoded images
into rows of the embedding pool, where ``forward`` reads them like the rows ``embed_txt``
writes (``embed_img`` in the inferlet API).

- :func:`vision_spec` reads the vision half of a ``config.json`` (``None`` for a text
  model) into a :class:`~pastry.engine.vision.spec.VisionSpec`: the family, the tower,
  the image token and how many embeddings one image takes;
- :func:`language_config` is the ``text_config`` part as the language model reads it;
- :func:`weight_name` maps a tensor name (the language model's as a text checkpoint names
  it, or ``vision_tower.*`` / ``multi_modal_projector.*``) to where the checkpoint's files
  store it (the layout before and after transformers 5 differ).

Families: LLaVA (a CLIP or SigLIP tower, a two-layer projector; every image the same
number of embeddings) and Idefics3 / SmolVLM (tiles of a SigLIP-style tower, pixel
shuffle, one linear; an image takes positions by its size: its
:class:`~pastry.wire.images.ImageLayout`). :func:`~pastry.engine.vision.encoders.load_encoder`
loads a checkpoint's encoder. The tower is
``transformers``' own module for the tower's ``model_type``, run in the engine's dtype and
batched across the images of a step; the image processor is the one the checkpoint ships
(``preprocessor_config.json`` through ``transformers.AutoImageProcessor``), fed images that
Pillow decoded. Importing this package imports neither torch nor transformers.
"""

from __future__ import annotations

from pastry.engine.vision.spec import language_config, vision_spec, weight_name

__all__ = ["language_config", "vision_spec", "weight_name"]
