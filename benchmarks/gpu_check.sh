#!/usr/bin/env bash
# One script for a lent GPU machine: install, GPU benchmarks, the extra, GPU tests.
#
#   here:   bash benchmarks/gpu_prepare.sh          # packs .gpu/ (wheel + libjpeg)
#   there:  device run  command="bash benchmarks/gpu_check.sh"  carry=[".gpu"]
#
# One device call allows 600 s: the steps' budgets add up to GPU_CHECK_BUDGET (420 s),
# and no step is given more than what is left of it, so the report is always written.
# gpu_check.json is rewritten as each step ends (a step killed at the call's limit
# loses only itself).  The steps run in the order of what the project lacks most: the
# H2D bandwidth against the pinned peak, the GPU re-augmentation rate, the end-to-end
# echo rate, then the extra in a venv of its own, the GPU tests, the other benchmarks.
#
# Nothing is written into this tree: a loaded extension rewritten in place crashes
# every process that has it mapped (this pytest, its xdist workers, a neighbour's
# session).  The wheel is unpacked into a copy of the sources in a folder of its own
# (mktemp -d), where the tests and benchmarks run; the extra is installed into a
# venv of its own.
#
# Results go to $OUT (the device tool's output folder) or a new folder from mktemp
# (7 files: the device tool brings back 8 at most): gpu_check.json (every step's status
# and time, the named checks, the design card's figures), gpu_check.log (all of the
# output), env.txt, gpu_tests.txt, gpu_bench.txt, gpu_bench.json, status.txt.  The exit
# status is the tests' when they fail, else the extra's, else the install's, else the
# first failing benchmark's.
set -uo pipefail
cd "$(dirname "$0")/.."
repo="$PWD"
kit="${GPU_KIT:-$repo/.gpu}"
out="${OUT:-$(mktemp -d)}"
mkdir -p "$out"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
tree="$work/tree"
exec > >(tee -a "$out/gpu_check.log") 2>&1
export PYTHONUNBUFFERED=1
# JAX would take 75% of the GPU's memory at its first use, and CuPy and torch share
# the GPU with it in the same test process.
export XLA_PYTHON_CLIENT_PREALLOCATE=false
export GPU_CHECK_BUDGET="${GPU_CHECK_BUDGET:-420}"
export GPU_CHECK_PLAN="environment install h2d reaugment echo toolkit tests bench"
export GPU_CHECK_STEPS="$work/steps.tsv" GPU_CHECK_WORK="$work"
export repo kit out work tree
: > "$GPU_CHECK_STEPS"
start=$SECONDS
echo "results in $out"

report() { python3 "$repo/benchmarks/gpu_report.py" "$out" || true; }

# step NAME SECONDS FUNCTION: FUNCTION under a timeout of SECONDS or what is left of the
# budget (less 15 s for the last report), whichever is less; its exit status and time
# go to the steps file and the report is rewritten.  124: it ran out of time; 125: no
# time was left to start it.
step() {
  local name=$1 want=$2 fn=$3 rc t0=$SECONDS
  local left=$(( GPU_CHECK_BUDGET - (SECONDS - start) - 15 ))
  local limit=$(( want < left ? want : left ))
  echo; echo "== $name (at most $limit s) =="
  if [ "$limit" -lt 5 ]; then
    echo "no time left"; rc=125
  else
    # timeout runs the step in a process group of its own and kills all of it.
    timeout -k 5 "$limit" bash -o pipefail -c "$fn"; rc=$?
  fi
  echo "$name exit $rc"
  printf '%s\t%s\t%s\t%s\n' "$name" "$rc" "$(( SECONDS - t0 ))" "$limit" >> "$GPU_CHECK_STEPS"
  report
  return "$rc"
}

environment() {
  { nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
    python3 -c "import sys, cupy, torch; print(sys.version.split()[0], 'cupy', cupy.__version__,
                'torch', torch.__version__, 'devices', cupy.cuda.runtime.getDeviceCount())"
    python3 -c "import jax; print('jax', jax.__version__, jax.devices())"
  } 2>&1 | tee "$out/env.txt"
}

build_here() {
  ECHO_NATIVE_JPEG_DIR="$kit/jpeg" python3 setup.py -q build_ext --inplace
}

install() {
  # The sources, copied (python -m pytest there imports that copy's package), then the
  # compiled core: from the wheel gpu_prepare.sh built, else built there against the
  # carried libjpeg.
  mkdir -p "$tree" || return
  tar -C "$repo" --exclude=./.git --exclude=./.gpu --exclude=./build --exclude='*.so' \
      --exclude='__pycache__' --exclude=./.venv -cf - . | tar -C "$tree" -xf - || return
  cd "$tree" || return
  python3 - "$kit" <<'EOF' || build_here || return
import glob, os, sys, zipfile
wheel = zipfile.ZipFile(glob.glob(f"{sys.argv[1]}/echo_native-*-cp3*.whl")[0])
wheel.extractall(".", [m for m in wheel.namelist()
                       if m.endswith(".so") or m.startswith("echo_native.libs/")])
print("unpacked", wheel.filename, "into", os.getcwd())
EOF
  python3 -c "import echo_native._kernel, echo_native._dlpack, echo_native._ring, echo_native
print('echo_native from', echo_native.__file__)"
}

bench() {  # bench NAME -k EXPR: part of bench_gpu.py, its JSON kept for the report
  local name=$1; shift
  cd "$tree" && python3 -m pytest -q -s -p no:cacheprovider benchmarks/bench_gpu.py "$@" \
    --benchmark-json="$work/bench_$name.json" 2>&1 | tee -a "$out/gpu_bench.txt"
}
h2d() { bench h2d -k test_h2d_bandwidth; }
reaugment() { bench reaugment -k test_gpu_reaugmentation; }
echo_rate() { bench echo -k "test_delivered_rate and not output_buffers"; }
other_bench() {
  local done="test_h2d_bandwidth or test_gpu_reaugmentation"
  done+=" or (test_delivered_rate and not output_buffers)"
  bench other -k "not ($done)"
}

toolkit() {
  # The gpu extra installed into a venv of its own (not this machine's CuPy, nor the
  # tree): the kernels compile with what the extra brings, or the check fails.
  python3 "$repo/benchmarks/gpu_extra.py" --kit "$kit" --venv "$work/extra"
}

tests() {
  # The tests that need a GPU or CuPy itself; the rest, the stand-in's and NVRTC's
  # among them, run in CI without one.
  cd "$tree" && python3 -m pytest -q -rA -p no:cacheprovider tests/test_gpu.py \
    tests/test_ops_kernels.py::test_cuda_augment_is_the_cpus_bit_for_bit \
    tests/test_cuda_kernels.py::test_the_nvrtc_options_are_cupys > "$out/gpu_tests.txt" 2>&1
  local rc=$?
  grep -E "^(FAILED|ERROR)|passed|failed" "$out/gpu_tests.txt" | tail -25
  return "$rc"
}
export -f environment build_here install bench h2d reaugment echo_rate other_bench toolkit tests

build=0 toolkit_rc=0 tests_rc=0 bench_rc=0
# Seconds per step: 405 together, the last report's 15 on top make the 420.
step environment 15 environment
step install 40 install || build=$?
step h2d 30 h2d || bench_rc=$?
step reaugment 45 reaugment || { r=$?; [ "$bench_rc" -ne 0 ] || bench_rc=$r; }
step echo 75 echo_rate || { r=$?; [ "$bench_rc" -ne 0 ] || bench_rc=$r; }
step toolkit 45 toolkit || toolkit_rc=$?
step tests 130 tests || tests_rc=$?
step bench 25 other_bench || { r=$?; [ "$bench_rc" -ne 0 ] || bench_rc=$r; }
echo; echo "== summary ($(( SECONDS - start )) s of $GPU_CHECK_BUDGET) =="
GPU_CHECK_FINAL=1 report

echo "gpu_check: tests exit $tests_rc, benchmark exit $bench_rc" | tee "$out/status.txt"
for rc in "$tests_rc" "$toolkit_rc" "$build" "$bench_rc"; do
  if [ "$rc" -ne 0 ]; then
    exit "$rc"
  fi
done
exit 0
