#!/usr/bin/env bash
# One replica per GPU on a machine with two, against one replica, in the same run (Phi-2's
# architecture, random weights, bfloat16): bench.py with 64 clients on replica 0 alone, then
# 64 clients on each replica at once (two bench.py processes: a client that spreads its
# requests itself; no HAProxy on that machine). From the repository root, with OUT set to a
# folder for the logs and numbers:  OUT=/tmp/two bash tests/gpu/two_replicas.sh
set -u
OUT=${OUT:?set OUT to a folder}
mkdir -p "$OUT"
# The device machines lack llguidance: a wheel carried in .device/ is installed if present.
ls .device/llguidance-*.whl >/dev/null 2>&1 && python3 -m pip install -q --no-index --no-deps .device/llguidance-*.whl
nvidia-smi --query-gpu=index,name --format=csv,noheader
for g in 0 1; do
  CUDA_VISIBLE_DEVICES=$g PHI2_MODEL=random:phi-2 MAX_BATCH=64 MAX_QUEUE=256 PORT=810$g LOG_DIR=/tmp/logs$g ADAPTER_PATH= \
    python3 phi2_server.py > "$OUT/server$g.log" 2>&1 &
  SERVERS="${SERVERS:-} $!"
done
start=$SECONDS
for g in 0 1; do
  until curl -fs -o /dev/null "http://127.0.0.1:810$g/ready"; do
    [ $((SECONDS - start)) -gt 420 ] && { echo "replica $g not ready"; tail -5 "$OUT/server$g.log"; exit 1; }
    sleep 2
  done
done
echo "both replicas ready after $((SECONDS - start)) s"
python3 bench.py --url http://127.0.0.1:8100 --concurrency 64 --max-tokens 128 --runs 3 --label "one replica" --json "$OUT/one.json" | tail -4
python3 bench.py --url http://127.0.0.1:8100 --concurrency 64 --max-tokens 128 --runs 3 --label "replica 0 of 2" --json "$OUT/two_a.json" > "$OUT/two_a.txt" &
PA=$!
python3 bench.py --url http://127.0.0.1:8101 --concurrency 64 --max-tokens 128 --runs 3 --label "replica 1 of 2" --json "$OUT/two_b.json" > "$OUT/two_b.txt" &
PB=$!
wait $PA $PB
tail -3 "$OUT/two_a.txt"; tail -3 "$OUT/two_b.txt"
python3 - "$OUT" <<'PY'
import json, sys
out = sys.argv[1]
one = json.load(open(f"{out}/one.json"))["rows"][0]["aggregate_tok_s"]
a = json.load(open(f"{out}/two_a.json"))["rows"][0]["aggregate_tok_s"]
b = json.load(open(f"{out}/two_b.json"))["rows"][0]["aggregate_tok_s"]
print(f"one replica, 64 clients: {one:.0f} tok/s; two replicas, 64 clients each: {a:.0f} + {b:.0f} = {a + b:.0f} tok/s; ratio {(a + b) / one:.2f}")
PY
kill $SERVERS 2>/dev/null
