"""The inference layer: model, paged KV and embed pools, one handler per batched call type.

Import submodules directly (``pastry.engine.checkpoint``, ...); this package imports nothing
so that the control layer can use light modules without loading torch.
"""
