#!/usr/bin/env bash
# Runs on a lent GPU machine (see README "GPU"): installs the carried wheels (./.wheels: transformers, fla, ...) and
# triton 3.7.1 if its parts were staged in /tmp/tri, then runs the named GPU steps, each under its own time limit,
# logging to $OUT/NN-<step>.log.   usage: benchmarks/gpu_suite.sh STEP[:SECONDS] ...
#   steps: tests, gpu-model-tests, dispatch, training, training-kda, generation, generation-kda, profile, profile-kda,
#   profile-decode, profile-flagships, verify-step, attention-step, decode-gemv, fp8-tests, fp8-linear, kimi-linear,
#   moe-blocks, two-gpu, two-gpu-checks, two-gpu-moe, gate-test, graph-tests, trace, trace-dynamic, mtp-acceptance,
#   loading, save-tuning (or any command, quoted: its log is named after it)
# SKIP_SETUP=1 skips the installs (for lanes started side by side on different GPUs after one set-up run).
# DRY_RUN=1 prints each step's command and runs nothing (no set-up either): a check of the step names, anywhere.
# Example call (two lanes, then the tuning cache saved): bash benchmarks/gpu_suite.sh; export DEADLINE=520;
#   CUDA_VISIBLE_DEVICES=0 SKIP_SETUP=1 bash benchmarks/gpu_suite.sh A B & CUDA_VISIBLE_DEVICES=1 SKIP_SETUP=1
#   bash benchmarks/gpu_suite.sh C; wait; SKIP_SETUP=1 bash benchmarks/gpu_suite.sh save-tuning
set -uo pipefail
# TRITON_CACHE_AUTOTUNING keeps fla's autotuning results in the cache (*.autotune.json): the `save-tuning` step packs
# them into $OUT/tuning.tgz; carried back as ./.tuning/tuning.tgz they spare a fresh machine the minutes of tuning.
export PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=/tmp/triton-cache TRITON_CACHE_AUTOTUNING=1
# this package's Triton kernels autotune only inside warm_up unless HYBRID_LINEAR_AUTOTUNE=1 (kernel_tuning): the
# benchmarks compare tuned kernels, so it is on here unless set (HYBRID_LINEAR_AUTOTUNE=0: what a process without
# warm_up runs, its kernels' default configurations)
export HYBRID_LINEAR_AUTOTUNE=${HYBRID_LINEAR_AUTOTUNE-1}
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
# Wheels go into /tmp/site (kept while the machine stays warm), ahead of the image's packages on PYTHONPATH.
SITE=/tmp/site
if [ -z "${SKIP_SETUP:-}${DRY_RUN:-}" ] && [ ! -f $SITE/.installed ]; then
  wheels=(.wheels/*.whl)
  if [ -d /tmp/tri ]; then
    wheel=/tmp/triton-3.7.1-cp312-cp312-manylinux_2_27_x86_64.manylinux_2_28_x86_64.whl
    cat /tmp/tri/tpart0 /tmp/tri/tpart1 /tmp/tri/tpart2 /tmp/tri/tpart3 > "$wheel" && wheels+=("$wheel")
  fi
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target $SITE "${wheels[@]}" \
    2>&1 | grep -v "root user" | tail -3 && touch $SITE/.installed
fi
# fla's and this package's autotuning results for the test and benchmark shapes (the FP8 flagship's included; fla
# 0.6.0, triton 3.7.1, H200) ship in the repository
# (benchmarks/tuning/), so a fresh machine runs `pytest -m gpu tests` without minutes of first-use tuning; a newer
# cache carried as the ignored ./.tuning/tuning.tgz (the `save-tuning` step's output) takes precedence.
TUNING=benchmarks/tuning/fla-0.6.0_triton-3.7.1_h200.tgz
[ -f .tuning/tuning.tgz ] && TUNING=.tuning/tuning.tgz
if [ -z "${DRY_RUN:-}" ] && [ -f $TUNING ] && [ ! -d $TRITON_CACHE_DIR ]; then mkdir -p $TRITON_CACHE_DIR && tar xzf $TUNING -C $TRITON_CACHE_DIR; fi
export PYTHONPATH=$SITE:$PWD
WORKERS=""
python3 -c "import xdist" 2>/dev/null && WORKERS="-n ${TEST_WORKERS:-8}"
[ -n "${DRY_RUN:-}" ] || python3 -c "import torch, triton, transformers, fla; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__, 'fla', fla.__version__, torch.cuda.get_device_name())"
# DEADLINE=seconds (counted from this script's start): every step's limit is cut so that all end by then,
# leaving a later `save-tuning` time to run inside the call's own limit.
START=$(date +%s)
for spec in "$@"; do
  # STEP:SECONDS splits at the last colon, and only before digits (a quoted command may hold colons of its own)
  step=$spec; limit=600
  if [[ $spec =~ ^(.*):([0-9]+)$ ]]; then step=${BASH_REMATCH[1]}; limit=${BASH_REMATCH[2]}; fi
  if [ -n "${DEADLINE:-}" ]; then
    left=$(( DEADLINE - ($(date +%s) - START) ))
    [ "$left" -lt 15 ] && { echo "=== $step skipped: deadline"; continue; }
    [ "$left" -lt "$limit" ] && limit=$left
  fi
  case $step in
    # 8 workers (pytest-xdist, in the GPU image) compile fla's kernels side by side on the 16 cores; every failure
    # is reported in full (-rfE), each result as it comes (-v: a run cut by its limit still says what passed), and
    # the slowest tests are listed, so a fresh machine's run shows where its time goes.
    tests) cmd="python3 -m pytest -v -m gpu tests -p no:cacheprovider -rfE --tb=short --durations=25 $WORKERS" ;;
    dispatch) cmd="python3 benchmarks/bench_delta_rule.py --gpu" ;;
    training) cmd="python3 benchmarks/bench_training.py --skip-kda --variants ours-logits-loss" ;;
    training-kda) cmd="python3 benchmarks/bench_training.py --skip-gdn --variants ours-logits-loss" ;;
    generation) cmd="python3 benchmarks/bench_generation.py --device cuda --skip-kda" ;;
    generation-kda) cmd="python3 benchmarks/bench_generation.py --device cuda --skip-gdn" ;;
    two-gpu) cmd="bash benchmarks/two_gpu_finetune.sh" ;;
    two-gpu-checks) cmd="env CHECKS_ONLY=1 bash benchmarks/two_gpu_finetune.sh" ;;
    two-gpu-moe) cmd="bash benchmarks/two_gpu_moe_parallel.sh" ;;  # MoE tensor- and expert-parallel checks, NCCL
    profile) cmd="python3 benchmarks/profile_gpu.py" ;;
    profile-decode) cmd="python3 benchmarks/profile_decode_step.py --trace $OUT --prefill 1024" ;;  # a replayed step, kernel by kernel
    profile-flagships) cmd="python3 benchmarks/profile_decode_step.py --models qwen3-next-fp8 kimi-48b --trace $OUT" ;;  # the flagships' layers, kernel by kernel
    verify-step) cmd="python3 benchmarks/bench_verify_step.py" ;;  # a speculative verify step of k tokens against a one-token step
    attention-step) cmd="python3 benchmarks/bench_attention_step.py" ;;  # the attention step at long caches: its split limit against 64 splits
    decode-gemv) cmd="python3 benchmarks/bench_decode_gemv.py" ;;  # each decoding GEMV on cuBLAS and on the Triton GEMV, against the bandwidth
    fp8-tests) cmd="python3 -m pytest -v -m gpu tests/test_kernels_fp8.py -p no:cacheprovider -rfE --tb=short" ;;  # the FP8 kernels at Qwen3-Next's shapes
    fp8-linear) cmd="python3 benchmarks/bench_fp8_linear.py" ;;  # the FP8 kernels against bf16 cuBLAS and the bandwidth
    kimi-linear) cmd="python3 benchmarks/bench_kimi_linear.py --repeats 2" ;;  # Kimi-Linear's training and decoding
    moe-blocks) cmd="python3 benchmarks/bench_moe.py --size gpu --skip-model" ;;  # MoE block, routing share
    profile-kda) cmd="python3 benchmarks/profile_gpu.py --kda" ;;
    trace) cmd="python3 benchmarks/bench_trace.py --device cuda" ;;  # 200 requests of distinct lengths, first calls timed
    trace-dynamic) cmd="python3 benchmarks/bench_trace.py --device cuda --cache dynamic" ;;
    mtp-acceptance) cmd="python3 benchmarks/bench_mtp_acceptance.py" ;;  # a small model trained here: MTP and prompt-lookup acceptance and speed
    loading) cmd="python3 benchmarks/bench_loading.py" ;;  # an FP8 Qwen3-Next folder of 8 layers from disk: streamed against mapped
    long-context) cmd="python3 benchmarks/bench_long_context.py --models gdn" ;;  # 32k..1M prompts: prefill, memory, decoding
    long-context-kda) cmd="python3 benchmarks/bench_long_context.py --models kda" ;;
    save-tuning) [ -n "${DRY_RUN:-}" ] && { echo "=== save-tuning: pack $TRITON_CACHE_DIR/**/*.autotune.json into $OUT/tuning.tgz"; continue; }
      (cd $TRITON_CACHE_DIR && find . -name "*.autotune.json" | tar czf "$OUT/tuning.tgz" -T -); ls -la "$OUT/tuning.tgz"; continue ;;
    graph-tests) cmd="python3 -m pytest -v -m gpu tests/test_gpu_model.py -k cuda_graph -p no:cacheprovider" ;;
    gate-test) cmd="python3 -m pytest -v -m gpu tests/test_ops_gpu.py -k fused_gate -p no:cacheprovider" ;;
    gpu-model-tests) cmd="python3 -m pytest -v -m gpu tests/test_gpu_model.py -p no:cacheprovider" ;;
    *) cmd="$step" ;;
  esac
  echo "=== $step ($limit s): $cmd"
  [ -n "${DRY_RUN:-}" ] && continue
  # a command as a step: a file name (numbered: two commands may start alike)
  STEP_NO=$(( ${STEP_NO:-0} + 1 ))
  log="$OUT/$(printf %02d-%s "$STEP_NO" "$step" | tr -c 'A-Za-z0-9._-' '_' | cut -c1-64).log"
  timeout "$limit" bash -c "$cmd" > "$log" 2>&1; echo "exit $?" >> "$log"  # (bash -c: quotes in a command step hold)
  grep -vE "Loading weights|it/s\]|Warning|warn" "$log" | tail -25
done
