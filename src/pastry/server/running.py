"""``RunningServer``: a server as its monitors see it (``/health``, ``/metrics``, the
release of what a lost engine held).

:class:`~pastry.server.service.PastryServer` is one. The monitors take this instead of the
server's class so that they sit below it: the server imports them (its engines'
supervisors count restarts on ``/metrics``), never the other way round.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from pastry.control.controller import Controller
    from pastry.runtime.trusted import TrustedRuntime


class RunningServer(Protocol):
    """The control layer and the runner of a server; both ``None`` until it has started."""

    @property
    def controller(self) -> Controller | None: ...

    @property
    def runtime(self) -> TrustedRuntime | None: ...
