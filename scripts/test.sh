#!/usr/bin/env bash
# Set up (scripts/setup.sh) and run the default test suite. Extra arguments go to pytest,
# e.g. `scripts/test.sh -m slow` for the slow tests, `-m cuda` on a GPU machine.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
. .venv/bin/activate
ruff check src tests benchmarks
ruff format --check src tests benchmarks
# The dashboard's page tests run in headless Chromium (tests/test_dashboard_browser.py,
# skipped without it): Debian's package, installed where this user can.
if ! command -v chromium >/dev/null && command -v apt-get >/dev/null && [ "$(id -u)" = 0 ]; then
  { apt-get install -y -q chromium || { apt-get update -q && apt-get install -y -q chromium; }; } \
    >/tmp/pastry-chromium-install.log 2>&1 \
    || echo "chromium could not be installed (/tmp/pastry-chromium-install.log): the browser tests are skipped"
fi
python -m pytest -q "$@"
