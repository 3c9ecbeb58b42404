#!/usr/bin/env bash
# A change that must not change behaviour (a restructure, issue 52), on one CUDA machine: this
# tree's correctness checks, then its speed against another tree's in the same run. From the
# repository root:
#   OUT=/tmp/same PART=check bash tests/gpu/same_as.sh            # correctness only (~6 min, H100)
#   OUT=/tmp/same PART=speed bash tests/gpu/same_as.sh .abtree    # speed: .abtree, this tree, again
#   (SERVE=0: without the HTTP rows)
# check: the Triton kernels against torch (decode_attention.py), Phi-2's fast path against
# transformers and batched against alone (check.py parity), each tiny family likewise
# (families.py parity), tool calls through the server (tool_calls.py), and check.py's constrained
# section (its own process, failing loudly). speed: host_profile.py's batch-1 and 64-row greedy
# step in process, old, new, old, new; then serve_ab.sh's HTTP rows for old, new, old at 64 clients.
# (-P: this folder's kernels.py would shadow the `kernels` package transformers may import.)
set -u
OUT=${OUT:?set OUT to a folder}
PART=${PART:-check}
OLD=${1:-}
mkdir -p "$OUT"
failed=()
run() {  # run NAME CMD...: the command's output in $OUT/NAME.log; its failure is remembered
  local name=$1
  shift
  echo "== $name: $*"
  if ! "$@" > "$OUT/$name.log" 2>&1; then failed+=("$name"); echo "!! $name failed"; fi
  tail -4 "$OUT/$name.log"
}
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
if [ "$PART" = check ]; then
  run kernels python3 -P tests/gpu/decode_attention.py
  run parity python3 -P tests/gpu/check.py --only parity --out "$OUT/check"
  run families python3 -P tests/gpu/families.py --only parity --no-serve --out "$OUT/families"
  run tool_calls python3 -P tests/gpu/tool_calls.py
  run constrained python3 -P tests/gpu/check.py --only constrained --out "$OUT/constrained"
else
  : "${OLD:?name the other tree: bash tests/gpu/same_as.sh DIR}"
  for tree in "$OLD" . "$OLD" .; do
    name=$( [ "$tree" = . ] && echo new || echo old )
    (cd "$tree" && python3 -P tests/gpu/host_profile.py --rows 1,64 --tokens 128 --modes greedy \
      --out "$OUT/profile-$name") > "$OUT/profile-$name.log" 2>&1 || failed+=("profile-$name")
    echo "== host_profile $name"; grep -E "ms a step" "$OUT/profile-$name.log"
  done
  if [ "${SERVE:-1}" = 1 ]; then  # SERVE=0: the in-process rows only
    OUT=$OUT/serve LEVELS=64 RUNS=3 LATENCY=0 bash tests/gpu/serve_ab.sh old="$OLD" new=. old="$OLD" \
      || failed+=("serve_ab")
  fi
fi
if [ ${#failed[@]} -gt 0 ]; then echo "FAILED: ${failed[*]}"; exit 1; fi
echo "all ok"
