"""The server process does not load torch (the engine runs in its own process)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

SRC = str(Path(__file__).resolve().parents[1] / "src")

# What `pastry serve` imports in the server process (the engine process imports the rest),
# and the engine-side modules the control layer shares.
TORCH_FREE = (
    "pastry.server.app",
    "pastry.cli",
    "pastry.paths",
    "pastry.wire.remote",
    "pastry.wire.spawn",
    "pastry.engine.serve",
    "pastry.wire.calls",
    "pastry.wire.codec",
    "pastry.wire.tokenizer",
    "pastry.wire.config",
    "pastry.engine.checkpoint",
    "pastry.engine.gguf",
    "pastry.engine.default_model",
    "pastry.runtime.wasm",
)


def test_the_server_process_does_not_import_torch():
    code = (
        f"import sys; import {', '.join(TORCH_FREE)}; "
        "heavy = sorted(m for m in ('torch', 'transformers', 'safetensors.torch') "
        "if m in sys.modules); "
        "assert not heavy, f'imported {heavy}'"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([SRC, os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert proc.returncode == 0, proc.stderr


def test_pastry_home_honours_the_environment(monkeypatch, tmp_path):
    from pastry import paths

    monkeypatch.setenv("PASTRY_HOME", str(tmp_path / "home"))
    assert paths.pastry_home() == tmp_path / "home"
    assert paths.programs_dir() == tmp_path / "home" / "programs"
    assert paths.pyrt_dir() == tmp_path / "home" / "pyrt"
    monkeypatch.delenv("PASTRY_HOME")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert paths.models_dir() == tmp_path / "xdg" / "pastry" / "models"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "user"))
    assert paths.pastry_home() == tmp_path / "user" / ".cache" / "pastry"
