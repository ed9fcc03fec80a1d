#!/usr/bin/env bash
# Coverage-guided fuzzing of the native decode entry points (atheris / libFuzzer).
#
#   fuzz/run.sh [SECONDS]        # default 60 (the CI budget); longer target: fuzz/run.sh 3600
#
# 1. generates the seed corpus with fuzz/hostile_corpus.py (nothing checked in),
# 2. builds the extensions for fuzzing (see FUZZ_INSTRUMENT),
# 3. runs fuzz/fuzz_decode.py for SECONDS with -rss_limit_mb=2048 -timeout=10.
# Exits non-zero on a crash (an exception other than DecodeError/ValueError/
# TypeError, a native fault, > 2 GiB RSS or a > 10 s input) and leaves the input
# as $FUZZ_WORKDIR/artifacts/crash-* (or oom-*/timeout-*).  Reproduce one with
#   PYTHONPATH=<tree printed below> python fuzz/fuzz_decode.py <that file>
# and turn it into a regression recipe in fuzz/hostile_corpus.py (REGRESSIONS).
#
# Environment:
#   FUZZ_INSTRUMENT  auto (default): 1 if clang is installed, else 0.
#                    1: copy the checkout to $FUZZ_WORKDIR/tree and build it there with
#                       clang -fsanitize-coverage=inline-8bit-counters,pc-table,trace-cmp,
#                       so libFuzzer sees the branches of the kernel's C and Cython code
#                       (the installed package is untouched).  Needs clang
#                       (apt-get install clang).
#                    0: fuzz the checkout's own build (python setup.py build_ext --inplace
#                       or pip install -e .): libFuzzer then sees Python branches only and
#                       is close to blind for native code (a random mutator with crash
#                       detection).
#   FUZZ_SANITIZE    1: REPLAY instead of fuzzing: build the tree with clang ASan+UBSan,
#                    preload clang's ASan runtime and run every input of corpus/ (what
#                    earlier coverage-guided runs kept) and of the seeds once (-runs=0),
#                    so memory errors that do not crash are caught; SECONDS is ignored.
#                    Mutating under ASan is not offered: the preloaded ASan runtime then
#                    supplies the __sanitizer_cov_* hooks, libFuzzer gets no coverage
#                    (atheris warns) and collapses the corpus to one 1-byte input.  Doing
#                    both needs a CPython with libFuzzer linked in (atheris's
#                    using_sanitizers.md).  Implies FUZZ_INSTRUMENT=1.
#   FUZZ_WORKDIR     default build/fuzz in the checkout (seeds/, corpus/, artifacts/, tree/);
#                    corpus/ persists between runs so longer runs build on earlier ones.
#   FUZZ_JOBS        parallel fuzzing processes (libFuzzer -fork); default 1.
set -euo pipefail
secs=${1:-60}
root=$(cd "$(dirname "$0")/.." && pwd)
work=${FUZZ_WORKDIR:-$root/build/fuzz}
instrument=${FUZZ_INSTRUMENT:-auto}
sanitize=${FUZZ_SANITIZE:-0}
[ "$sanitize" = 1 ] && instrument=1
py=${PYTHON:-python3}
if [ "$instrument" = auto ]; then
  if command -v clang >/dev/null 2>&1; then instrument=1; else instrument=0; fi
fi
mkdir -p "$work/corpus"
if [ -n "$(ls -A "$work/artifacts" 2>/dev/null)" ]; then   # keep earlier findings, aside
  mv "$work/artifacts" "$work/artifacts.$(date +%Y%m%d-%H%M%S)"
fi
mkdir -p "$work/artifacts"

"$py" -c "import atheris" 2>/dev/null || {
  echo "fuzz/run.sh: atheris is not installed (pip install atheris)" >&2; exit 2; }

echo "== seed corpus"
rm -rf "$work/seeds"
"$py" "$root/fuzz/hostile_corpus.py" "$work/seeds"
rm -f "$work/seeds/manifest.json"

if [ "$instrument" = 1 ]; then
  echo "== clang coverage build in $work/tree"
  command -v clang >/dev/null || { echo "FUZZ_INSTRUMENT=1 needs clang" >&2; exit 2; }
  tree="$work/tree"
  [ "$sanitize" = 1 ] && tree="$work/tree-asan"
  mkdir -p "$tree"
  # Sync sources only (keeps the previous build objects when nothing changed).
  (cd "$root" && git ls-files -co --exclude-standard -z | xargs -0 cp --parents -u -t "$tree")
  (cd "$tree" && ECHO_NATIVE_SANITIZE=$sanitize CC=clang \
     LDSHARED="clang -shared $([ "$sanitize" = 1 ] && echo -shared-libsan)" \
     CFLAGS="-fsanitize-coverage=inline-8bit-counters,pc-table,trace-cmp -g" \
     "$py" setup.py -q build_ext --inplace >"$work/build.log" 2>&1) || {
       tail -30 "$work/build.log" >&2; exit 2; }
  if [ "$sanitize" = 1 ]; then
    export LD_PRELOAD="$(clang -print-file-name=libclang_rt.asan-x86_64.so)"
    export ASAN_OPTIONS="detect_leaks=0:abort_on_error=1:${ASAN_OPTIONS:-}"
    export UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1:${UBSAN_OPTIONS:-}"
    export PYTHONMALLOC=malloc
  fi
else
  tree="$root"
  echo "== uninstrumented: native branches give no coverage feedback (install clang for that)"
fi

budget=(-max_total_time="$secs")
if [ "$sanitize" = 1 ]; then
  budget=(-runs=0)
  echo "== replaying corpus/ and seeds/ under ASan+UBSan: $tree/echo_native"
else
  echo "== fuzzing for ${secs}s: $tree/echo_native"
fi
jobs=${FUZZ_JOBS:-1}
fork=()
[ "$jobs" -gt 1 ] && fork=(-fork="$jobs" -ignore_crashes=0)
set +e
cd "$work"
PYTHONPATH="$tree" FUZZ_PRINT_MODULE=1 "$py" "$root/fuzz/fuzz_decode.py" \
  "${budget[@]}" -rss_limit_mb=2048 -timeout=10 -print_final_stats=1 \
  -artifact_prefix="$work/artifacts/" "${fork[@]}" "$work/corpus" "$work/seeds" \
  2>&1 | grep -v -E '^#[0-9]+\s+(NEW|REDUCE)|^"|dictionary' | tail -60
rc=${PIPESTATUS[0]}
# The seekable index parser and assembler: a quarter of the budget, its own corpus.
if [ "$rc" -eq 0 ]; then
  mkdir -p "$work/seek-corpus"
  PYTHONPATH="$tree" "$py" "$root/fuzz/fuzz_seekable.py" --seeds "$work/seek-seeds" >/dev/null
  seek_budget=("${budget[@]}")
  [ "$sanitize" = 1 ] || seek_budget=(-max_total_time="$(( (secs + 3) / 4 ))")
  PYTHONPATH="$tree" "$py" "$root/fuzz/fuzz_seekable.py" \
    "${seek_budget[@]}" -rss_limit_mb=2048 -timeout=10 -print_final_stats=1 \
    -artifact_prefix="$work/artifacts/" "${fork[@]}" "$work/seek-corpus" "$work/seek-seeds" \
    2>&1 | grep -v -E '^#[0-9]+\s+(NEW|REDUCE)|^"|dictionary' | tail -20
  rc=${PIPESTATUS[0]}
fi
set -e
found=$(ls "$work/artifacts" 2>/dev/null | wc -l)
if [ "$rc" -ne 0 ] || [ "$found" -ne 0 ]; then
  echo "fuzz/run.sh: FAILED (status $rc); inputs in $work/artifacts:" >&2
  ls -l "$work/artifacts" >&2
  exit 1
fi
[ "$sanitize" = 1 ] && secs="the ASan replay" || secs="${secs}s"
echo "fuzz/run.sh: no crash in ${secs} ($(ls "$work/corpus" | wc -l) inputs in corpus/)"
