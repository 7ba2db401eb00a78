"""What the server and the engines share, without torch: the process boundary.

The server process (``pastry serve``: the control layer, the runtimes, the endpoints) never
imports torch; the engines (:mod:`pastry.engine`) do. Everything both sides need lives
here: the typed engine calls and their results (:mod:`~pastry.wire.calls`), their encoding
(:mod:`~pastry.wire.codec`, message headers in :mod:`~pastry.wire.protocol`), the handles
through which the control layer drives an engine in process or over ZeroMQ
(:mod:`~pastry.wire.handle`, :mod:`~pastry.wire.remote`), starting engine processes
(:mod:`~pastry.wire.spawn`) and authenticating to them (:mod:`~pastry.wire.auth`), the
model and engine configuration (:mod:`~pastry.wire.config`) and the tokenizer
(:mod:`~pastry.wire.tokenizer`). ``tests/test_imports.py`` imports every module here in a
fresh interpreter and fails if torch came with any of them.
"""
