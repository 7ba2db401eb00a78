"""The server process does not load torch (the engine runs in its own process)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

SRC = str(Path(__file__).resolve().parents[1] / "src")

# What `pastry serve` imports in the server process (the engine process imports the rest),
# the engine-side modules the control layer reads checkpoints with, and (below) every module
# of pastry.wire, the boundary both sides share.
TORCH_FREE = (
    "pastry.server.app",
    "pastry.cli",
    "pastry.paths",
    "pastry.engine.serve",
    "pastry.engine.checkpoint",
    "pastry.engine.hf_checkpoint",
    "pastry.engine.gguf",
    "pastry.engine.default_model",
    "pastry.runtime.wasm",
)
WIRE = sorted(f"pastry.wire.{p.stem}" for p in (Path(SRC) / "pastry" / "wire").glob("*.py"))


def _heavy_imports(modules) -> subprocess.CompletedProcess:
    """Import ``modules`` in a fresh interpreter; it fails naming torch (or transformers)
    if any of them brought it in."""
    code = (
        f"import sys; import {', '.join(modules)}; "
        "heavy = sorted(m for m in ('torch', 'transformers', 'safetensors.torch') "
        "if m in sys.modules); "
        "assert not heavy, f'imported {heavy}'"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([SRC, os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)


def test_the_server_process_does_not_import_torch():
    proc = _heavy_imports(TORCH_FREE)
    assert proc.returncode == 0, proc.stderr


def test_the_wire_package_is_torch_free():
    """Every module of the server/engine boundary imports without torch (a module that
    needs torch belongs to pastry.engine)."""
    assert "pastry.wire.calls" in WIRE and "pastry.wire.__init__" in WIRE and len(WIRE) >= 10
    proc = _heavy_imports([m.removesuffix(".__init__") for m in WIRE])
    assert proc.returncode == 0, proc.stderr
    probe = _heavy_imports(["pastry.engine.pool"])  # the check sees torch where it is
    assert probe.returncode != 0 and "torch" in probe.stderr


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
