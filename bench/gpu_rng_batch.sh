#!/usr/bin/env bash
# The GPU batch for H7's random-number hazards (patch cudagraph_rng): every prepared scenario in one call,
# under 10 minutes on one H200, results under $OUT (default ./gpu-rng-out). See docs/results/cudagraph-rng-h200.md.
#
#   OUT=/some/dir bash bench/gpu_rng_batch.sh
#
# 1. bench/cudagraph_rng.py: pytorch#123177's reproduction, 16 threads x 20 calls with torch.rand inputs in
#    three layouts, dropout training next to drawing threads, the HF generate server, and the upstream
#    cudagraph-trees tests when their file is in the tree; each with TTC_DISABLE=1 and active.
# 2. at the same time, bench/soak.py on the GPU with inductor (package active, 30 s).
# 3. tests/test_cudagraph_rng.py -m cuda on the JSON of step 1.
# Without a CUDA device: one line, exit status 2.
set -u
cd "$(dirname "$0")/.."
PY=${PYTHON:-python}
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
} > "$OUT/env.txt" 2>&1
t0=$(date +%s)
timeout 420 "$PY" bench/soak.py --device cuda --backend inductor --duration 30 --threads 16 --functions 20 --json \
  > "$OUT/soak-cuda-inductor.txt" 2>&1 &
soak=$!
timeout 480 "$PY" bench/cudagraph_rng.py --out "$OUT/rng" --budget 240 --timeout 120 --jobs 3 > "$OUT/cudagraph_rng.txt" 2>&1
echo "cudagraph_rng.py rc=$? after $(( $(date +%s) - t0 )) s" >> "$OUT/env.txt"
wait $soak
echo "soak rc=$? after $(( $(date +%s) - t0 )) s" >> "$OUT/env.txt"
if [ -f "$OUT/rng/cudagraph_rng.json" ]; then
  TTC_RNG_BENCH_JSON="$OUT/rng/cudagraph_rng.json" timeout 60 "$PY" -m pytest -m cuda tests/test_cudagraph_rng.py -q -p no:cacheprovider \
    > "$OUT/pytest-cuda-rng.txt" 2>&1
  echo "pytest rc=$? after $(( $(date +%s) - t0 )) s" >> "$OUT/env.txt"
fi
tail -n 25 "$OUT/cudagraph_rng.txt"
head -n 3 "$OUT/soak-cuda-inductor.txt"
cat "$OUT/env.txt" | tail -n 3
