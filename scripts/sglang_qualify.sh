#!/usr/bin/env bash
# Qualify a SGLang release (or image) with the capture plugin against running servers, in one command:
#   1. stock_check.py (with STOCK_URL): a stock launch where the plugin is installed stays stock SGLang (warm-up,
#      plain requests) and answers capture requests 503;
#   2. golden_check.py: the captured tensors against transformers (max relative error per layer, nearest layer);
#   3. the capture-protocol conformance suite (tests/conformance), value checks included;
#   4. the capture benchmark (bench/sglang_capture.py): capture direct and end to end, against SGLang's own prefill
#      when BASELINE_URL names a stock server of the same model;
#   5. the regeneration benchmark (bench/sglang_regenerate.py, with REGEN_DATASET): a regenerate job's decoding
#      against SGLang's own, and whether two seeded sampled runs regenerate the same conversations.
#
#   scripts/sglang_qualify.sh URL MODEL_PATH [SHM_DIR]        or: make sglang-qualify SGLANG_URL=... SGLANG_MODEL=...
#
# URL is the capture server (the plugin's launcher or container). MODEL_PATH is the served model's folder as seen
# here; SHM_DIR the server's shared directory as mounted here (without it the "shm" transport is skipped, and says
# so). The suite's seeded-sampling check passes only on a server launched with --enable-deterministic-inference
# (EAGLE3_SGLANG_DETERMINISTIC_INFERENCE=1). Environment: PY (default .venv/bin/python), HF_DEVICE (where
# transformers computes the reference, default cpu), STOCK_URL, BASELINE_URL, BENCH_ARGS (more
# bench/sglang_capture.py arguments, e.g. "--prompts 48 --prompt-tokens 2048 --concurrency 8"), REGEN_DATASET (an
# OpenAI-messages JSONL), REGEN_ARGS (more bench/sglang_regenerate.py arguments), OUT (the report folder, default
# qualify-<time>). Exit status 0 only if every step that ran passed.
set -uo pipefail
if [ $# -lt 2 ]; then sed -n '2,21p' "$0"; exit 2; fi
url=$1 model=$2 shm=${3:-}
PY=${PY:-.venv/bin/python}
OUT=${OUT:-qualify-$(date -u +%Y%m%d-%H%M%S)}
mkdir -p "$OUT"
steps=(stock_check golden_check conformance capture_benchmark regeneration_benchmark)
declare -A result

if [ -n "${STOCK_URL:-}" ]; then
  "$PY" services/inference/sglang/stock_check.py --url "$STOCK_URL" 2>&1 | tee "$OUT/stock_check.txt"
  result[stock_check]=$([ "${PIPESTATUS[0]}" = 0 ] && echo pass || echo FAIL)
else
  result[stock_check]="skipped (no STOCK_URL)"
fi

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

if [ -n "${REGEN_DATASET:-}" ]; then
  # shellcheck disable=SC2086  # REGEN_ARGS is a list of arguments
  "$PY" -m bench.sglang_regenerate --url "$url" --model-path "$model" --dataset "$REGEN_DATASET" ${REGEN_ARGS:-} \
    --json "$OUT/regeneration.json" 2>&1 | tee "$OUT/regeneration.txt"
  result[regeneration_benchmark]=$([ "${PIPESTATUS[0]}" = 0 ] && echo pass || echo FAIL)
else
  result[regeneration_benchmark]="skipped (no REGEN_DATASET)"
fi

status=0
for step in "${steps[@]}"; do
  echo "$step: ${result[$step]}"
  [ "${result[$step]}" = FAIL ] && status=1
done
echo "reports in $OUT/"
exit $status
