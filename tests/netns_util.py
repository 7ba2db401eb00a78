"""Hosts for tests: Linux network namespaces joined by a bridge, each with its own address,
hostname and ``/dev/shm``.

:class:`Hosts` makes a *switch* namespace holding a bridge and, per host, a namespace
with a veth into the bridge and the address ``10.231.0.(10 + i)/24``. Nothing is created
outside these namespaces (no device, address or route of the machine's own), and
:meth:`Hosts.close` removes all of it, also when a test fails. A process runs on a host
with :meth:`Hosts.run`: in the host's network namespace, and in UTS and mount
namespaces of its own (the host's hostname, a private tmpfs ``/dev/shm``: engines on two
hosts cannot map each other's KV pools, as on two machines). :meth:`Hosts.call` runs a
function on a thread that entered a host's network namespace (a client on that host).
Where namespaces cannot be made (not Linux, not root, no ``ip`` / ``unshare``, a
sandbox that forbids them) :func:`hosts_or_skip` skips the test saying why.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from typing import Any

import pytest

SUBNET = "10.231.0"
_CLONE_NEWNET = 0x40000000


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True, timeout=30)


class Hosts:
    """``n`` hosts (``names``: ``h0``, ``h1``, ...; ``address(i)``) on one bridge."""

    def __init__(self, n: int) -> None:
        self.tag = "pt" + uuid.uuid4().hex[:6]  # namespace names unique to this run
        self.switch = f"{self.tag}-sw"
        self.names = [f"h{i}" for i in range(n)]
        self.namespaces = [f"{self.tag}-h{i}" for i in range(n)]
        self.procs: list[subprocess.Popen] = []
        self._made: list[str] = []
        try:
            self._make()
        except BaseException:
            self.close()
            raise

    def _make(self) -> None:
        sw = self.switch
        _ip("netns", "add", sw)
        self._made.append(sw)
        _ip("-n", sw, "link", "set", "lo", "up")
        _ip("-n", sw, "link", "add", "br0", "type", "bridge")
        _ip("-n", sw, "link", "set", "br0", "up")
        for i, ns in enumerate(self.namespaces):
            _ip("netns", "add", ns)
            self._made.append(ns)
            _ip("-n", ns, "link", "set", "lo", "up")
            _ip("-n", sw, "link", "add", f"p{i}", "type", "veth", "peer", "name", "eth0", "netns", ns)  # fmt: skip
            _ip("-n", sw, "link", "set", f"p{i}", "master", "br0", "up")
            _ip("-n", ns, "addr", "add", f"{self.address(i)}/24", "dev", "eth0")
            _ip("-n", ns, "link", "set", "eth0", "up")

    def address(self, i: int) -> str:
        return f"{SUBNET}.{10 + i}"

    def run(
        self, i: int, argv: Sequence[str], env: dict | None = None, **kw: Any
    ) -> subprocess.Popen:
        """Start ``argv`` on host ``i`` (its network, hostname and ``/dev/shm``)."""
        script = 'hostname "$0" && mount -t tmpfs -o size=1g tmpfs /dev/shm && exec "$@"'
        cmd = ["ip", "netns", "exec", self.namespaces[i], "unshare", "--uts", "--mount",
               "--propagation", "private", "sh", "-c", script, f"{self.tag}-{self.names[i]}",
               *argv]  # fmt: skip
        proc = subprocess.Popen(cmd, env=env, **kw)
        self.procs.append(proc)
        return proc

    def pids(self, i: int) -> list[int]:
        """Every process in host ``i``'s network namespace."""
        out = subprocess.run(["ip", "netns", "pids", self.namespaces[i]], capture_output=True,
                             text=True, timeout=30)  # fmt: skip
        return [int(p) for p in out.stdout.split()]

    def kill(self, i: int) -> None:
        """SIGKILL every process of host ``i`` (the host is lost), again until none is
        left: one that forked while the others were killed goes too."""
        for _ in range(50):
            pids = self.pids(i)
            if not pids:
                break
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            time.sleep(0.1)
        for p in self.procs:  # reap those that were on it (the others run on)
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(0.5)

    def cut(self, i: int, up: bool = False) -> None:
        """Cut host ``i``'s link to the bridge (``up``: mend it)."""
        _ip("-n", self.switch, "link", "set", f"p{i}", "up" if up else "down")

    def call(self, i: int, fn: Callable[..., Any], *args: Any) -> Any:
        """``fn(*args)`` on a thread inside host ``i``'s network namespace (its sockets
        are that host's); its result, or its exception raised here."""
        out: dict[str, Any] = {}

        def enter_and_run() -> None:
            try:
                libc = ctypes.CDLL(None, use_errno=True)
                fd = os.open(f"/run/netns/{self.namespaces[i]}", os.O_RDONLY)
                try:
                    if libc.setns(fd, _CLONE_NEWNET) != 0:
                        raise OSError(ctypes.get_errno(), "setns failed")
                finally:
                    os.close(fd)
                out["value"] = fn(*args)
            except BaseException as e:  # handed to the caller
                out["error"] = e

        t = threading.Thread(target=enter_and_run, name=f"in-{self.names[i]}")
        t.start()
        t.join()
        if "error" in out:
            raise out["error"]
        return out["value"]

    def close(self) -> None:
        """Stop every process started here and remove every namespace made here."""
        for i in range(len(self.namespaces)):
            if self.namespaces[i] in self._made:
                self.kill(i)
        for p in self.procs:
            if p.poll() is None:
                p.kill()
            p.wait(10)
        for ns in reversed(self._made):  # a host's veth goes with its namespace
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=30)
        self._made = []


def hosts_or_skip(n: int) -> Hosts:
    """:class:`Hosts`, or a skip naming what this machine lacks."""
    if not sys.platform.startswith("linux"):
        pytest.skip("hosts as network namespaces need Linux")
    if os.geteuid() != 0:
        pytest.skip("hosts as network namespaces need root (ip netns add)")
    for tool in ("ip", "unshare"):
        if shutil.which(tool) is None:
            pytest.skip(f"hosts as network namespaces need '{tool}' (iproute2, util-linux)")
    try:
        return Hosts(n)
    except subprocess.CalledProcessError as e:
        pytest.skip(f"cannot make network namespaces here: {' '.join(e.cmd)}: {e.stderr.strip()}")
