#!/usr/bin/env bash
# One script for a lent GPU machine: install, GPU tests, GPU benchmark (under 8 minutes).
#
#   here:   bash benchmarks/gpu_prepare.sh          # packs .gpu/ (wheel + libjpeg)
#   there:  device run  command="bash benchmarks/gpu_check.sh"  carry=[".gpu"]
#
# Results go to $OUT (the device tool's output folder) or a new folder from mktemp.
# The tests and the benchmark both run; the exit status is the tests' when they
# fail, else the benchmark's: a failing GPU test fails the check.
set -euo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-$(mktemp -d)}"
mkdir -p "$out"
export PYTHONUNBUFFERED=1
# JAX would take 75% of the GPU's memory at its first use, and CuPy and torch share
# the GPU with it in the same test process.
export XLA_PYTHON_CLIENT_PREALLOCATE=false
echo "results in $out"
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  python3 -c "import sys, cupy, torch; print(sys.version.split()[0], 'cupy', cupy.__version__,
              'torch', torch.__version__, 'devices', cupy.cuda.runtime.getDeviceCount())"
} 2>&1 | tee "$out/env.txt" || true

# The compiled core, next to the sources (python -m pytest imports this folder's package):
# from the wheel gpu_prepare.sh built, else built here against the carried libjpeg.
python3 - <<'EOF' || ECHO_NATIVE_JPEG_DIR="$PWD/.gpu/jpeg" python3 setup.py -q build_ext --inplace
import glob, zipfile
wheel = zipfile.ZipFile(glob.glob(".gpu/echo_native-*-cp3*.whl")[0])
wheel.extractall(".", [m for m in wheel.namelist()
                       if m.endswith(".so") or m.startswith("echo_native.libs/")])
EOF
python3 -c "import echo_native._kernel, echo_native._dlpack, echo_native._ring" \
  || { echo "the compiled core does not import"; exit 1; }

tests=0
timeout 220 python3 -m pytest -q -p no:cacheprovider -rs \
  tests/test_gpu.py tests/test_cuda_ordering.py tests/test_cuda_kernels.py tests/test_ops_kernels.py \
  tests/test_backends.py tests/test_output.py tests/test_pipeline.py \
  2>&1 | tee "$out/gpu_tests.txt" | tail -25 || tests=$?
bench=0
timeout 240 python3 -m pytest -q -s -p no:cacheprovider benchmarks/bench_gpu.py \
  --benchmark-json="$out/gpu_bench.json" 2>&1 | tee "$out/gpu_bench.txt" | tail -40 || bench=$?
echo "gpu_check: tests exit $tests, benchmark exit $bench" | tee "$out/status.txt"
if [ "$tests" -ne 0 ]; then
  exit "$tests"
fi
exit "$bench"
