#!/usr/bin/env bash
# Issue 30's HTTP rows for servers of several trees in turn, on one GPU, at the server's defaults
# (random:phi-2 unless SHAPE says otherwise): bench.py --latency (a 24-token prompt alone, a
# 1,044-token prompt alone and sent again, then 63 sampled streams with and without such prompts
# arriving), one client for 512 tokens, then 64, 256 and 512 clients with distinct sampled
# prompts for 128 tokens. The client is this tree's bench.py for every server. First the GPU's
# copy bandwidth; after each server, the batch-1 decode limit it sets for the weights that server
# reported. A tree may be named twice (A B A) to see the drift between servers. From the
# repository root:
#   OUT=/tmp/ab bash tests/gpu/serve_ab.sh new=. old=/path/to/other/tree new=.
set -u
OUT=${OUT:?set OUT to a folder}
SHAPE=${SHAPE:-random:phi-2}
LEVELS=${LEVELS:-64 256 512}  # the distinct clients' levels
RUNS=${RUNS:-3}                # runs of each level, the first a warm-up
LATENCY=${LATENCY:-1}          # 0: no bench.py --latency and no one-client rows
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
# The copy bandwidth by check.py's copy_bandwidth (loaded by path: -P keeps this folder's
# kernels.py from shadowing the `kernels` package).
python3 -P -c '
import importlib.util, sys
spec = importlib.util.spec_from_file_location("gpu_check", "tests/gpu/check.py")
check = importlib.util.module_from_spec(spec)
spec.loader.exec_module(check)
copy = check.copy_bandwidth()
print(f"copy {copy / 1e12:.2f} TB/s", flush=True)
open(sys.argv[1] + "/copy_bytes_s", "w").write(str(copy))
' "$OUT"
port=8200
for pair in "$@"; do
  name=${pair%%=*}
  tree=${pair#*=}
  port=$((port + 1))
  log="$OUT/server-$name-$port.log"
  (cd "$tree" && PHI2_MODEL=$SHAPE LOG_DIR=/tmp/logs-$port PORT=$port exec python3 phi2_server.py) > "$log" 2>&1 &
  server=$!
  start=$SECONDS
  until curl -fs -o /dev/null "http://127.0.0.1:$port/ready"; do
    if [ $((SECONDS - start)) -gt 300 ] || ! kill -0 $server 2>/dev/null; then
      echo "$name: not ready"; tail -20 "$log"; kill $server 2>/dev/null; continue 2
    fi
    sleep 1
  done
  url=http://127.0.0.1:$port
  curl -fs "$url/model/info" > "$OUT/info-$name-$port.json"
  echo "== $name ($tree): ready after $((SECONDS - start)) s; $(python3 -c 'import json, sys; i = json.load(open(sys.argv[1])); print("max_batch", i.get("max_batch"), "kv_cache", i.get("kv_cache"))' "$OUT/info-$name-$port.json")"
  if [ "$LATENCY" = 1 ]; then
    python3 bench.py --url $url --latency --max-tokens 512 --json "$OUT/latency-$name-$port.json" | tail -5
    python3 bench.py --url $url --concurrency 1 --max-tokens 512 --runs 3 --label "$name" \
      --json "$OUT/one-$name-$port.json" | tail -1
  fi
  for clients in $LEVELS; do  # a level each, so that one level's failure leaves the others' rows
    python3 bench.py --url $url --distinct --concurrency $clients --max-tokens 128 --runs $RUNS --label "$name" \
      --json "$OUT/distinct-$name-$clients-$port.json" | tail -1
  done
  kill $server; wait $server
  # The batch-1 decode limit: one read of the weights a token at the copy bandwidth.
  python3 -c 'import json, sys; w = json.load(open(sys.argv[1]))["weight_bytes"]; c = float(open(sys.argv[2]).read()); print(f"batch-1 limit {c / w:.0f} tok/s for {w / 1e9:.2f} GB of weights")' \
    "$OUT/info-$name-$port.json" "$OUT/copy_bytes_s"
done
