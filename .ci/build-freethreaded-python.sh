#!/usr/bin/env bash
# Build a free-threaded CPython (configure --disable-gil, interpreter pythonX.Yt) from Debian sid's *source*
# package, on a Debian (bookworm) machine that can reach the Debian package archive. Used by
# .ci/freethreaded.sh; prints the interpreter's path on its last line.
#
#   build-freethreaded-python.sh [PREFIX]     PREFIX defaults to $HOME/.cache/ttc-freethreaded/py313t
#   env: PYVERS   minor versions to try, in order (default "3.13"; the first whose source downloads wins)
#        JOBS     make -j (default: nproc)     NICE  nice level of the build (default 15)
#
# Idempotent: an existing free-threaded interpreter under PREFIX is reused, not rebuilt.
# Exit status 75 (EX_TEMPFAIL) when the build dependencies cannot be installed, or the Debian archive cannot be
# reached or serves no source package: the caller may report that as "could not run" rather than as a
# failure; any other problem (configure, make, a build that is not free-threaded) exits 1.
# Only a deb-src line is configured (in a private apt configuration), so no sid binary can be installed; the
# build dependencies come from the system's own sources. A listed source version can be missing from a mirror
# while an older one is served, hence the loop over versions. No --enable-optimizations: PGO takes far
# longer on 2 cores. Measured on 2 cores: 3.13.15, 497 s.
set -euo pipefail
PREFIX=${1:-$HOME/.cache/ttc-freethreaded/py313t}
PYVERS=${PYVERS:-"3.13"}
JOBS=${JOBS:-$(nproc)}
NICE=${NICE:-15}
SUDO=; [ "$(id -u)" = 0 ] || SUDO=sudo

is_ft() { [ -x "$1" ] && "$1" -c 'import sys, sysconfig; sys.exit(sysconfig.get_config_var("Py_GIL_DISABLED") != 1)' 2>/dev/null; }

# 1. Already built?
for v in $PYVERS; do
  if is_ft "$PREFIX/bin/python${v}t"; then echo "$PREFIX/bin/python${v}t"; exit 0; fi
done

# 2. Build dependencies, from the system's sources only.
deps="build-essential pkg-config libssl-dev zlib1g-dev libffi-dev libbz2-dev liblzma-dev libsqlite3-dev
      libreadline-dev uuid-dev libgdbm-dev libgdbm-compat-dev tk-dev libncurses-dev libzstd-dev xz-utils"
missing=; for p in $deps; do dpkg -s "$p" >/dev/null 2>&1 || missing="$missing $p"; done
if [ -n "$missing" ]; then
  { $SUDO apt-get update -qq && $SUDO apt-get install -y -qq --no-install-recommends $missing >&2; } ||
    { echo "could not install the build dependencies:$missing" >&2; exit 75; }
fi

# 3. Private apt configuration (deb-src sid only) in a temporary directory of our own.
work=$(mktemp -d); trap 'rm -rf "$work"' EXIT
chmod 755 "$work"; mkdir -p "$work/lists/partial" "$work/cache/archives/partial"
echo 'deb-src http://deb.debian.org/debian sid main' > "$work/sources.list"
A=(-o Dir::Etc::sourcelist="$work/sources.list" -o Dir::Etc::sourceparts=- -o Dir::State::Lists="$work/lists"
   -o Dir::Cache="$work/cache")
$SUDO apt-get "${A[@]}" update -qq || { echo "the Debian archive (deb-src sid) cannot be reached" >&2; exit 75; }

# 4. Download (apt checks the checksums against the signed index) the first source that is served.
PYV=
for v in $PYVERS; do
  for ver in $(apt-cache "${A[@]}" showsrc "python$v" 2>/dev/null | awk '/^Version:/{print $2}' | sort -urV); do
    if (cd "$work" && apt-get "${A[@]}" source --download-only "python$v=$ver" >/dev/null 2>&1); then
      PYV=$v; echo "source: python$v $ver" >&2; break 2
    fi
    echo "source python$v=$ver: not downloadable" >&2
  done
done
[ -n "$PYV" ] || { echo "no python source package ($PYVERS) could be downloaded" >&2; exit 75; }

# 5. Configure, build, install.
tar -xf "$work"/python"$PYV"_*.orig.tar.xz -C "$work"
cd "$work"/Python-"$PYV".*/
start=$(date +%s)
nice -n "$NICE" ./configure -q --disable-gil --prefix="$PREFIX" --with-ensurepip=install >&2
nice -n "$NICE" make -s -j"$JOBS" >"$work/make.log" 2>&1 || { tail -40 "$work/make.log" >&2; exit 1; }
nice -n "$NICE" make -s install >"$work/install.log" 2>&1 || { tail -40 "$work/install.log" >&2; exit 1; }
echo "built in $(( $(date +%s) - start )) s" >&2

py="$PREFIX/bin/python${PYV}t"
is_ft "$py" || { echo "$py is not a free-threaded build" >&2; exit 1; }
"$py" -c 'import sys; print(sys.version, "GIL enabled:", sys._is_gil_enabled())' >&2
echo "$py"
