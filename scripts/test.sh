#!/usr/bin/env bash
# Set up (scripts/setup.sh) and run the default test suite. Extra arguments go to pytest,
# e.g. `scripts/test.sh -m slow` for the slow tests, `-m cuda` on a GPU machine.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
. .venv/bin/activate
ruff check src tests benchmarks
ruff format --check src tests benchmarks
python -m pytest -q "$@"
