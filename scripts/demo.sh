#!/usr/bin/env bash
# Set up (scripts/setup.sh) and run the main job: an engine process on the embedded default
# model (created once in ~/.cache/pastry), driven through its batch API to generate text.
# Pass --model DIR to use a real Hugging Face checkpoint; other arguments go to
# `pastry generate` (see `pastry generate --help`).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
. .venv/bin/activate
if [ "$#" -eq 0 ]; then
  set -- "Hello," "The meaning of life is" --max-tokens 24
fi
pastry generate "$@"
