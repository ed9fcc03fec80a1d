#!/usr/bin/env bash
# The kernel, ring, loader, backend, pipeline, hostile-input and bad-API tests under ASan + UBSan.
#
#   fuzz/asan.sh [pytest args...]     # default: the test files below, -x -q
#
# Copies the checkout (tracked and untracked, non-ignored files) to a temp dir, builds
# the extensions there with ECHO_NATIVE_SANITIZE=1 (setup.py: -fsanitize=address,undefined
# -fno-sanitize-recover=undefined, -O1 -g, Cython bounds checks) using
# `setup.py build_ext --inplace` (never pip install: the installed echo_native keeps
# pointing at the checkout), then runs pytest in the copy with PYTHONPATH=<copy> and the
# ASan runtime preloaded into python (child processes -- the corpus checker, forkserver
# and spawn workers -- inherit both through the environment).  Sanitizer reports go to
# per-process log files; any report, or any test failure, exits non-zero.
# Needs gcc with libasan/libubsan (Debian: build-essential).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
py=${PYTHON:-python3}
tmp=$(mktemp -d "${TMPDIR:-/tmp}/en-asan.XXXXXX")
keep=${ASAN_KEEP:-0}
cleanup() { [ "$keep" = 1 ] || rm -rf "$tmp"; }
trap cleanup EXIT

tree="$tmp/tree"
mkdir -p "$tree" "$tmp/logs"
(cd "$root" && git ls-files -co --exclude-standard -z | xargs -0 cp --parents -t "$tree")
rm -f "$tree"/echo_native/*.so

echo "== ASan+UBSan build in $tree"
t0=$(date +%s)
(cd "$tree" && ECHO_NATIVE_SANITIZE=1 "$py" setup.py -q build_ext --inplace -j 2 \
   >"$tmp/build.log" 2>&1) || { tail -40 "$tmp/build.log" >&2; exit 2; }
echo "   built in $(( $(date +%s) - t0 ))s"

libasan=$(gcc -print-file-name=libasan.so)
libubsan=$(gcc -print-file-name=libubsan.so)
[ -e "$libasan" ] && [ -e "$libubsan" ] || { echo "no libasan/libubsan from gcc" >&2; exit 2; }
for so in "$tree"/echo_native/_kernel*.so "$tree"/echo_native/_ring*.so \
          "$tree"/echo_native/_dlpack*.so; do
  grep -q "__asan_init" "$so" || { echo "$so is not an ASan build" >&2; exit 2; }
done

if [ $# -eq 0 ]; then
  set -- tests/test_decode.py tests/test_ring.py tests/test_loader.py tests/test_workers.py \
         tests/test_backends.py tests/test_output.py tests/test_pipeline.py \
         tests/robustness/test_hostile.py tests/robustness/test_fuzz.py \
         tests/robustness/test_bad_api.py tests/robustness/test_hostile_corpus.py \
         tests/test_ops_kernels.py tests/test_augment.py tests/test_seekable.py \
         -x -q -p no:cacheprovider
fi

export PYTHONPATH="$tree"
export LD_PRELOAD="$libasan:$libubsan${LD_PRELOAD:+:$LD_PRELOAD}"
# detect_leaks=0: CPython itself "leaks" at exit; abort_on_error: a report kills the process.
# allocator_may_return_null: a huge allocation is a MemoryError the tests expect, not a crash.
export ASAN_OPTIONS="detect_leaks=0:allocator_may_return_null=1:abort_on_error=1:halt_on_error=1:handle_abort=1:log_path=$tmp/logs/asan:${ASAN_OPTIONS:-}"
export UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1:log_path=$tmp/logs/ubsan:${UBSAN_OPTIONS:-}"
# PYTHONMALLOC=malloc: Python objects (bytes, arrays) get ASan redzones, not pymalloc arenas.
export PYTHONFAULTHANDLER=1 PYTHONDONTWRITEBYTECODE=1 PYTHONMALLOC=malloc

cd "$tree"
"$py" - <<'PY'
import echo_native, echo_native._kernel as k, echo_native._ring as r, os, sys
import echo_native._dlpack as d
root = os.environ["PYTHONPATH"]
for m in (echo_native, k, r, d):
    print("   using", m.__file__)
    assert m.__file__.startswith(root), f"{m.__name__} is not the ASan build: {m.__file__}"
PY

echo "== pytest $*"
t0=$(date +%s)
set +e
"$py" -m pytest "$@"
rc=$?
set -e
echo "   pytest status $rc in $(( $(date +%s) - t0 ))s"
# A refused huge allocation (allocator_may_return_null) is logged as a warning, not a report.
reports=0
for f in "$tmp"/logs/*; do
  [ -e "$f" ] && grep -qv "AddressSanitizer failed to allocate" "$f" && reports=$((reports + 1))
done
if [ "$reports" -ne 0 ]; then
  echo "== sanitizer reports:" >&2
  for f in "$tmp"/logs/*; do echo "--- $f" >&2; head -60 "$f" >&2; done
  exit 1
fi
exit $rc
