#!/usr/bin/env bash
# One script for a lent GPU machine: build, run the GPU tests and the GPU benchmark.
# Budget: under 5 minutes.  Results go to $OUT (the device tool's output folder) or /tmp.
set -uo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-/tmp}"
python3 -c "import cupy; print('cupy', cupy.__version__, 'devices', cupy.cuda.runtime.getDeviceCount())"
python3 -m pip install -q --no-build-isolation --no-deps -e . 2>&1 | tail -3 \
  || { echo "build failed (needs Cython, numpy and libjpeg headers)"; exit 1; }
timeout 200 python3 -m pytest -q tests/test_gpu.py tests/test_device.py -p no:cacheprovider \
  2>&1 | tee "$out/gpu_tests.txt" | tail -15
timeout 200 python3 -m pytest -q -s benchmarks/test_gpu_bench.py -p no:cacheprovider \
  --benchmark-json="$out/gpu_bench.json" 2>&1 | tee "$out/gpu_bench.txt" | tail -30
