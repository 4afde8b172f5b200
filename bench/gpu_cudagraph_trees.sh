#!/usr/bin/env bash
# PyTorch's test/inductor/test_cudagraph_trees.py (bench/pytorch_tests) on one GPU, with TTC_DISABLE=1 and
# active, at most $JOBS pytest processes at once; logs and a summary packed into $OUT/cgt.tgz as it goes.
#
#   PYTHONPATH=$PWD:$PWD/sitecustomize OUT=/some/dir bash bench/gpu_cudagraph_trees.sh [steps]
#
# The package must be importable and activated in the children (installed, or PYTHONPATH with absolute
# paths: the tests run from bench/pytorch_tests/test). Upstream's file needs expecttest and pytest-timeout.
# Steps (comma list, default attribution,full,rerun):
#   attribution  the six tests that failed only active on 2026-12-05 ($SIX), serially in one process per mode,
#                both modes at once;
#   full         the whole file in $SHARDS round-robin shards per mode (bench/gpu_shard_plugin.py), off and on
#                interleaved; no shard starts after $DEADLINE s, and every process stops by $HARD_END s;
#   rerun        the tests that failed only active in `full` (or the node ids in $NODEIDS_FILE), $RERUNS times
#                in each mode (one process per mode and round, both modes at once; one after the other if JOBS=1).
# Every pytest process gets an empty TORCHINDUCTOR_CACHE_DIR; SIGINT at its timeout, so pytest still prints
# what ran. bench/gpu_cudagraph_summary.py makes WORK/summary.md (per mode: passed, failed; active-only).
set -u
cd "$(dirname "$0")/.."
ROOT=$PWD
PY=${PYTHON:-python3}
OUT=${OUT:-./gpu-cgt-out}; mkdir -p "$OUT"
WORK=${WORK:-$(mktemp -d /tmp/gpu-cgt.XXXXXX)}; mkdir -p "$WORK"
STEPS=${1:-attribution,full,rerun}
SHARDS=${SHARDS:-4}; JOBS=${JOBS:-3}; DEADLINE=${DEADLINE:-420}; RERUNS=${RERUNS:-3}
HARD_END=${HARD_END:-560}  # s after start: every pytest process is stopped by then
TEST_TIMEOUT=${TEST_TIMEOUT:-150}; SHARD_TIMEOUT=${SHARD_TIMEOUT:-330}; RERUN_TIMEOUT=${RERUN_TIMEOUT:-150}
SIX=${SIX:-"test_multinomial or test_cudagraph_uneven_forward_backward or test_checkpointing_resets_persistent_refs or test_frozen_fn or test_cache_hit_forward_miss_backward or test_forward_with_skipped_cudagraphed_backward"}
FILE=inductor/test_cudagraph_trees.py
T0=$(date +%s)
PLUG=$(mktemp -d); cp bench/gpu_shard_plugin.py "$PLUG/"
export PYTHONPATH="$PLUG${PYTHONPATH:+:$PYTHONPATH}"

pack() {
  "$PY" bench/gpu_cudagraph_summary.py "$WORK" > "$WORK/summary.md" 2> "$WORK/summary.err"
  tar czf "$OUT/cgt.tgz.part" -C "$WORK" . && mv "$OUT/cgt.tgz.part" "$OUT/cgt.tgz"
  cp "$WORK/summary.md" "$OUT/summary.md"
}

pt() {  # log-name mode timeout pytest-args...
  local name=$1 mode=$2 tmo=$3; shift 3
  local left=$(( HARD_END - ($(date +%s) - T0) ))
  [ "$left" -lt "$tmo" ] && tmo=$left
  [ "$tmo" -lt 10 ] && { echo "$name: not started (hard end ${HARD_END} s)" >> "$WORK/steps.txt"; return; }
  local flag=TTC_UNUSED=1; [ "$mode" = off ] && flag=TTC_DISABLE=1
  local cache; cache=$(mktemp -d)
  local t=$(date +%s)
  (cd bench/pytorch_tests/test && env "$flag" TORCHINDUCTOR_CACHE_DIR="$cache" PYTHONUNBUFFERED=1 \
     timeout -s INT -k 30 "$tmo" "$PY" -m pytest -c /dev/null --rootdir . -p no:cacheprovider -p gpu_shard_plugin \
     -v -rfE --timeout "$TEST_TIMEOUT" --durations=10 "$@" > "$WORK/$name.txt" 2>&1)
  local rc=$?
  echo "$name: rc=$rc, $(( $(date +%s) - t )) s, ended at +$(( $(date +%s) - T0 )) s: $(tail -n 1 "$WORK/$name.txt")" >> "$WORK/steps.txt"
  rm -rf "$cache"
}

{
  date -u +%FT%TZ; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>&1
  "$PY" -c "import sys, torch, pytest; print('python', sys.version.split()[0], 'torch', torch.__version__, 'pytest', pytest.__version__)"
  "$PY" -c "import torch, torch._dynamo, torch._inductor.cudagraph_trees, torch_threadsafe_compile as t; s = t.status(); print('ttc', s['activation'], s['inactive_reason'], ' '.join(p['id'] + ':' + p['state'] for p in s['patches']))" 2>&1 | tail -n 3
  git rev-parse HEAD 2>/dev/null; cat TREE_COMMIT 2>/dev/null
  echo "steps=$STEPS shards=$SHARDS jobs=$JOBS deadline=$DEADLINE reruns=$RERUNS"
} > "$WORK/env.txt" 2>&1
cat "$WORK/env.txt"

if [[ ",$STEPS," == *,attribution,* ]]; then
  # one job per mode; the -k expression has spaces, so these two are started directly
  pt attr-off off 240 "$FILE" -k "$SIX" & pt attr-on on 240 "$FILE" -k "$SIX" &
fi
if [[ ",$STEPS," == *,full,* ]]; then
  for ((k = 0; k < SHARDS; k++)); do
    for mode in on off; do
      while [ "$(jobs -rp | wc -l)" -ge "$JOBS" ]; do wait -n; pack; done
      if [ $(( $(date +%s) - T0 )) -gt "$DEADLINE" ]; then
        echo "full-$mode-$k: not started (deadline ${DEADLINE} s)" >> "$WORK/steps.txt"; continue
      fi
      GPU_SHARD="$k/$SHARDS" pt "full-$mode-$k" "$mode" "$SHARD_TIMEOUT" "$FILE" &
    done
  done
fi
while [ "$(jobs -rp | wc -l)" -gt 0 ]; do wait -n; pack; done
pack
if [[ ",$STEPS," == *,rerun,* ]]; then
  IDS=${NODEIDS_FILE:-$WORK/active_only.txt}
  if [ -s "$IDS" ]; then
    mapfile -t NODES < "$IDS"
    echo "rerun: ${#NODES[@]} tests x $RERUNS rounds per mode: ${NODES[*]}" >> "$WORK/steps.txt"
    for ((r = 1; r <= RERUNS; r++)); do
      if [ $(( HARD_END - ($(date +%s) - T0) )) -lt 90 ]; then echo "rerun round $r: not started (deadline)" >> "$WORK/steps.txt"; break; fi
      if [ "$JOBS" -ge 2 ]; then
        pt "rerun-off-$r" off "$RERUN_TIMEOUT" "${NODES[@]}" & pt "rerun-on-$r" on "$RERUN_TIMEOUT" "${NODES[@]}" &
        wait
      else  # one process at a time
        pt "rerun-off-$r" off "$RERUN_TIMEOUT" "${NODES[@]}"; pt "rerun-on-$r" on "$RERUN_TIMEOUT" "${NODES[@]}"
      fi
      pack
    done
  else
    echo "rerun: nothing to rerun ($IDS empty or missing)" >> "$WORK/steps.txt"
  fi
fi
pack
echo "total $(( $(date +%s) - T0 )) s" >> "$WORK/steps.txt"
pack
cat "$WORK/steps.txt"; cat "$WORK/summary.md"
