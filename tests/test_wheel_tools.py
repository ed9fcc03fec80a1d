"""The wheel's smoke test (tools/wheel_smoke.py, run by .ci/run on the built wheel in a
fresh venv) refuses the setups it exists to rule out, here, where echo_native is the
checkout's own build linked against the system's libjpeg."""
from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

import echo_native

ROOT = Path(__file__).resolve().parent.parent
SMOKE = ROOT / "tools" / "wheel_smoke.py"


def _load_smoke():
    spec = importlib.util.spec_from_file_location("wheel_smoke", SMOKE)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _run(tmp_path, *args):
    return subprocess.run([sys.executable, str(SMOKE), *args], cwd=tmp_path,
                          capture_output=True, text=True, timeout=120)


def test_smoke_refuses_echo_native_from_outside_its_environment(tmp_path):
    """The smoke test fails, in one line, when echo_native comes from a source tree (here:
    the folder this echo_native is imported from) or from outside its environment."""
    pkg_parent = Path(echo_native.__file__).resolve().parent.parent
    r = _run(tmp_path, "--source-tree", str(pkg_parent))
    assert r.returncode != 0
    line = r.stderr.strip().splitlines()[-1]
    assert line.startswith("wheel smoke: FAILED: echo_native imported from"), r.stderr


def test_smoke_refuses_a_library_that_is_not_hidden(tmp_path):
    """--hidden names a file the caller covered: one that still has bytes fails the run."""
    lib = tmp_path / "libjpeg.so.62"
    lib.write_bytes(b"\x7fELF")
    r = _run(tmp_path, "--hidden", str(lib))
    assert r.returncode != 0
    assert f"wheel smoke: FAILED: {lib} is not hidden (4 bytes)" in r.stderr


def test_mapped_libjpeg_accepts_only_the_bundled_copy():
    """The check that the wheel's bundled libjpeg is the one mapped: where the kernel links
    the system's (a checkout's build) it fails and names what is mapped.  (Where this runs
    on an installed wheel, the kernel has mapped the wheel's own copy instead.)"""
    from echo_native import _kernel  # noqa: F401  (maps the libjpeg it links)

    smoke = _load_smoke()
    pkg = Path(echo_native.__file__).resolve().parent
    bundled = pkg.parent / "echo_native.libs"
    if bundled.is_dir():
        assert f"{bundled}/libjpeg" in Path("/proc/self/maps").read_text()
    else:
        with pytest.raises(SystemExit, match=r"no libjpeg from .*echo_native\.libs is mapped"):
            smoke.mapped_libjpeg(pkg)
