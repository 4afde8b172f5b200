#!/usr/bin/env bash
# One GPU call of under 10 minutes: the CUDA-graph layouts with random inputs, repeated, with the details of
# any wrong output; the capture window of cudagraph_rng measured alone; the reference trainer threaded vs
# sequential. Results packed into $OUT/res.tgz as it goes ($OUT/summary.txt: the tables).
#
#   PYTHONPATH=$PWD:$PWD/sitecustomize OUT=/some/dir bash bench/gpu_layouts_window_trainer.sh [steps]
#
# With RERUN_IDS (a file of test_cudagraph_trees.py node ids): those tests $RERUNS times per mode, one process at
# a time, beside the layouts (which then run 2 at a time).
# Steps (comma list, run in this order: layouts, trainer, window, scenarios):
#   layouts  bench/cudagraph_rng.py --only layouts --modes active --repeat $REPEAT (3 runs at once)
#   trainer  bench/bench_trainer.py: cuda-small 4 + 4 vs sequential x4 (600 steps), then multi-gpu 5 + 3 vs
#            sequential x3 (200 steps), alone on the GPU, one inductor cache for all runs
#   window   bench/cudagraph_rng.py --only window (TTC_DISABLE=1, then active with each switch variant), alone
#   scenarios (not by default) in the time left: bench/cudagraph_rng.py --only issue,dropout, both modes
# Every step gets what is left of $HARD_END s (default 570) at most.
set -u
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
OUT=${OUT:-./gpu-ltw-out}; mkdir -p "$OUT"
WORK=${WORK:-$(mktemp -d /tmp/gpu-ltw.XXXXXX)}; mkdir -p "$WORK"
STEPS=${1:-layouts,trainer,window}
REPEAT=${REPEAT:-5}; HARD_END=${HARD_END:-575}
T0=$(date +%s)
export PYTHONUNBUFFERED=1

pack() {
  (cd "$WORK" && find . -name '*.md' -o -name '*.json' -o -name '*.txt' -o -name '*.log' -o -name '*.jsonl' | grep -v -e cache -e /ckpt \
     | tar czf "$OUT/res.tgz.part" -T - ) && mv "$OUT/res.tgz.part" "$OUT/res.tgz"
  cp "$WORK/summary.txt" "$OUT/summary.txt" 2>/dev/null
}
left() { echo $(( HARD_END - ($(date +%s) - T0) )); }
step() {  # name limit command...
  local name=$1 lim=$2; shift 2
  local l; l=$(left); [ "$l" -lt "$lim" ] && lim=$l
  if [ "$lim" -lt 30 ]; then echo "== $name: not run (time)" | tee -a "$WORK/summary.txt"; return; fi
  local t=$(date +%s)
  echo "== $name (limit $lim s): $*" >> "$WORK/summary.txt"
  timeout -k 20 "$lim" "$@" > "$WORK/$name.txt" 2>&1
  echo "== $name: rc=$?, $(( $(date +%s) - t )) s, at +$(( $(date +%s) - T0 )) s" >> "$WORK/summary.txt"
  pack
}

{
  date -u +%FT%TZ; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>&1
  "$PY" -c "import sys, torch; print('python', sys.version.split()[0], 'torch', torch.__version__)"
  "$PY" -c "import transformers; print('transformers', transformers.__version__)" 2>&1 | tail -n 1
  cat TREE_COMMIT 2>/dev/null; nproc
} > "$WORK/env.txt" 2>&1
cp "$WORK/env.txt" "$WORK/summary.txt"

LJOBS=3
if [ -n "${RERUN_IDS:-}" ] && [ -s "$RERUN_IDS" ]; then  # reruns of upstream tests beside the layouts: 1 + 2 processes
  LJOBS=2
  (JOBS=1 NODEIDS_FILE="$RERUN_IDS" RERUNS=${RERUNS:-3} HARD_END=${RERUN_END:-230} WORK="$WORK/reruns" OUT="$WORK/reruns-out" \
     bash bench/gpu_cudagraph_trees.sh rerun > "$WORK/reruns.txt" 2>&1) &
  RPID=$!
fi
if [[ ",$STEPS," == *,layouts,* ]]; then
  lb=$(left); [ "$lb" -gt 220 ] && lb=220
  step layouts "$lb" "$PY" bench/cudagraph_rng.py --only layouts --modes active --repeat "$REPEAT" --jobs "$LJOBS" \
    --budget $(( lb - 70 )) --timeout 60 --out "$WORK/layouts"
  tail -n 22 "$WORK/layouts.txt" >> "$WORK/summary.txt"; pack
fi
if [ -n "${RPID:-}" ]; then
  wait "$RPID"; echo "== reruns: rc=$?, at +$(( $(date +%s) - T0 )) s" >> "$WORK/summary.txt"
  cat "$WORK/reruns/summary.md" >> "$WORK/summary.txt" 2>/dev/null; pack
fi
if [[ ",$STEPS," == *,trainer,* ]]; then
  X="--eval-every 0 --no-checkpoint"
  step trainer-small 175 "$PY" bench/bench_trainer.py --preset cuda-small --steps 600 --measure-after 150 --threads 4+4 \
    --cache user --extra="$X" --timeout 150 --md "$WORK/trainer-small.md" --json "$WORK/trainer-small.json" \
    --work-dir "$WORK/trainer-small"
  cat "$WORK/trainer-small.md" >> "$WORK/summary.txt" 2>/dev/null
  step trainer-multi 210 "$PY" bench/bench_trainer.py --preset multi-gpu --steps 200 --measure-after 40 --threads 5+3 \
    --cache user --extra="$X" --timeout 180 --md "$WORK/trainer-multi.md" --json "$WORK/trainer-multi.json" \
    --work-dir "$WORK/trainer-multi"
  cat "$WORK/trainer-multi.md" >> "$WORK/summary.txt" 2>/dev/null
fi
if [[ ",$STEPS," == *,window,* ]]; then
  step window 110 "$PY" bench/cudagraph_rng.py --only window --jobs 1 --budget 90 --timeout 90 --out "$WORK/window"
  tail -n 6 "$WORK/window.txt" >> "$WORK/summary.txt"
  "$PY" -c "
import json, sys
for r in json.load(open('$WORK/window/cudagraph_rng.json')):
    print(r.get('job'), json.dumps(r.get('variants')), r.get('kinds'), r.get('capture_errors'), r.get('report'))
" >> "$WORK/summary.txt" 2>&1; pack
fi
if [[ ",$STEPS," == *,scenarios,* ]]; then  # what time is left: issue and dropout, both modes, 2 at a time
  l=$(left)
  if [ "$l" -gt 80 ]; then
    step scenarios "$l" "$PY" bench/cudagraph_rng.py --only issue,dropout --jobs 2 --budget $(( l - 60 )) --timeout 50 \
      --out "$WORK/scenarios"
    tail -n 8 "$WORK/scenarios.txt" >> "$WORK/summary.txt"; pack
  else
    echo "== scenarios: not run (time)" >> "$WORK/summary.txt"
  fi
fi
echo "total $(( $(date +%s) - T0 )) s" >> "$WORK/summary.txt"
pack
cat "$WORK/summary.txt"
