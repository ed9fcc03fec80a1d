#!/usr/bin/env bash
# Install a built wheel where nothing could build it, and run the smoke test there:
#
#   tools/wheel_smoke.sh WHEEL [VENV]      # VENV: default a new one under $TMPDIR
#
# Inside a private mount namespace (unshare -m; unshare -rm when not root) every copy of
# the system's libjpeg, libjpeg-turbo's headers and the C/C++ compilers are covered by an
# empty unreadable file; there a fresh venv outside the source tree gets the wheel and
# torch (binary only: pip may build nothing) and runs tools/wheel_smoke.py from a
# directory outside the tree.  TORCH_REQ overrides the torch requirement (torch==2.13.0).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
[ $# -ge 1 ] && [ -f "$1" ] || { echo "usage: tools/wheel_smoke.sh WHEEL [VENV]" >&2; exit 2; }
wheel=$(readlink -f "$1")
py=${PYTHON:-python3}
work=$(mktemp -d "${TMPDIR:-/tmp}/en-smoke.XXXXXX")
trap 'rm -rf "$work"' EXIT
venv=${2:-$work/venv}
case "$(readlink -f "$(dirname "$venv")")/" in
  "$root"/*) echo "tools/wheel_smoke.sh: the venv must be outside the source tree" >&2; exit 2;;
esac
cp "$root/tools/wheel_smoke.py" "$work/"
: >"$work/empty"
chmod 000 "$work/empty"

hide=()
add() { local f; f=$(readlink -f "$1") && [ -f "$f" ] && hide+=("$f") || true; }
while read -r lib; do add "$lib"; done < <(ldconfig -p | awk '/libjpeg\.so/ {print $NF}')
for f in /usr/lib/*/libjpeg.so* /usr/lib/libjpeg.so* /usr/lib64/libjpeg.so* \
         /usr/local/lib/libjpeg.so* /usr/include/jpeglib.h /usr/include/*/jconfig.h \
         /usr/include/jconfig.h /usr/local/include/jpeglib.h; do
  [ -e "$f" ] && add "$f"
done
for c in cc gcc c++ g++ clang clang++; do
  p=$(command -v "$c" 2>/dev/null) && add "$p"
done
mapfile -t hide < <(printf '%s\n' "${hide[@]}" | sort -u)
echo "wheel smoke: hiding ${hide[*]}"

ns=(unshare -m)
[ "$(id -u)" = 0 ] || ns=(unshare -rm)
"${ns[@]}" bash -s -- "$work" "$venv" "$wheel" "$root" "$py" "${TORCH_REQ:-torch==2.13.0}" \
    "${hide[@]}" <<'INNER'
set -euo pipefail
work=$1 venv=$2 wheel=$3 root=$4 py=$5 torch_req=$6
shift 6
args=()
for f in "$@"; do mount --bind "$work/empty" "$f"; args+=(--hidden "$f"); done
[ -x "$venv/bin/python" ] || "$py" -m venv "$venv"
"$venv/bin/python" -m pip install -q --only-binary :all: "$wheel" "$torch_req" \
    2>"$work/pip.log" || { cat "$work/pip.log" >&2; exit 1; }
cd "$work"
"$venv/bin/python" wheel_smoke.py --source-tree "$root" "${args[@]}"
INNER
