#!/usr/bin/env bash
# Qualify a SGLang release (or image) with the capture plugin against a running capture server, in one command:
#   1. golden_check.py: the captured tensors against transformers (max relative error per layer, nearest layer);
#   2. the capture-protocol conformance suite (tests/conformance), value checks included;
#   3. the capture benchmark (bench/sglang_capture.py): capture direct and end to end, against SGLang's own prefill
#      when BASELINE_URL names a stock server of the same model.
#
#   scripts/sglang_qualify.sh URL MODEL_PATH [SHM_DIR]        or: make sglang-qualify SGLANG_URL=... SGLANG_MODEL=...
#
# MODEL_PATH is the served model's folder as seen here; SHM_DIR the server's shared directory as mounted here
# (without it the "shm" transport is skipped, and says so). Environment: PY (default .venv/bin/python),
# HF_DEVICE (where transformers computes the reference, default cpu), BASELINE_URL, BENCH_ARGS (more
# bench/sglang_capture.py arguments, e.g. "--prompts 48 --prompt-tokens 2048 --concurrency 8"), OUT (the report
# folder, default qualify-<time>). Exit status 0 only if all three passed.
set -uo pipefail
if [ $# -lt 2 ]; then sed -n '2,15p' "$0"; exit 2; fi
url=$1 model=$2 shm=${3:-}
PY=${PY:-.venv/bin/python}
OUT=${OUT:-qualify-$(date -u +%Y%m%d-%H%M%S)}
mkdir -p "$OUT"
declare -A result

"$PY" services/inference/sglang/golden_check.py --url "$url" --model-path "$model" --device "${HF_DEVICE:-cpu}" \
  2>&1 | tee "$OUT/golden_check.txt"
result[golden_check]=$([ "${PIPESTATUS[0]}" = 0 ] && echo pass || echo FAIL)

EAGLE3_CONFORMANCE_HF_DEVICE=${HF_DEVICE:-cpu} "$PY" -m pytest tests/conformance -v -rs -p no:cacheprovider \
  --inference-url "$url" --model-path "$model" ${shm:+--shm-dir "$shm"} --junitxml "$OUT/conformance.xml" \
  2>&1 | tee "$OUT/conformance.txt"
result[conformance]=$([ "${PIPESTATUS[0]}" = 0 ] && echo pass || echo FAIL)

# shellcheck disable=SC2086  # BENCH_ARGS is a list of arguments
"$PY" -m bench.sglang_capture --url "$url" --model "$model" ${shm:+--shm-dir "$shm"} \
  ${BASELINE_URL:+--baseline-url "$BASELINE_URL"} ${BENCH_ARGS:-} --json "$OUT/capture.json" 2>&1 | tee "$OUT/capture.txt"
result[capture_benchmark]=$([ "${PIPESTATUS[0]}" = 0 ] && echo pass || echo FAIL)

status=0
for step in golden_check conformance capture_benchmark; do
  echo "$step: ${result[$step]}"
  [ "${result[$step]}" = pass ] || status=1
done
echo "reports in $OUT/"
exit $status
