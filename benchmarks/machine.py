"""The machine a benchmark ran on, as its results tables name it."""

from __future__ import annotations

import platform
from pathlib import Path

# Under a hypervisor the model name is often only the brand ("AMD EPYC"), and the project's
# machines have changed kind between sessions (Zen 4, Zen 5, an Intel Xeon with AMX): the
# family and model numbers, and the matrix extensions, tell them apart.
_FEATURES = ("avx512_bf16", "amx_bf16")


def cpu_name() -> str:
    """The CPU as ``lscpu`` names it, with its family / model numbers and bf16 / AMX
    extensions: e.g. "AMD EPYC (family 25 model 17; avx512_bf16)"; else the architecture."""
    try:
        info: dict[str, str] = {}
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            key = key.strip()
            if key in ("model name", "cpu family", "model", "flags") and key not in info:
                info[key] = value.strip()
            if not line.strip() and info:
                break  # the first processor's block is enough
    except OSError:
        info = {}
    name = info.get("model name")
    if not name:
        return platform.processor() or platform.machine()
    flags = set(info.get("flags", "").split())
    extras = [f for f in _FEATURES if f in flags]
    if "cpu family" in info and "model" in info:
        detail = f"family {info['cpu family']} model {info['model']}"
        return f"{name} ({'; '.join([detail, *extras])})"
    return name
