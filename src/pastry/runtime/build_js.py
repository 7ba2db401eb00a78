"""Build a JavaScript inferlet into a WebAssembly component with componentize-qjs.

The source (an ES module importing ``pastry:inferlet/api@0.1.0`` and exporting
``run(args)``, e.g. ``examples/js/greedy.js``) is built against ``wit/pastry.wit``, world
``inferlet``, with ``--sync --stub-wasi`` (no component-model async ABI, no WASI imports),
and cached as ``$PASTRY_HOME/jswasm/<stem>-<key>.wasm``; the key hashes the WIT, the
source and the tool version. Run it with :func:`pastry.runtime.wasm.component_program`.

componentize-qjs is an npm package whose native binding (a prebuilt platform package,
installed with it) embeds QuickJS; it downloads nothing when it runs. It is looked up in
``$PASTRY_HOME/npm`` (``python -m pastry.runtime.build_js --install`` puts it there with
``npm install --prefix``), then on ``PATH``.

``python -m pastry.runtime.build_js [--install] [SOURCE.js ...]`` builds (default: the
examples) and prints the paths.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import subprocess
from pathlib import Path

from pastry.paths import jswasm_dir, npm_dir

REPO = Path(__file__).resolve().parents[3]
WIT = REPO / "wit" / "pastry.wit"
WORLD = "inferlet"
VERSION = "0.4.5"  # componentize-qjs, as measured in docs (wasm-sandbox-measurements §B)
FLAGS = ("--sync", "--stub-wasi")


class BuildError(RuntimeError):
    """componentize-qjs is missing or failed."""


def npm_prefix() -> Path:
    return npm_dir()


def tool() -> Path | None:
    """The componentize-qjs executable, or None."""
    local = npm_prefix() / "node_modules" / ".bin" / "componentize-qjs"
    if local.exists():
        return local
    found = shutil.which("componentize-qjs")
    return Path(found) if found else None


def tool_version(exe: Path) -> str:
    pkg = exe.resolve().parents[1] / "package.json"  # node_modules/componentize-qjs/bin/...
    if pkg.exists():
        import json

        return json.loads(pkg.read_text()).get("version", "?")
    return "?"


def install(version: str = VERSION, timeout: float = 300) -> Path:
    """``npm install --prefix $PASTRY_HOME/npm componentize-qjs@<version>``."""
    npm = shutil.which("npm")
    if npm is None:
        raise BuildError("npm is not installed")
    prefix = npm_prefix()
    prefix.mkdir(parents=True, exist_ok=True)
    cmd = [npm, "install", "--no-audit", "--no-fund", "--prefix", str(prefix),
           f"componentize-qjs@{version}"]  # fmt: skip
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        raise BuildError(f"{' '.join(cmd)} timed out after {timeout:g} s") from None
    exe = tool()
    if r.returncode != 0 or exe is None:
        raise BuildError(f"{' '.join(cmd)} failed ({r.returncode}):\n{r.stderr[-2000:]}")
    return exe


def build(source, *, install_missing: bool = False, cache_dir: Path | None = None) -> Path:
    """Build ``source`` (a .js file) into a component; returns the cached ``.wasm`` path."""
    source = Path(source)
    exe = tool()
    if exe is None:
        if not install_missing:
            raise BuildError(
                "componentize-qjs is not installed: run `python -m pastry.runtime.build_js "
                "--install` (npm install --prefix $PASTRY_HOME/npm componentize-qjs)"
            )
        exe = install()
    h = hashlib.sha256()
    for part in (WIT.read_bytes(), source.read_bytes(), WORLD.encode(), " ".join(FLAGS).encode(),
                 tool_version(exe).encode()):  # fmt: skip
        h.update(part + b"\0")
    cache = cache_dir or jswasm_dir()
    out = cache / f"{source.stem}-{h.hexdigest()[:16]}.wasm"
    if out.exists():
        return out
    cache.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(f".{os.getpid()}.tmp.wasm")
    cmd = [str(exe), "--wit", str(WIT), "--world", WORLD, "--js", str(source), *FLAGS,
           "-o", str(tmp)]  # fmt: skip
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise BuildError(f"componentize-qjs could not run: {e}") from None
    if r.returncode != 0 or not tmp.exists():
        tmp.unlink(missing_ok=True)
        raise BuildError(f"componentize-qjs failed ({r.returncode}):\n{r.stderr or r.stdout}")
    tmp.replace(out)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("sources", nargs="*", type=Path)
    ap.add_argument("--install", action="store_true", help="npm-install componentize-qjs first")
    a = ap.parse_args()
    if a.install and tool() is None:
        print(install())
    for src in a.sources or sorted((REPO / "examples" / "js").glob("*.js")):
        print(build(src))


if __name__ == "__main__":
    main()
