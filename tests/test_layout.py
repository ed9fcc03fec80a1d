"""The layout tells the architecture: the library's modules, in the order the package
docstring lists them, import only modules above them, and none is over ~600 lines."""
from __future__ import annotations

import ast
import re
from pathlib import Path

import echo_native

PACKAGE = Path(echo_native.__file__).resolve().parent


def _order():
    """Module names in the order of ``echo_native/__init__.py``'s docstring (the first
    word of each line, and the modules named in parentheses after a semicolon)."""
    order = ["_checks", "_iteration"]
    for line in echo_native.__doc__.splitlines():
        m = re.match(r"^  (\w+)\s", line)
        if m:
            order.append(m.group(1))
        order += [w for w in re.findall(r"(?:^|;|,)\s*(\w+) \(", line.strip())
                  if (PACKAGE / f"{w}.py").exists() and w not in order]
    return order


def _library_modules():
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE)
        if rel.parts[0] == "lab" or rel.name == "__init__.py" or rel.name == "__main__.py":
            continue
        yield rel.parts[0].removesuffix(".py"), path


def test_every_library_module_is_in_the_pipeline_order():
    """The package docstring names every module of the library (the CLI and profile
    are tools on top of it)."""
    order = set(_order()) | {"cli", "profile"}
    missing = {name for name, _ in _library_modules()} - order
    assert not missing, missing


def test_imports_point_down_the_pipeline():
    """No module imports one listed after it: following one batch from the source to the
    consumer is one pass down the list."""
    rank = {name: i for i, name in enumerate(_order())}
    rank.update(profile=len(rank), cli=len(rank) + 1)
    climbs = []
    for name, path in _library_modules():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and \
                    node.module.startswith("echo_native."):
                target = node.module.split(".")[1]
                if target in rank and rank[target] > rank[name]:
                    climbs.append(f"{path.relative_to(PACKAGE)}:{node.lineno} imports {target}")
    assert not climbs, climbs


def test_no_library_module_is_over_about_600_lines():
    """Each module is one idea: none of the library's is over 650 lines."""
    long = {str(p.relative_to(PACKAGE)): n for _, p in _library_modules()
            if (n := len(p.read_text().splitlines())) > 650}
    assert not long, long


def test_no_compiled_core_file_is_over_about_600_lines():
    """The compiled core is held to the same size: its bindings (a thin .pyx and the
    component files it includes), C, C++, CUDA and headers."""
    src = Path(__file__).resolve().parent.parent / "src"
    files = [p for p in src.rglob("*")
             if p.suffix in {".pyx", ".pxi", ".pxd", ".c", ".cpp", ".h", ".cu"}]
    assert files
    long = {str(p.relative_to(src)): n for p in files
            if (n := len(p.read_text().splitlines())) > 650}
    assert not long, long
