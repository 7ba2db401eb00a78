"""The ``pastry`` command line.

Commands are grouped (``pastry model create-tiny ...``). To add a command or group, write an
``add_*(subparsers)`` function that registers its parser with ``set_defaults(func=...)``,
where ``func(args) -> int`` is the exit status, and append it to :data:`COMMANDS`. Handlers
import what they need inside, so ``pastry --help`` stays fast. Each command lives in its own
module: ``cli_model`` (``pastry model ...``), ``cli_generate``, ``cli_serve``, ``cli_engine``,
``cli_client`` (``run``, ``attach``, ``ls``), ``cli_top``; what they share is in ``cli_common``.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence

from pastry import __version__
from pastry.cli_client import add_attach, add_ls, add_run
from pastry.cli_common import Subparsers, print_usage
from pastry.cli_engine import add_engine
from pastry.cli_generate import add_generate
from pastry.cli_model import add_model
from pastry.cli_serve import add_serve
from pastry.cli_top import add_top

COMMANDS: list[Callable[[Subparsers], None]] = [
    add_model,
    add_generate,
    add_serve,
    add_engine,
    add_run,
    add_attach,
    add_ls,
    add_top,
]


def build_parser() -> argparse.ArgumentParser:
    """The top-level parser with every group of :data:`COMMANDS`."""
    parser = argparse.ArgumentParser(
        prog="pastry", description="Pastry: a programmable LLM serving system."
    )
    parser.add_argument("--version", action="version", version=f"pastry {__version__}")
    parser.set_defaults(func=lambda args: print_usage(parser))
    subparsers = parser.add_subparsers(title="commands", metavar="COMMAND")
    for add in COMMANDS:
        add(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the CLI on ``argv`` (default ``sys.argv[1:]``) and return the exit status."""
    args = build_parser().parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    raise SystemExit(main())
