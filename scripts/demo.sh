#!/usr/bin/env bash
# The main job: set up (scripts/setup.sh, which also fetches the embedded default model,
# SmolLM2-135M-Instruct), start `pastry serve` on it, and show real behaviour through
# built-in inferlets: a chat answer, an answer constrained to a JSON schema, a beam search,
# then examples/hello.py uploaded (uploads run sandboxed); then stop the server.
#
#   scripts/demo.sh [--model DIR|FILE.gguf] [other `pastry serve` options]
#
# The port is 8080 if free, else any free one; PASTRY_DEMO_PROMPT sets the chat question.
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

QUESTION=${PASTRY_DEMO_PROMPT:-What is the capital of France?}
echo "== chat: pastry run chat -- \"$QUESTION\""
pastry run chat --server "$URL" -- "$QUESTION"
echo

echo "== an answer constrained to a JSON schema: pastry run constrained -- '{\"grammar\": {\"json_schema\": ...}, ...}'"
python - "$URL" <<'PY'
import json, subprocess, sys
schema = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "capital": {"type": "string"},
        "continent": {"enum": ["Africa", "Asia", "Europe", "North America", "South America",
                               "Oceania"]},
    },
    "required": ["name", "capital", "continent"],
}
question = "Describe France as JSON with its name, capital and continent."
prompt = f"<|im_start|>user\n{question}<|im_end|>\n<|im_start|>assistant\n"
args = {"prompt": prompt, "grammar": {"json_schema": schema}, "max_tokens": 48}
cmd = ["pastry", "run", "constrained", "--server", sys.argv[1], "--", json.dumps(args)]
result = json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout)
print("   question:", question)
print("   schema:  ", json.dumps(schema))
print("   answer:  ", result["text"], "(complete)" if result["complete"] else "(cut short)")
PY

echo "== beam search, 3 beams: pastry run beam-search -- '{\"prompt\": \"The three primary colors are\", ...}'"
python - "$URL" <<'PY'
import json, subprocess, sys
args = {"prompt": "The three primary colors are", "width": 3, "max_tokens": 10}
cmd = ["pastry", "run", "beam-search", "--server", sys.argv[1], "--", json.dumps(args)]
for beam in json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout)["beams"]:
    print(f"   log-prob {beam['logprob']:6.2f}: {json.dumps(args['prompt'] + beam['text'])}")
PY

echo "== pastry run examples/hello.py --server $URL -- Pastry   (uploaded: it runs sandboxed)"
pastry run examples/hello.py --server "$URL" -- Pastry
echo

echo "== pastry ls --server $URL"
pastry ls --server "$URL"

echo "== stopping the server"
stop
trap - EXIT INT TERM
rm -f "$LOG"
echo "== done"
