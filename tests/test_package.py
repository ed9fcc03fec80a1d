"""Import hygiene: the library never needs the lab, torch, matplotlib or scikit-image.

``echo_native/`` (outside ``lab/``) is what users install and import; the lab
(``echo_native.lab``) and the heavy optional packages are for benchmarks and the
demo.  Two checks: a static scan of every import statement (module level and
inside functions) of the library's sources, and a fresh interpreter in which those
packages cannot be imported at all, which imports every library module and runs
``echo-native profile`` end to end.
"""
from __future__ import annotations

import ast
import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

import echo_native

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))
import sources_helpers as sh  # noqa: E402

PKG = Path(echo_native.__file__).resolve().parent
FORBIDDEN = ("echo_native.lab", "torch", "matplotlib", "skimage")
# Every library source: the package's own files and its backends (never lab/).
LIBRARY_FILES = sorted([*PKG.glob("*.py"), *(PKG / "backends").glob("*.py")])


def _module_name(path):
    rel = path.relative_to(PKG.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _is_forbidden(name):
    return any(name == f or name.startswith(f + ".") for f in FORBIDDEN)


def _imported_names(path, text=None):
    """(line, absolute module name) of every import in ``path`` (or ``text``), at any depth.

    Relative imports are resolved against the file's package; ``from X import Y``
    yields both ``X`` and ``X.Y`` (Y may be a submodule); a literal string passed
    to ``importlib.import_module`` or ``__import__`` counts as an import too.
    """
    package = _module_name(path)
    if path.name != "__init__.py":
        package = package.rpartition(".")[0]
    out = []
    text = path.read_text() if text is None else text
    for node in ast.walk(ast.parse(text, str(path))):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[:len(anchor) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            out.append((node.lineno, base))
            out += [(node.lineno, f"{base}.{a.name}") for a in node.names]
        elif isinstance(node, ast.Call):
            fn = node.func
            called = fn.attr if isinstance(fn, ast.Attribute) else getattr(fn, "id", None)
            if (called in ("import_module", "__import__") and node.args
                    and isinstance(node.args[0], ast.Constant)
                    and isinstance(node.args[0].value, str)):
                out.append((node.lineno, node.args[0].value))
    return out


def test_scan_sees_the_library_and_flags_a_lab_import():
    names = {p.relative_to(PKG).as_posix() for p in LIBRARY_FILES}
    assert {"__init__.py", "cli.py", "profile.py", "pipeline.py", "backends/cuda.py"} <= names
    assert not any(n.startswith("lab/") for n in names)
    # the scanner itself finds imports inside functions, relative ones and import_module
    src = textwrap.dedent("""
        def f():
            import torch.nn
            from ..lab import corpus
            from . import cpu
        importlib.import_module("matplotlib.pyplot")
    """)
    # parsed as if it were a file of echo_native/backends/ (nothing is written there)
    found = [n for _, n in _imported_names(PKG / "backends" / "_probe.py", src)]
    assert "echo_native.backends.cpu" in found
    assert [n for n in found if _is_forbidden(n)] == ["torch.nn", "echo_native.lab",
                                                      "echo_native.lab.corpus",
                                                      "matplotlib.pyplot"]


@pytest.mark.parametrize("path", LIBRARY_FILES, ids=lambda p: p.relative_to(PKG).as_posix())
def test_library_sources_do_not_import_lab_or_heavy_packages(path):
    rel = path.relative_to(PKG).as_posix()
    lazy = _function_lines(path) if rel in LAZY_OPTIONAL else set()
    bad = [(line, n) for line, n in _imported_names(path) if _is_forbidden(n)
           and not (line in lazy and n in LAZY_OPTIONAL[rel])]
    assert not bad, f"{rel} imports {bad}"


# An optional backend a converter imports when it is called (never at import time, never
# on the pipeline's path): Objects.to_torchvision makes torch tensors, so it imports torch.
LAZY_OPTIONAL = {"boxes.py": {"torch"}}


def _function_lines(path):
    """The lines inside a function's body in ``path``."""
    lines = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            lines.update(range(node.body[0].lineno, node.end_lineno + 1))
    return lines


def test_a_lazy_optional_import_at_module_level_is_still_flagged(tmp_path):
    """The allowance covers imports inside a function only."""
    probe = tmp_path / "boxes.py"
    probe.write_text("import torch\n\ndef f():\n    import torch\n")
    lazy = _function_lines(probe)
    found = [(line, n) for line, n in _imported_names(PKG / "boxes.py", probe.read_text())
             if _is_forbidden(n)]
    assert found == [(1, "torch"), (4, "torch")]
    assert [(line, n) for line, n in found if line not in lazy] == [(1, "torch")]


BLOCKED_RUN = r"""
import importlib, json, sys
BLOCK = {blocked!r}
for name in BLOCK:
    sys.modules[name] = None  # `import name` (and name.sub) now raises ImportError
# the block works: the lab and torch cannot be imported here
for name in ("echo_native.lab.corpus", "torch"):
    try:
        importlib.import_module(name)
    except ImportError:
        pass
    else:
        raise SystemExit(f"block failed: {{name}} imported")
for name in {modules!r}:
    importlib.import_module(name)
from echo_native.cli import main
rc = main(["profile", {folder!r}, "--step-ms", "1", "--batch-size", "8", "--image-size", "32",
           "--workers", "1", "--seconds", "0.2", "--min-batches", "3", "--json", {js!r}])
leaked = sorted(m for m in sys.modules
                if sys.modules[m] is not None and any(m == b or m.startswith(b + ".")
                                                      for b in BLOCK))
print(json.dumps({{"rc": rc, "leaked": leaked}}))
"""


#: Library modules of an optional extra, which import its packages at the top.
EXTRA_MODULES = {"echo_native.ray": "ray"}


def test_only_the_ray_module_imports_ray():
    """Ray stays optional: only echo_native.ray imports it; the rest of the library works
    without it."""
    for path in LIBRARY_FILES:
        name = _module_name(path)
        importers = [n for _, n in _imported_names(path) if n == "ray" or n.startswith("ray.")]
        if name == "echo_native.ray":
            assert importers, "echo_native.ray no longer imports ray: update EXTRA_MODULES"
        else:
            assert not importers, f"{name} imports {importers}"


def test_library_imports_and_profiles_without_lab_or_heavy_packages(tmp_path):
    folder = str(sh.write_folder(tmp_path / "data", sh.photo_jpegs(16, seed=4),
                                 np.arange(16) % 2))
    js = str(tmp_path / "p.json")
    # echo_native.ray is an extra's module: it needs Ray ([ray]), and nothing else in the
    # library imports it (test_only_the_ray_module_imports_ray).
    modules = [_module_name(p) for p in LIBRARY_FILES
               if p.name != "__main__.py" and _module_name(p) not in EXTRA_MODULES]
    assert "echo_native.profile" in modules and "echo_native.backends.cuda" in modules
    code = BLOCKED_RUN.format(blocked=list(FORBIDDEN), modules=modules, folder=folder, js=js)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       timeout=300, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    result = json.loads(r.stdout.strip().splitlines()[-1])
    assert result == {"rc": 0, "leaked": []}, r.stderr
    assert json.loads(Path(js).read_text())["upstream_img_per_s"] > 0


# --- the bench extra carries every package the lab imports -----------------------------

ROOT = HERE.parent
LAB = PKG / "lab"
# Import names whose distribution is named otherwise; any other import name must be a
# distribution name itself.  Two-level names first: namespace packages (nvidia.*) hold
# many distributions.
IMPORT_TO_DIST = {"PIL": "pillow", "skimage": "scikit-image", "nvidia.dali": "nvidia-dali-cuda120",
                  "cupy": "cupy-cuda12x", "yaml": "pyyaml", "cv2": "opencv-python"}


def _normalise(dist):
    return re.sub(r"[-_.]+", "-", dist).lower()


def _pyproject():
    try:
        import tomllib
    except ImportError:  # Python 3.10: pytest itself depends on tomli there
        import tomli as tomllib
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def _requirement_names(reqs):
    from packaging.requirements import Requirement

    return {_normalise(Requirement(r).name) for r in reqs}


def _module_path(name):
    """The source file of an ``echo_native`` module, or None (a compiled one, or none)."""
    rel = Path(*name.split("."))
    for cand in (PKG.parent / rel.with_suffix(".py"), PKG.parent / rel / "__init__.py"):
        if cand.is_file():
            return cand
    return None


def _module_level_imports(path):
    """Like _imported_names, but only the statements that run when the module is imported
    (not those inside functions or classes): what importing it costs."""
    tree = ast.parse(path.read_text(), str(path))
    lines = set()
    stack = list(tree.body)
    while stack:
        node = stack.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            continue
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            lines.add(node.lineno)
        stack.extend(ast.iter_child_nodes(node))
    return [(line, n) for line, n in _imported_names(path) if line in lines]


def _third_party_imports(start):
    """{top-level import name: [where]} of every third-party import reachable from module
    ``start``: every import of every lab module it reaches (any depth: the lab imports its
    heavy packages inside functions), and the module-level imports of the library modules
    those reach."""
    seen, todo, found = set(), [start], {}
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        path = _module_path(name)
        if path is None:
            continue
        in_lab = name == "echo_native.lab" or name.startswith("echo_native.lab.")
        imports = _imported_names(path) if in_lab else _module_level_imports(path)
        for line, imported in imports:
            top = imported.split(".")[0]
            if top == "echo_native":
                todo.append(imported)
            elif top not in sys.stdlib_module_names and top != "__future__":
                two = ".".join(imported.split(".")[:2])
                key = two if two in IMPORT_TO_DIST else top
                found.setdefault(key, []).append(f"{path.relative_to(ROOT)}:{line}")
    return found


def _missing_from_extra(found, extra_names, base_names):
    """Imports whose distribution neither the extra nor the base dependencies list."""
    listed = extra_names | base_names
    return {name: where for name, where in found.items()
            if _normalise(IMPORT_TO_DIST.get(name, name)) not in listed}


def test_bench_import_scan_finds_the_peers_the_corpus_and_the_chart():
    """The scan of the lab's import graph sees the packages the bench is known to use, and
    reports those an extra lacks with the line that imports them."""
    found = _third_party_imports("echo_native.lab.cli")
    assert {"matplotlib", "torch", "nvidia.dali", "spdl", "turboloader", "skimage", "PIL",
            "numpy", "tqdm"} <= set(found)
    assert "nvidia" not in found  # resolved to the distribution-level name
    assert any(w.startswith("echo_native/lab/peers.py:") for w in found["nvidia.dali"])
    # the bench extra as it was in 0.2.0: no chart, no torch, no SPDL or turboloader
    old_extra = _requirement_names([
        "pytest>=8", "pytest-benchmark>=4", "scikit-image>=0.22", "tqdm>=4",
        "nvidia-dali-cuda120>=1.44; platform_system == 'Linux'", "fsspec>=2023.1",
        "s3fs>=2023.1", "moto[server]>=5"])
    missing = _missing_from_extra(found, old_extra, {"numpy", "pillow", "tqdm", "cloudpickle"})
    assert set(missing) == {"matplotlib", "torch", "spdl", "turboloader"}
    assert any(w.startswith("echo_native/lab/cli.py:") for w in missing["matplotlib"])


def test_bench_extra_lists_every_package_the_lab_imports():
    """`pip install .[bench]` installs every third-party package echo-native-lab imports."""
    project = _pyproject()["project"]
    extra = _requirement_names(project["optional-dependencies"]["bench"])
    base = _requirement_names(project["dependencies"])
    missing = _missing_from_extra(_third_party_imports("echo_native.lab.cli"), extra, base)
    assert not missing, f"add to the bench extra in pyproject.toml: {missing}"


# --- a source build without libjpeg-turbo's headers stops with one line ----------------

JPEG_MISSING = ("error: jpeglib.h (libjpeg-turbo's headers) not found: install "
                "libjpeg62-turbo-dev (Debian/Ubuntu) or libjpeg-turbo-devel (Fedora/RHEL), "
                "or set ECHO_NATIVE_JPEG_DIR to a libjpeg-turbo prefix")


@pytest.fixture(scope="module")
def build_tree(tmp_path_factory):
    """What setup.py needs to build the extensions, copied (the checkout is never built
    in): a cythonized build/cython is copied with its times, so it is not redone."""
    tree = tmp_path_factory.mktemp("sdist")
    for name in ("setup.py", "pyproject.toml", "README.md"):
        shutil.copy2(ROOT / name, tree / name)
    shutil.copytree(ROOT / "src", tree / "src", ignore=shutil.ignore_patterns("*.so", "*.o"))
    if (ROOT / "build" / "cython").is_dir():
        shutil.copytree(ROOT / "build" / "cython", tree / "build" / "cython")
    return tree


def _compiler():
    """The C compiler command setuptools would use (CC, CFLAGS from the environment)."""
    from setuptools._distutils.ccompiler import new_compiler
    from setuptools._distutils.sysconfig import customize_compiler

    cc = new_compiler()
    customize_compiler(cc)
    return cc.compiler_so


def _sysroot_without_jpeglib(tmp_path):
    """A --sysroot whose usr/include is the system's, less jpeglib.h: the compiler finds
    every other header where it always does."""
    inc = tmp_path / "sysroot" / "usr" / "include"
    inc.mkdir(parents=True)
    for entry in Path("/usr/include").iterdir():
        if entry.name != "jpeglib.h":
            (inc / entry.name).symlink_to(entry)
    return inc.parent.parent


def _build_ext(tree, **env):
    environ = {k: v for k, v in os.environ.items()
               if k not in ("CPATH", "C_INCLUDE_PATH", "ECHO_NATIVE_JPEG_DIR")}
    return subprocess.run(
        [sys.executable, "setup.py", "-q", "build_ext", "--build-temp", "tmp",
         "--build-lib", "lib"], cwd=tree, env={**environ, **env}, capture_output=True,
        text=True, timeout=300)


def _error_lines(r):
    return [ln for ln in (r.stdout + r.stderr).splitlines() if "error" in ln.lower()]


def test_build_without_jpeg_headers_stops_with_one_line(build_tree, tmp_path):
    """setup.py build_ext where jpeglib.h is missing: one line naming the header and the
    packages that provide it, no compiler output, no traceback, nothing compiled."""
    sysroot = _sysroot_without_jpeglib(tmp_path)
    cflags = f"{os.environ.get('CFLAGS', '')} --sysroot={sysroot}".strip()
    # the sysroot hides jpeglib.h and nothing else
    probe = tmp_path / "probe.c"
    probe.write_text("#include <stddef.h>\n#include <stdio.h>\n#include <jpeglib.h>\n")
    cc = _compiler()
    hidden = subprocess.run([*cc, f"--sysroot={sysroot}", "-c", str(probe), "-o",
                             str(tmp_path / "p.o")], capture_output=True, text=True, timeout=60)
    assert hidden.returncode != 0 and "jpeglib.h" in hidden.stderr, hidden.stderr
    probe.write_text("#include <stddef.h>\n#include <stdio.h>\n#include <math.h>\n")
    other = subprocess.run([*cc, f"--sysroot={sysroot}", "-c", str(probe), "-o",
                            str(tmp_path / "p.o")], capture_output=True, text=True, timeout=60)
    assert other.returncode == 0, other.stderr

    r = _build_ext(build_tree, CFLAGS=cflags)
    assert r.returncode != 0
    assert _error_lines(r) == [JPEG_MISSING], r.stdout + r.stderr
    assert "Traceback" not in r.stderr and "#include" not in r.stderr, r.stderr
    assert not list((build_tree / "tmp").rglob("*.o")), "the build compiled before the check"


def test_build_with_an_empty_jpeg_dir_names_it(build_tree, tmp_path):
    """ECHO_NATIVE_JPEG_DIR without include/jpeglib.h: one line naming the variable and
    its value (the system's header would otherwise pair with that prefix's library)."""
    empty = tmp_path / "libjpeg-turbo"
    empty.mkdir()
    r = _build_ext(build_tree, ECHO_NATIVE_JPEG_DIR=str(empty))
    assert r.returncode != 0
    assert _error_lines(r) == [
        f"error: ECHO_NATIVE_JPEG_DIR={empty} has no include/jpeglib.h: point it at a "
        "libjpeg-turbo prefix (include/ and lib/), or unset it and install "
        "libjpeg62-turbo-dev (Debian/Ubuntu) or libjpeg-turbo-devel (Fedora/RHEL)"], \
        r.stdout + r.stderr
    assert "Traceback" not in r.stderr
