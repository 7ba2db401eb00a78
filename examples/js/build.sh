#!/usr/bin/env bash
# Build the JavaScript inferlets here into components (wit/pastry.wit, world `inferlet`)
# with componentize-qjs, installing it into $PASTRY_HOME/npm first if missing.
# Prints the cached .wasm paths. Same as: python -m pastry.runtime.build_js --install
set -euo pipefail
cd "$(dirname "$0")/../.."
exec python -m pastry.runtime.build_js --install "$@"
