"""The gpu extra, installed into a venv of its own, compiles the kernels.

    python3 benchmarks/gpu_extra.py --kit .gpu --venv DIR [--extra auto|gpu|gpu13]

What ``pip install 'echo_native[gpu13]'`` gives a user is the check, not whatever CuPy
and CUDA toolkit a machine happens to hold.  A device machine reaches no package
index, so the extra's packages come from the distributions installed on it: the
requirements of ``echo_native[EXTRA]`` (the carried wheel's METADATA) are resolved,
with their markers and extras, against what is installed, and each distribution's
files (its RECORD) are copied into a new venv that does not see the system's site
packages.  A requirement that is not installed, or not in a version the extra allows,
fails the check by name.  The wheel itself is unpacked into that venv.  Then the
venv's Python, isolated (``-I``, from an empty folder, CUDA_PATH and CUDA_HOME unset),
builds ``CudaDevice(0)``: the kernels compile with the extra's CuPy, headers and NVRTC,
or the check fails.  ``auto`` picks the extra of the CuPy installed (cupy-cuda13x:
gpu13, cupy-cuda12x: gpu).
"""
from __future__ import annotations

import argparse
import concurrent.futures
import glob
import importlib.metadata as md
import os
import re
import shutil
import subprocess
import sys
import tempfile
import venv
import zipfile
from email.parser import Parser

from packaging.requirements import Requirement

COMPILE = """\
import os, sys
import cupy, echo_native
from echo_native.backends.cuda import CudaDevice, KERNELS
for m in (echo_native, cupy):
    assert m.__file__.startswith(sys.prefix), f"{m.__name__} from {m.__file__}, not the venv"
CudaDevice(0)
print("compiled", ", ".join(KERNELS), "with cupy", cupy.__version__, "from", cupy.__file__)
try:  # CuPy >= 14.2: the options (headers included) it compiled with; only shown
    print("NVRTC options:", " ".join(cupy._core.core.assemble_cupy_compiler_options(())))
except Exception as e:  # noqa: BLE001
    print("NVRTC options not shown:", type(e).__name__, e)
"""


def canonical(name):
    return re.sub(r"[-_.]+", "-", name).lower()


def wheel_metadata(wheel):
    with zipfile.ZipFile(wheel) as z:
        name = next(n for n in z.namelist() if re.fullmatch(r"[^/]+\.dist-info/METADATA", n))
        return Parser().parsestr(z.read(name).decode())


def auto_extra():
    for dist, extra in (("cupy-cuda13x", "gpu13"), ("cupy-cuda12x", "gpu")):
        try:
            md.distribution(dist)
            return extra
        except md.PackageNotFoundError:
            pass
    return "gpu13"


def wanted(req, extras):
    """``req`` applies when its package is asked for with ``extras``."""
    if req.marker is None:
        return True
    return any(req.marker.evaluate({"extra": e}) for e in {"", *extras})


def resolve(requires, extras):
    """``({name: distribution}, [problems])``: the installed distributions that
    ``requires`` (Requires-Dist strings of a package asked for with ``extras``) needs,
    transitively."""
    found, problems = {}, []
    asked = {}   # name -> extras already followed
    todo = [(Requirement(r), set(extras)) for r in requires]
    todo = [(r, None) for r, e in todo if wanted(r, e)]
    while todo:
        req, _ = todo.pop()
        name = canonical(req.name)
        what = f"{req.name}{req.specifier}"
        try:
            dist = md.distribution(req.name)
        except md.PackageNotFoundError:
            problems.append(f"{what} is not installed on this machine")
            continue
        if req.specifier and not req.specifier.contains(dist.version, prereleases=True):
            problems.append(f"{what} but {dist.metadata['Name']} {dist.version} is installed")
            continue
        new = set(req.extras) - asked.get(name, set())
        if name in found and not new:
            continue
        asked[name] = asked.get(name, set()) | set(req.extras)
        found[name] = dist
        for r in dist.requires or ():
            r = Requirement(r)
            if wanted(r, asked[name]):
                todo.append((r, None))
    return found, problems


def site_packages(python):
    return subprocess.run([python, "-I", "-c", "import sysconfig; p = sysconfig.get_paths(); "
                           "print(p['purelib']); print(p['platlib'])"],
                          capture_output=True, text=True, check=True).stdout.split()


def place(src, dst):
    os.makedirs(os.path.dirname(dst), exist_ok=True)
    try:
        os.link(src, dst)  # the same file system: no copy of CUDA's libraries
    except OSError:
        shutil.copy2(src, dst)


def install_dist(dist, site):
    """The files of ``dist`` that live in site-packages (its RECORD), into ``site``."""
    n = 0
    for f in dist.files or ():
        rel = str(f)
        if rel.startswith("..") or os.path.isabs(rel) or "__pycache__" in rel:
            continue  # scripts and data outside site-packages; bytecode is remade
        src = f.locate()
        if os.path.isfile(src):
            place(str(src), os.path.join(site, rel))
            n += 1
    return n


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--kit", default=".gpu", help="folder of the echo_native wheel")
    p.add_argument("--wheel", help="the wheel (default: the kit's echo_native-*.whl)")
    p.add_argument("--extra", default="auto")
    p.add_argument("--venv", required=True)
    p.add_argument("--check", default=COMPILE, help="Python code the venv runs")
    a = p.parse_args(argv)
    wheels = [a.wheel] if a.wheel else sorted(glob.glob(os.path.join(a.kit, "echo_native-*.whl")))
    if not wheels or not os.path.isfile(wheels[0]):
        print(f"gpu_extra: no echo_native wheel in {a.kit} (bash benchmarks/gpu_prepare.sh)")
        return 2
    wheel = wheels[0]
    meta = wheel_metadata(wheel)
    extra = auto_extra() if a.extra == "auto" else a.extra
    if extra not in meta.get_all("Provides-Extra", []):
        print(f"gpu_extra: {meta['Name']} has no extra {extra!r}")
        return 2
    found, problems = resolve(meta.get_all("Requires-Dist", []), {extra})
    print(f"gpu_extra: {meta['Name']}[{extra}] needs "
          + ", ".join(f"{d.metadata['Name']} {d.version}" for d in found.values()))
    if problems:
        print("gpu_extra: the extra cannot be installed from this machine:\n  "
              + "\n  ".join(problems))
        return 3
    venv.EnvBuilder(with_pip=False, system_site_packages=False, clear=True,
                    symlinks=True).create(a.venv)
    python = os.path.join(a.venv, "bin", "python")
    site = site_packages(python)[0]
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        files = sum(pool.map(lambda d: install_dist(d, site), found.values()))
    with zipfile.ZipFile(wheel) as z:
        z.extractall(site, [m for m in z.namelist()
                            if not m.split("/", 1)[0].endswith(".data")])
    print(f"gpu_extra: {len(found)} distributions ({files} files) and {os.path.basename(wheel)}"
          f" in {a.venv}")
    env = {k: v for k, v in os.environ.items()
           if k not in ("CUDA_PATH", "CUDA_HOME") and not k.startswith("PYTHON")}
    with tempfile.TemporaryDirectory() as empty:
        r = subprocess.run([python, "-I", "-c", a.check], cwd=empty, env=env, check=False)
    print(f"gpu_extra: check exit {r.returncode}")
    return r.returncode


if __name__ == "__main__":
    sys.exit(main())
