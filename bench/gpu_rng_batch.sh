#!/usr/bin/env bash
# The GPU batch for H7's random-number hazards (patch cudagraph_rng), in two steps of under 10 minutes each
# on one H200, results under $OUT (default ./gpu-rng-out). See docs/results/cudagraph-rng-h200.md.
#
#   OUT=/some/dir bash bench/gpu_rng_batch.sh scenarios   # default
#   OUT=/some/dir bash bench/gpu_rng_batch.sh upstream
#
# scenarios:
#   1. bench/cudagraph_rng.py: pytorch#123177's reproduction, 16 threads x 20 calls with torch.rand inputs in
#      three layouts, dropout training next to drawing threads, the HF generate server; each with
#      TTC_DISABLE=1 and active, in fresh interpreters.
#   2. at the same time, bench/soak.py on the GPU with inductor, 16 threads x 20 functions, every input drawn
#      in the worker threads from the CUDA default generator (--device-rand): active and TTC_DISABLE=1, and
#      active with mode="reduce-overhead" (CUDA graphs recorded while the other threads draw), one after the
#      other (step 1 runs 2 scenarios at a time: at most 3 processes share the GPU).
#   3. tests/test_cudagraph_rng.py -m cuda on the JSON of step 1.
# upstream: PyTorch's test/inductor/test_cudagraph_trees.py (bench/pytorch_tests) with the package active
#   and off (bench/upstream_tests.py through cudagraph_rng.py's `upstream` job).
# Without a CUDA device: one line, exit status 2.
set -u
cd "$(dirname "$0")/.."
PY=${PYTHON:-python}
STEP=${1:-scenarios}
if ! "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" >/dev/null 2>&1; then
  echo "bench/gpu_rng_batch.sh: needs a CUDA device (torch.cuda.is_available() is False or torch does not import); nothing run"
  exit 2
fi
OUT=${OUT:-./gpu-rng-out}
mkdir -p "$OUT/rng"
{
  date -u +%FT%TZ; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>&1
  "$PY" -c "import sys, torch; print('python', sys.version.split()[0]); print('torch', torch.__version__, torch.version.git_version)"
  "$PY" -c "import transformers; print('transformers', transformers.__version__)" 2>&1 | tail -1
  git rev-parse HEAD 2>/dev/null; git status --short 2>/dev/null | head -20
} > "$OUT/env-$STEP.txt" 2>&1
t0=$(date +%s)
if [ "$STEP" = upstream ]; then
  timeout 560 "$PY" bench/cudagraph_rng.py --only upstream --out "$OUT/rng" --upstream-timeout 240 > "$OUT/upstream.txt" 2>&1
  echo "upstream rc=$? after $(( $(date +%s) - t0 )) s" >> "$OUT/env-$STEP.txt"
  tail -n 30 "$OUT/upstream.txt"
  exit 0
fi
soak() {  # name, then soak.py arguments
  local name=$1; shift
  timeout 500 "$PY" bench/soak.py --device cuda --backend inductor --duration 90 --threads 16 --functions 20 \
    --device-rand --json "$@" > "$OUT/soak-$name.txt" 2>&1
  echo "soak $name rc=$? after $(( $(date +%s) - t0 )) s" >> "$OUT/env-$STEP.txt"
}
# at most 3 processes on the GPU at once: the soaks one after another, beside 2 scenario runs at a time
(soak inductor-active; soak inductor-off --disable; soak reduce-overhead-active --mode reduce-overhead) & s1=$!
timeout 500 "$PY" bench/cudagraph_rng.py --only issue,layouts,dropout,server --out "$OUT/rng" --budget 240 --timeout 150 --jobs 2 \
  > "$OUT/cudagraph_rng.txt" 2>&1
echo "cudagraph_rng.py rc=$? after $(( $(date +%s) - t0 )) s" >> "$OUT/env-$STEP.txt"
wait $s1
if [ -f "$OUT/rng/cudagraph_rng.json" ]; then
  TTC_RNG_BENCH_JSON="$OUT/rng/cudagraph_rng.json" timeout 60 "$PY" -m pytest -m cuda tests/test_cudagraph_rng.py -q -p no:cacheprovider \
    > "$OUT/pytest-cuda-rng.txt" 2>&1
  echo "pytest rc=$? after $(( $(date +%s) - t0 )) s" >> "$OUT/env-$STEP.txt"
fi
tail -n 25 "$OUT/cudagraph_rng.txt"
for f in "$OUT"/soak-*.txt; do echo "== $f"; head -n 3 "$f" | tail -n 1; done
tail -n 6 "$OUT/env-$STEP.txt"
