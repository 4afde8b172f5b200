#!/usr/bin/env bash
# CI leg for free-threaded CPython (issue 30): the patch suites, doctor --selftest and the short soak on
# CPython 3.13t with the GIL off (PYTHON_GIL=0), torch 2.12.0 (the first release with cp313t wheels on PyPI
# that the package supports there; a CUDA build, run on the CPU like the 2.11 leg).
#
#   .ci/freethreaded.sh [all]           build (or reuse) the interpreter, fresh venv, run everything
#   .ci/freethreaded.sh prepare         only the interpreter and the venv (.ci/run starts this in the background)
#   .ci/freethreaded.sh test            only the tests, in the venv that `prepare` left (removed afterwards)
#   env: TTC_FT_PYTHON   a free-threaded interpreter to use instead of building one
#        TTC_FT_CACHE    where the interpreter is built and kept (default $HOME/.cache/ttc-freethreaded)
#        TTC_FT_TORCH    torch version (default 2.12.0)
#
# The interpreter is built once (~8 min on 2 cores) and reused from the cache afterwards; the venv is made
# from scratch every run, like the other legs, and removed at the end. Timings: docs/performance.md.
set -euo pipefail
cd "$(dirname "$0")/.."
start=$(date +%s)
stamp() { echo "== $1 ($(( $(date +%s) - start )) s, $(df -Ph . | awk 'NR==2 {print $4}') free)"; }
CACHE=${TTC_FT_CACHE:-$HOME/.cache/ttc-freethreaded}
TORCH=${TTC_FT_TORCH:-2.12.0}
VENV=.venv-ft
PHASE=${1:-all}
case "$PHASE" in all|prepare|test) ;; *) echo "usage: $0 [all|prepare|test]" >&2; exit 2;; esac

prepare() {
# 1. The interpreter (cached between runs).
stamp "free-threaded interpreter"
if [ -n "${TTC_FT_PYTHON:-}" ]; then
    py=$TTC_FT_PYTHON
else
    rc=0
    py=$(bash .ci/build-freethreaded-python.sh "$CACHE/py313t" | tail -1) || rc=$?
    if [ "$rc" = 75 ]; then
        # Only when the machine cannot provide what the build needs (build dependencies not installable,
        # Debian's archive unreachable, no source served): said loudly and left out; a build that fails, or
        # any test below, fails the leg.
        echo "== free-threaded leg NOT RUN: no free-threaded interpreter could be built here (see above)"
        : > "$VENV.not-run"  # read by the test phase, which then says so again and exits 0
        exit 0
    fi
    [ "$rc" = 0 ] || exit "$rc"
fi
"$py" -c 'import sys, sysconfig; assert sysconfig.get_config_var("Py_GIL_DISABLED") == 1, "not free-threaded"; print(sys.version)'

# 2. A fresh venv: torch (cp313t wheel) and the package. numpy below 2.4: the newer releases publish no
#    cp313t wheels (pip would build one from source for ~10 min). The public index, as for the other legs.
stamp "venv torch $TORCH (cp313t)"
rm -rf "$VENV" "$VENV.not-run"
"$py" -m venv "$VENV"
PIP_CONFIG_FILE=/dev/null "$VENV/bin/pip" install -q --no-cache-dir --only-binary=:all: "torch==$TORCH" 'numpy<2.4'
# The test extra's pytest packages, not the extra itself: its gevent needs cffi, which refuses to build for
# the free-threaded 3.13 (gevent's tests are not in the suites below).
PIP_CONFIG_FILE=/dev/null "$VENV/bin/pip" install -q -e . 'pytest>=7' pytest-timeout pytest-xdist
touch "$VENV/.ttc-prepared"
}

run_tests() {
if [ -f "$VENV.not-run" ]; then
    rm -f "$VENV.not-run"
    echo "== free-threaded leg NOT RUN: no free-threaded interpreter could be built here (see the prepare log)"
    exit 0
fi
[ -f "$VENV/.ttc-prepared" ] || { echo "$VENV was not prepared (run: $0 prepare)" >&2; exit 1; }
trap 'rm -rf "$VENV"' EXIT  # ~5 GB: removed whether the leg passes or stops on a failure
# 3. Everything below runs with the GIL off. `import torch` keeps it off; inductor imports triton, whose
#    extension does not declare free-threading support: without PYTHON_GIL=0 that import turns the GIL on.
export PYTHON_GIL=0
"$VENV/bin/python" -c 'import sys, torch; f = torch.compile(lambda x: x + 1, backend="aot_eager"); f(torch.ones(2)); assert not sys._is_gil_enabled(), "GIL is on"; print("GIL off after import torch and a compile")'

stamp "pytest, patch suites (GIL off)"
mapfile -t PATCH_SUITE < <(python3 .ci/patch_suite.py --leg ft)  # from the patch table
[ "${#PATCH_SUITE[@]}" -gt 0 ] || { echo "the patch suite could not be read from the patch table"; exit 1; }
"$VENV/bin/python" -m pytest -q -p no:cacheprovider -n 2 "${PATCH_SUITE[@]}"

stamp "doctor --selftest (GIL off)"
"$VENV/bin/python" -m torch_threadsafe_compile doctor --selftest

stamp "short soak (GIL off)"
"$VENV/bin/python" -m pytest -q -p no:cacheprovider tests/soak/test_soak.py

stamp "done"
}

# The interpreter could not be built here (exit 75 above, said loudly): nothing to test.
[ "$PHASE" = test ] || prepare
[ "$PHASE" = prepare ] || run_tests
