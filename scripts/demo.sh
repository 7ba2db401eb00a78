#!/usr/bin/env bash
# The main job: set up (scripts/setup.sh), start `pastry serve` on the embedded default
# model (created once in ~/.cache/pastry; random weights, so the text is gibberish, the
# machinery is real), run the built-in `text-completion` inferlet and the example
# examples/hello.py through it, then stop the server.
#
#   scripts/demo.sh [--model DIR] [other `pastry serve` options]
#
# The port is 8080 if free, else any free one; PASTRY_DEMO_PROMPT sets the prompt.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
. .venv/bin/activate

PORT=$(python - <<'EOF'
import socket
s = socket.socket()
try:
    s.bind(("127.0.0.1", 8080))
except OSError:
    s.bind(("127.0.0.1", 0))
print(s.getsockname()[1])
EOF
)
URL="http://127.0.0.1:$PORT"
LOG=$(mktemp -t pastry-serve.XXXXXX.log)

pastry serve --port "$PORT" "$@" >"$LOG" 2>&1 &
SERVER=$!
stop() {
  if kill -0 "$SERVER" 2>/dev/null; then
    kill -TERM "$SERVER" 2>/dev/null || true
    wait "$SERVER" 2>/dev/null || true
  fi
}
trap stop EXIT INT TERM

echo "== starting pastry serve on $URL (log: $LOG)"
if ! python - "$URL" "$SERVER" <<'EOF'
import json, os, sys, time, urllib.request
url, pid = sys.argv[1], int(sys.argv[2])
deadline = time.time() + 300
while time.time() < deadline:
    try:
        with urllib.request.urlopen(url + "/health", timeout=2) as r:
            print("== ready:", json.load(r))
            sys.exit(0)
    except OSError:
        try:
            os.kill(pid, 0)
        except OSError:
            sys.exit("the server exited during start-up")
        time.sleep(0.2)
sys.exit("the server did not answer /health within 300 s")
EOF
then
  cat "$LOG" >&2
  exit 1
fi
grep -E "model .* KV pages" "$LOG" | sed 's/^/   /' || true

echo "== pastry run text-completion --server $URL -- \"${PASTRY_DEMO_PROMPT:-Hello,}\""
pastry run text-completion --server "$URL" -- "${PASTRY_DEMO_PROMPT:-Hello,}"

echo "== pastry run examples/hello.py --server $URL -- Pastry   (uploaded, then launched)"
pastry run examples/hello.py --server "$URL" -- Pastry

echo "== pastry ls --server $URL"
pastry ls --server "$URL"

echo "== stopping the server"
stop
trap - EXIT INT TERM
rm -f "$LOG"
echo "== done"
