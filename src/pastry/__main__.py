"""``python -m pastry``: the command line (see :mod:`pastry.cli`)."""

from pastry.cli import main

raise SystemExit(main())
