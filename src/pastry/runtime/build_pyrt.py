"""Build the generic Python runtime component ("pyrt") once; cache it compiled.

``python -m pastry.runtime.build_pyrt`` (run by ``scripts/setup.sh``) stages the guest
(:mod:`pastry.runtime.guest.pyrt_app`) with the pure-Python SDK (``pastry.api``,
``pastry.sdk``, ``pastry.lang``), builds a component with componentize-py against
``wit/pastry.wit`` (world ``python-runtime``, generated from the table; CPython for WASI, its heap snapshotted after
importing the guest), compiles it with the sandbox's engine settings and serializes it to
``$PASTRY_HOME/pyrt/pyrt-<key>.cwasm``. The guest binds ``pastry.sdk`` to the imports
through the request table it is staged with (:mod:`pastry.api.guest`), so it checks
arguments before they reach the binding (an out-of-range value is an ``ApiError``, not a
trap). The key hashes every input (the WIT, the staged
sources, the componentize-py and wasmtime versions), so a changed SDK rebuilds and an
unchanged one loads in milliseconds (``Component.deserialize_file``).
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.metadata
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from pastry.paths import pyrt_dir

PKG = Path(__file__).resolve().parents[1]  # src/pastry
WIT = PKG.parents[1] / "wit" / "pastry.wit"
WORLD = "python-runtime"
# The host-independent parts of pastry the guest imports (relative to src/pastry).
GUEST_SOURCES = (
    "__init__.py",
    "api/__init__.py",
    "api/engines.py",
    "api/errors.py",
    "api/guest.py",
    "api/instance.py",
    "api/memory.py",
    "api/model.py",
    "api/sampling.py",
    "api/services.py",
    "api/surface.py",
    "api/table.py",
    "api/types.py",
    "sdk/__init__.py",
    "sdk/ahead.py",
    "sdk/args.py",
    "sdk/calls.py",
    "sdk/context.py",
    "sdk/current.py",
    "sdk/images.py",
    "sdk/pages.py",
    "sdk/router.py",
    "sdk/grammar.py",
    "sdk/interp_values.py",
    "sdk/interpreter.py",
    "sdk/sampling.py",
    "sdk/steps.py",
    "sdk/stop.py",
    "sdk/tools.py",
    "lang/__init__.py",
    "lang/choices.py",
    "lang/driver.py",
    "lang/expr.py",
    "lang/function.py",
    "lang/generation.py",
    "lang/inferlet.py",
    "lang/library.py",
    "lang/run.py",
    "lang/scoring.py",
    "lang/state.py",
    "lang/stream.py",
    "lang/template.py",
    "runtime/__init__.py",
    "runtime/guest/__init__.py",
    "runtime/guest/loop.py",
)
APP = PKG / "runtime" / "guest" / "pyrt_app.py"


class BuildError(RuntimeError):
    """The runtime could not be built (componentize-py missing or failing)."""


def cache_dir() -> Path:
    return pyrt_dir()


def build_key() -> str:
    h = hashlib.sha256()
    for path in (WIT, APP, *(PKG / s for s in GUEST_SOURCES)):
        h.update(str(path.relative_to(PKG.parents[1])).encode())
        h.update(path.read_bytes())
    for dist in ("componentize-py", "wasmtime"):
        h.update(f"{dist}=={importlib.metadata.version(dist)}".encode())
    return h.hexdigest()[:16]


def cached_path() -> Path:
    return cache_dir() / f"pyrt-{build_key()}.cwasm"


def build(out: Path | None = None, verbose: bool = False) -> Path:
    """Build and compile pyrt; returns the ``.cwasm`` path (reused when up to date)."""
    from pastry.runtime.wasm_host import engine

    out = out or cached_path()
    if out.exists():
        return out
    exe = shutil.which("componentize-py", path=str(Path(sys.executable).parent))
    exe = exe or shutil.which("componentize-py")
    if exe is None:
        raise BuildError("componentize-py is not installed: pip install componentize-py")
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="pyrt-") as tmp:
        stage = Path(tmp) / "app"
        for rel in GUEST_SOURCES:
            dst = stage / "pastry" / rel
            dst.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(PKG / rel, dst)
        shutil.copy(APP, stage / "pyrt_app.py")
        wasm = Path(tmp) / "pyrt.wasm"
        t0 = time.perf_counter()
        cmd = [exe, "-d", str(WIT), "-w", WORLD, "componentize", "pyrt_app", "-p", str(stage)]
        proc = subprocess.run(
            [*cmd, "-o", str(wasm)], capture_output=True, text=True, cwd=tmp, env={"PATH": ""}
        )
        if proc.returncode != 0:
            raise BuildError(f"componentize-py failed:\n{proc.stdout}\n{proc.stderr}")
        t1 = time.perf_counter()
        from wasmtime.component import Component

        component = Component(engine(), wasm.read_bytes())
        part = out.with_suffix(".part")
        part.write_bytes(component.serialize())
        part.replace(out)
        if verbose:
            print(
                f"pyrt: componentize {t1 - t0:.1f} s ({wasm.stat().st_size / 2**20:.1f} MiB), "
                f"compile {time.perf_counter() - t1:.1f} s -> {out} "
                f"({out.stat().st_size / 2**20:.1f} MiB)"
            )
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, help="where to write the .cwasm (default: the cache)")
    p.add_argument("--force", action="store_true", help="rebuild even when cached")
    a = p.parse_args(argv)
    out = a.out or cached_path()
    if a.force:
        out.unlink(missing_ok=True)
    print(build(out, verbose=True))


if __name__ == "__main__":
    main()
