#!/usr/bin/env bash
# The CUDA path checked in one go, on a machine with an NVIDIA GPU and a CUDA build of torch:
# the CUDA tests, `specdraft steps` and a short bench in bfloat16 on the tiny Gemma 4 pair, then
# the same on a real-size random-weight Gemma 4 E2B pair (written here first, ~10 GB of disk).
# Meant to finish in under 10 minutes; each step is bounded and the log names what failed.
#
#   bash tools/gpu_check.sh [OUT_DIR]      (default OUT_DIR: a new temporary folder)
#
# Needs python3 with torch (CUDA), transformers, safetensors, tokenizers, gguf and pytest
# importable; specdraft runs from this checkout (PYTHONPATH=src), nothing is installed.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-$(mktemp -d)}
mkdir -p "$OUT"
export PYTHONPATH="$PWD/src:$PWD/tools${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
SPECDRAFT="python3 -m specdraft"
failed=()

step() {  # step NAME SECONDS COMMAND...: run with a time limit, remember a failure
  local name=$1 limit=$2
  shift 2
  echo "== $name"
  if ! timeout "$limit" "$@"; then
    failed+=("$name")
  fi
}

python3 -c "import torch; assert torch.cuda.is_available(), 'no CUDA device'; print(torch.__version__, torch.cuda.get_device_name(0))" \
  || { echo "no CUDA device visible to torch: nothing to check"; exit 2; }

step "CUDA tests" 240 python3 -m pytest -q -x tests/test_cuda.py
step "tiny Gemma 4 pair" 60 python3 tools/gemma4_tiny.py "$OUT/tiny" --text-only
step "tiny: generate, mtp" 60 $SPECDRAFT generate "hello world" --model "$OUT/tiny/target" --drafter mtp \
  --drafter-path "$OUT/tiny/assistant" --device cuda --dtype bfloat16 --max-new-tokens 16 --json
step "tiny: steps" 60 $SPECDRAFT steps --model "$OUT/tiny/target" --device cuda --dtype bfloat16 \
  --widths 1,2,4,8 --batch-sizes 1,4 --repeats 5
step "E2B real size" 240 python3 tools/gemma4_real_size.py e2b "$OUT/e2b"
step "E2B: steps" 90 $SPECDRAFT steps --model "$OUT/e2b/target" --device cuda --dtype bfloat16 \
  --widths 1,2,3,4,5,8 --batch-sizes 1,4 --repeats 5
step "E2B: bench" 120 $SPECDRAFT bench --model "$OUT/e2b/target" --drafter-path "$OUT/e2b/assistant" \
  --device cuda --dtype bfloat16 --methods plain,mtp --categories writing,coding --limit-per-category 1 \
  --max-new-tokens 32 --no-plots --out "$OUT/e2b-bench"

if [ ${#failed[@]} -gt 0 ]; then
  echo "FAILED: ${failed[*]}"
  exit 1
fi
echo "all GPU checks passed (outputs in $OUT)"
