"""``pastry top``: the dashboard's live view in a terminal (``docs/dashboard.md``).

Reads ``GET /dashboard/state`` once a second (``--interval``) and draws, with ``rich``: the
engines (state, a KV bar of pages by owner, tokens/s, batch size, step time, TTFT and ITL)
and the programs, the most served first. ``--once`` prints one frame and exits (for
scripts and for a terminal that is not one).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

from pastry.cli_common import Subparsers

BAR = 40  # characters of a KV bar
KV_COLORS = {"programs": "red", "cache": "yellow", "free": "green"}


def add_top(sub: Subparsers) -> None:
    p = sub.add_parser(
        "top", help="watch a server's programs, KV memory and engines live (the dashboard, "
        "in the terminal)",
    )  # fmt: skip
    p.add_argument("--server", default="http://127.0.0.1:8080", help="server URL")
    p.add_argument(
        "--token", default=os.environ.get("PASTRY_AUTH_TOKEN") or None,
        help="bearer token (default: $PASTRY_AUTH_TOKEN)",
    )  # fmt: skip
    p.add_argument(
        "--interval", type=float, default=1.0, metavar="S", help="seconds between frames"
    )
    p.add_argument("--once", action="store_true", help="print one frame and exit")
    p.set_defaults(func=_top)


class TopError(Exception):
    pass


def fetch(server: str, token: str | None, timeout: float = 10) -> dict:
    """One snapshot of ``/dashboard/state``; :class:`TopError` says why not."""
    import urllib.error
    import urllib.request

    req = urllib.request.Request(server.rstrip("/") + "/dashboard/state")
    if token:
        req.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return json.load(r)
    except urllib.error.HTTPError as e:
        if e.code == 401:
            raise TopError(f"{server} wants a token (--token or $PASTRY_AUTH_TOKEN)") from None
        raise TopError(f"{server} answered {e.code}: {e.read()[:200]!r}") from None
    except (urllib.error.URLError, OSError) as e:
        raise TopError(f"cannot reach {server}: {getattr(e, 'reason', e)}") from None


def render(snap: dict):
    """The frame for ``snap``: a rich renderable."""
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text

    c = snap["counts"]
    head = Text.assemble(
        ("pastry top ", "bold"), f"{snap['user']}{' (operator)' if snap['operator'] else ''}  ",
        f"programs {c['total']} (running {c['running']}, waiting {c['waiting']}, "
        f"swapped {c['swapped']})  router {snap['router']['name']}",
    )  # fmt: skip
    engines = Table(box=None, pad_edge=False, header_style="dim")
    for col in ("engine", "state", "KV pages: programs / cache / free", "", "tok/s", "batch",
                "step", "TTFT p50/p99", "ITL p50/p99"):  # fmt: skip
        engines.add_column(col)
    for e in snap["engines"]:
        p = e["points"][-1] if e["points"] else None
        if p is None:
            engines.add_row(e["name"], e["state"], "(no sample yet)")
            continue
        kv = p["kv"]
        engines.add_row(
            e["name"], e["state"], kv_bar(kv),
            f"{kv['programs']}/{kv['cache']}/{kv['free']} of {kv['total']}"
            + (f", {p['host']['swapped']} on host" if p["host"]["swapped"] else ""),
            f"{p['tokens_s']:.1f}", f"{p['batch']:.1f}", _ms(p["step_ms"]),
            f"{_ms(p['ttft_p50_ms'])}/{_ms(p['ttft_p99_ms'])}",
            f"{_ms(p['itl_p50_ms'])}/{_ms(p['itl_p99_ms'])}",
        )  # fmt: skip
    programs = Table(header_style="dim", expand=False)
    for col in ("id", "program", "user", "runtime", "age", "tokens", "level", "service",
                "pages", "state"):  # fmt: skip
        programs.add_column(
            col, justify="right" if col in ("age", "tokens", "pages") else "left", no_wrap=True
        )
    for r in snap["programs"]:  # the server sends them most served first
        programs.add_row(
            str(r["id"]), r["name"], r["user"], r["runtime"], _age(r["age_s"]), str(r["tokens"]),
            "-" if r["level"] is None else str(r["level"]), f"{1000 * r['service_s']:.1f} ms",
            str(r["pages"]), r["state"],
        )  # fmt: skip
    shown = len(snap["programs"])
    note = Text(f"the {shown} most served of {c['total']}", style="dim") if c["total"] > shown else Text("")  # fmt: skip
    return Group(head, engines, programs, note)


def kv_bar(kv: dict) -> object:
    """A bar of ``BAR`` cells: programs' pages, the prefix cache's, free ones."""
    from rich.text import Text

    total = max(kv["total"], 1)
    bar = Text()
    used = 0
    for owner, color in KV_COLORS.items():
        cells = round(BAR * kv[owner] / total) if owner != "free" else BAR - used
        cells = max(0, min(cells, BAR - used))
        bar.append("█" * cells if owner != "free" else "░" * cells, style=color)
        used += cells
    return bar


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{x:.1f}ms"


def _age(s: float) -> str:
    return f"{s:.0f}s" if s < 60 else f"{s / 60:.1f}m" if s < 3600 else f"{s / 3600:.1f}h"


def _top(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.live import Live

    console = Console(width=None if sys.stdout.isatty() else 200)  # a pipe: no squeezing
    try:
        snap = fetch(args.server, args.token)
        if args.once:
            console.print(render(snap))
            return 0
        with Live(render(snap), console=console, refresh_per_second=4, screen=False) as live:
            while True:
                time.sleep(args.interval)
                try:
                    live.update(render(fetch(args.server, args.token)))
                except TopError as e:  # the server went away: say so, keep trying
                    from rich.text import Text

                    live.update(Text(f"{e}; retrying", style="red"))
    except TopError as e:
        print(f"pastry top: {e}")
        return 1
    except KeyboardInterrupt:
        return 0
