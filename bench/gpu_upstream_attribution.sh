#!/usr/bin/env bash
# Which patch makes a test of test/inductor/test_cudagraph_trees.py fail only with the package active:
# the given tests (pytest -k expression), serially, once with TTC_DISABLE=1, once active, and once active
# with each listed patch left out (TTC_DISABLE=<id>), all at the same time on one GPU; results under $OUT.
#
#   OUT=/some/dir bash bench/gpu_upstream_attribution.sh "test_multinomial or test_frozen_fn" patch [patch ...]
#
# Upstream's test file needs expecttest and pytest-timeout besides pytest.
# The patches to leave out one at a time are named (ids of the patch table, `doctor` lists them): for the
# CUDA-graph tests, those that act on CUDA graphs and random numbers, and lazy_backward (it compiles the
# backward with the forward for graphs on an accelerator, which tests that count backward compiles see).
set -u
cd "$(dirname "$0")/.."
PY=${PYTHON:-python}
K=${1:?a pytest -k expression}; shift
PATCHES=("$@"); [ ${#PATCHES[@]} -gt 0 ] || { echo "name the patches to leave out one at a time (doctor lists them)" >&2; exit 2; }
OUT=${OUT:-./gpu-attribution-out}; mkdir -p "$OUT"
run() {  # name, then environment
  local name=$1; shift
  (cd bench/pytorch_tests/test && env "$@" TORCHINDUCTOR_CACHE_DIR="$(mktemp -d)" timeout 400 "$PY" -m pytest \
     inductor/test_cudagraph_trees.py -c /dev/null --rootdir . -p no:cacheprovider -q --timeout 200 -rfE -k "$K" \
     > "$OUT/$name.txt" 2>&1)
}
run off TTC_DISABLE=1 & run on TTC_UNUSED=1 &
for p in "${PATCHES[@]}"; do run "without-$p" TTC_DISABLE="$p" & done
wait
for f in "$OUT"/*.txt; do
  echo "== $(basename "$f" .txt): $(tail -n 1 "$f")"
  grep -E "^(FAILED|ERROR)" "$f" | sed 's/ - .*//; s/.*:://' | sort | uniq | sed 's/^/   /'
done
