#!/usr/bin/env bash
# Build libjpeg-turbo from its release source into PREFIX (include/, lib/): the library a
# manylinux wheel bundles ([tool.cibuildwheel] before-all; setup.py builds against it
# with ECHO_NATIVE_JPEG_DIR=PREFIX and auditwheel copies it into the wheel).
#
#   tools/build_libjpeg_turbo.sh [PREFIX]        # default /opt/libjpeg-turbo
#
# Why not the image's libjpeg-turbo-devel: manylinux_2_28 (AlmaLinux 8) ships 1.5.3,
# which predates the ICC warning code the kernel handles (JWRN_BOGUS_ICC, 2.0) and the
# AVX2 decoder (2.0).  2.1.5.1 is the release Debian 12's libjpeg62-turbo (2.1.5), the one
# the test suite runs against, is cut from.  Needs curl, cmake, a C compiler and, on
# x86_64, nasm (the SIMD code; the build refuses to go without it).
set -euo pipefail
prefix=${1:-/opt/libjpeg-turbo}
version=2.1.5.1
sha256=2fdc3feb6e9deb17adec9bafa3321419aa19f8f4e5dea7bf8486844ca22207bf
url=https://github.com/libjpeg-turbo/libjpeg-turbo/releases/download/$version/libjpeg-turbo-$version.tar.gz

if [ -f "$prefix/include/jpeglib.h" ] && [ -e "$prefix/lib/libjpeg.so.62" ]; then
  echo "libjpeg-turbo already in $prefix"; exit 0
fi
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
curl -fsSL --retry 3 -o "$work/src.tar.gz" "$url"
echo "$sha256  $work/src.tar.gz" | sha256sum -c --quiet -
tar -xzf "$work/src.tar.gz" -C "$work"
cmake -S "$work/libjpeg-turbo-$version" -B "$work/build" -DCMAKE_BUILD_TYPE=Release \
  -DCMAKE_INSTALL_PREFIX="$prefix" -DCMAKE_INSTALL_LIBDIR=lib -DENABLE_STATIC=OFF \
  -DWITH_TURBOJPEG=OFF -DREQUIRE_SIMD=ON >"$work/cmake.log" 2>&1 || {
  tail -30 "$work/cmake.log" >&2; exit 1; }
cmake --build "$work/build" -j "$(nproc)" >"$work/make.log" 2>&1 || {
  tail -30 "$work/make.log" >&2; exit 1; }
cmake --install "$work/build" >/dev/null
echo "libjpeg-turbo $version in $prefix"
