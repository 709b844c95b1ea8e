#!/usr/bin/env bash
# Qualify SGLang with the capture plugin on this GPU host, servers included (no container needed):
#   1. a stock `sglang.launch_server` with the plugin installed, checked by stock_check.py, then stopped;
#   2. the capture server through the plugin's launcher, against which scripts/sglang_qualify.sh runs (golden
#      check, conformance suite, capture benchmark, and the regeneration benchmark with REGEN_DATASET), then stopped.
#
#   scripts/sglang_qualify_launch.sh MODEL_PATH
#
# Needs SGLang and the plugin importable by PY, with the project's test dependencies (pytest, transformers).
# Environment: PY (default python3), SGLANG_ARGS (extra sglang.launch_server arguments of both servers, e.g.
# "--mem-fraction-static 0.3"), PORT (default 30000; the capture server takes PORT + 1), SHM_DIR (default
# /dev/shm/eagle3-qualify), OUT (default qualify-<time>), STOCK_CHECK (1; 0 skips step 1, e.g. for a second model
# of the same release), the capture server's EAGLE3_SGLANG_* settings
# (EAGLE3_SGLANG_DETERMINISTIC_INFERENCE defaults to 1 here: the suite's seeded-sampling check needs it), and what
# sglang_qualify.sh reads (HF_DEVICE, BENCH_ARGS, REGEN_DATASET, REGEN_ARGS). Exit status 0 only if all passed.
set -uo pipefail
if [ $# -lt 1 ]; then sed -n '2,15p' "$0"; exit 2; fi
model=$1
export PY=${PY:-python3}
export OUT=${OUT:-qualify-$(date -u +%Y%m%d-%H%M%S)}
PORT=${PORT:-30000}
SHM_DIR=${SHM_DIR:-/dev/shm/eagle3-qualify}
mkdir -p "$OUT" "$SHM_DIR"
read -r -a sglang_args <<< "${SGLANG_ARGS:-}"

wait_healthy() {  # PID PORT: 0 once /health answers 200; 1 if the server exits first, or after 900 s
  local deadline=$((SECONDS + 900))
  while [ $SECONDS -lt $deadline ]; do
    if ! kill -0 "$1" 2>/dev/null; then echo "the server on port $2 exited before it was healthy"; return 1; fi
    "$PY" -c "import sys, urllib.request
sys.exit(urllib.request.urlopen('http://127.0.0.1:$2/health', timeout=5).status != 200)" 2>/dev/null && return 0
    sleep 2
  done
  echo "the server on port $2 was not healthy after 900 s"
  return 1
}

pid=""
stop() {  # SIGTERM to the server's process group (SGLang's scheduler and detokenizer are children), SIGKILL after 60 s
  [ -n "$pid" ] || return 0
  kill -TERM -- "-$pid" 2>/dev/null
  for _ in $(seq 60); do
    kill -0 -- "-$pid" 2>/dev/null || break
    sleep 1
  done
  kill -KILL -- "-$pid" 2>/dev/null
  pid=""
}
# The servers run in sessions of their own, so a signal to this script's process group does not reach them.
trap stop EXIT
trap 'exit 143' TERM INT

# 1. Stock launch, the plugin loaded (SGLANG_PLUGINS unset): setsid gives the server a process group of its own.
stock="skipped (STOCK_CHECK=0)"
if [ "${STOCK_CHECK:-1}" = 1 ]; then
  setsid env -u SGLANG_PLUGINS "$PY" -m sglang.launch_server --model-path "$model" --host 127.0.0.1 --port "$PORT" \
    "${sglang_args[@]}" > "$OUT/stock_server.log" 2>&1 &
  pid=$!
  if wait_healthy "$pid" "$PORT"; then
    "$PY" services/inference/sglang/stock_check.py --url "http://127.0.0.1:$PORT" 2>&1 | tee "$OUT/stock_check.txt"
    stock=$([ "${PIPESTATUS[0]}" = 0 ] && echo pass || echo FAIL)
  else
    stock="FAIL (the stock server did not start: $OUT/stock_server.log)"
  fi
  stop
fi

# 2. The capture server, and the qualification against it.
capture_port=$((PORT + 1))
setsid env EAGLE3_MODEL_PATH="$model" EAGLE3_INFERENCE_HOST=127.0.0.1 EAGLE3_INFERENCE_PORT="$capture_port" \
  EAGLE3_SHM_DIR="$SHM_DIR" EAGLE3_SGLANG_DETERMINISTIC_INFERENCE="${EAGLE3_SGLANG_DETERMINISTIC_INFERENCE:-1}" \
  "$PY" -m eagle3_sglang_plugin.launch "${sglang_args[@]}" > "$OUT/capture_server.log" 2>&1 &
pid=$!
if wait_healthy "$pid" "$capture_port"; then
  scripts/sglang_qualify.sh "http://127.0.0.1:$capture_port" "$model" "$SHM_DIR"
  rc=$?
  qualify=$([ $rc = 0 ] && echo pass || echo FAIL)
else
  qualify="FAIL (the capture server did not start: $OUT/capture_server.log)"
fi
stop

echo "stock launch with the plugin installed: $stock"
echo "capture server qualification: $qualify"
[[ "$stock" != FAIL* ]] && [ "$qualify" = pass ]
exit $?
