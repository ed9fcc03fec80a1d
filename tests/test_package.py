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
    bad = [(line, n) for line, n in _imported_names(path) if _is_forbidden(n)]
    assert not bad, f"{path.relative_to(PKG)} imports {bad}"


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


def test_library_imports_and_profiles_without_lab_or_heavy_packages(tmp_path):
    folder = str(sh.write_folder(tmp_path / "data", sh.photo_jpegs(16, seed=4),
                                 np.arange(16) % 2))
    js = str(tmp_path / "p.json")
    modules = [_module_name(p) for p in LIBRARY_FILES if p.name != "__main__.py"]
    assert "echo_native.profile" in modules and "echo_native.backends.cuda" in modules
    code = BLOCKED_RUN.format(blocked=list(FORBIDDEN), modules=modules, folder=folder, js=js)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       timeout=300, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    result = json.loads(r.stdout.strip().splitlines()[-1])
    assert result == {"rc": 0, "leaked": []}, r.stderr
    assert json.loads(Path(js).read_text())["upstream_img_per_s"] > 0
