#!/usr/bin/env bash
# One command for the GPU machine, from the repository root, in about 10 minutes at most (each step has its own
# timeout, 590 s in all; on an H200 the steps took 75, 85, 62, 61, 38, 124 and 62 s):
# the CUDA tests, then every target of the GPU path (H100, bf16, 32 clients × 5 steps × 4 GSM8K examples; one at a
# time and plain peft over 8 of them), and a profile breakdown of a cohort of 8 (the slowest operations, and what
# makes the host wait, by caller). A failing or timed-out step is reported and the rest goes on. Writes to $OUT
# (default bench_out/check):
#   gpu_check.md     one Markdown table: target, measured, holds? (each step's status too)
#   gpu_check.jsonl  a JSON line per figure and per target
#   check.log        every step's output;  steps.tsv: name, exit status, seconds;  raw/: bench_gpu's own files
# Needs what benchmarks/gpu_bundle.sh put in bench_out/ (carry it): wheels, SmolLM2's tokenizer, a GSM8K sample.
#   bash benchmarks/gpu_check.sh          on the GPU machine
#   bash benchmarks/gpu_check.sh --dry    on the CPU: every step on tiny models in seconds (CI runs it)
#   ONLY="cuda-tests 1b-cohort" bash benchmarks/gpu_check.sh    only the steps named (a rerun in less time)
set -u
DRY=0
[ "${1:-}" = "--dry" ] && DRY=1
PY=${PYTHON:-python3}
BUNDLE=${BUNDLE_DIR:-bench_out}
OUT=${OUT:-$BUNDLE/check}
mkdir -p "$OUT/raw"
: > "$OUT/steps.tsv"
: > "$OUT/check.log"
rm -f "$OUT/raw/bench_gpu.jsonl"
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}

step() {  # step NAME SECONDS COMMAND...: run it with its own timeout, log it, record its exit status
  local name=$1 limit=$2 t0 rc
  shift 2
  [ -n "${ONLY:-}" ] && [[ " $ONLY " != *" $name "* ]] && return
  echo "=== $name (timeout ${limit} s): $*" >> "$OUT/check.log"
  t0=$(date +%s)
  timeout "$limit" "$@" >> "$OUT/check.log" 2>&1
  rc=$?
  printf '%s\t%s\t%s\n' "$name" "$rc" "$(( $(date +%s) - t0 ))" >> "$OUT/steps.tsv"
  echo "$name: exit $rc"
}

if [ "$DRY" = 1 ]; then
  export PYTHONPATH=src${PYTHONPATH:+:$PYTHONPATH}
  TESTS=(-k "bf16_on_cuda" tests/test_device.py)  # collected, skipped without CUDA
  B=("$PY" benchmarks/bench_gpu.py --device cpu --source arithmetic --max-length 256 --clients 2 --steps 1
     --batch 1 --rounds 1 --no-profile)
  SMOL=tiny-llama BIG=tiny-llama COMPILED=one FEW=2 LIMIT=120
else
  site=/tmp/gpu_check_site
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" \
    "$BUNDLE"/whl/*.whl >> "$OUT/check.log" 2>&1 || echo "wheels: install failed (see check.log)"
  mkdir -p /tmp/gpu_check && tar -xzf "$BUNDLE/smollm2-tokenizer.tar.gz" -C /tmp/gpu_check
  export PYTHONPATH=$site:$BUNDLE/minilm-tokenizer:src${PYTHONPATH:+:$PYTHONPATH}
  TESTS=(-k "cuda" tests/test_gpu_path.py tests/test_device.py tests/test_cohort.py)
  B=("$PY" benchmarks/bench_gpu.py --tokenizer /tmp/gpu_check/smollm2-tokenizer --data "$BUNDLE/gsm8k"
     --rounds 1)
  SMOL=smollm2-135m BIG=llama-3.2-1b COMPILED=one-compiled FEW=8 LIMIT=0
fi
lim() { [ "$LIMIT" = 0 ] && echo "$1" || echo "$LIMIT"; }  # dry: one generous limit for every step
RAW=(--out "$OUT/raw")  # the figures the table reads; the breakdown's cohort of $FEW only prints to check.log

step cuda-tests "$(lim 90)" "$PY" -m pytest -q -p no:cacheprovider "${TESTS[@]}"
step smollm2-bf16-cohort "$(lim 100)" "${B[@]}" "${RAW[@]}" --models "$SMOL" --dtypes bf16 --modes cohort
step smollm2-bf16-breakdown "$(lim 75)" "${B[@]}" --models "$SMOL" --dtypes bf16 --modes cohort --clients "$FEW" \
  --breakdown 15
step smollm2-bf16-one "$(lim 75)" "${B[@]}" "${RAW[@]}" --models "$SMOL" --dtypes bf16 --modes one,peft \
  --clients "$FEW" --no-profile
step smollm2-fp32 "$(lim 45)" "${B[@]}" "${RAW[@]}" --models "$SMOL" --dtypes fp32 --modes cohort --no-profile
step smollm2-compiled "$(lim 135)" "${B[@]}" "${RAW[@]}" --models "$SMOL" --dtypes bf16 --modes "$COMPILED" \
  --buckets 384 --no-profile
step 1b-cohort "$(lim 70)" "${B[@]}" "${RAW[@]}" --models "$BIG" --dtypes bf16 --modes cohort --no-profile \
  --set train.gradient_checkpointing=true
"$PY" benchmarks/bench_gpu.py --report "$OUT" --device cpu
