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


# What names each object field in code (docstrings and comments aside), and the files
# outside its own module allowed to: the record's C table, the list of fields, the
# source that reads it (COCO) and the package's exports.
FIELD_WORDS = {
    "keypoints": {"keypoints", "Keypoints", "KEYPOINTS", "obj_keypoints", "max_keypoints",
                  "source_keypoints", "map_keypoints", "flip_indices"},
    "masks": {"masks", "MASKS", "obj_masks", "mask_bytes", "StoredMasks", "Segments",
              "as_segments", "rasterise", "pack_masks", "unpack_masks"},
}
FIELD_HOMES = {"src/ring/en_ring.h", "echo_native/targets.py", "echo_native/coco.py",
               "echo_native/__init__.py"}


def _code_words(path):
    """The identifiers, attributes, keywords, imported names and non-docstring strings
    of a Python file; the identifiers of a C file, comments left out."""
    text = path.read_text()
    if path.suffix != ".py":
        text = re.sub(r"/\*.*?\*/|//[^\n]*", " ", text, flags=re.S)
        return set(re.findall(r"[A-Za-z_]\w*", text))
    tree = ast.parse(text)
    docstrings = {id(n.body[0].value) for n in ast.walk(tree)
                  if isinstance(n, (ast.Module, ast.ClassDef, ast.FunctionDef,
                                    ast.AsyncFunctionDef))
                  and n.body and isinstance(n.body[0], ast.Expr)
                  and isinstance(n.body[0].value, ast.Constant)}
    words = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name):
            words.add(node.id)
        elif isinstance(node, ast.Attribute):
            words.add(node.attr)
        elif isinstance(node, ast.keyword) and node.arg:
            words.add(node.arg)
        elif isinstance(node, ast.alias):
            words.add(node.asname or node.name)
        elif isinstance(node, ast.ImportFrom) and node.module:
            words.update(node.module.split("."))
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and \
                id(node) not in docstrings:
            words.update(re.findall(r"[A-Za-z_]\w*", node.value))
    return words


def test_an_object_field_lives_in_its_module_and_four_files_more():
    """Keypoints and masks are each one module (an ObjectField) plus four files: the
    record's table in en_ring.h, the list of fields in targets.py, the COCO source and
    the package's exports.  The ring, workers, loader, echo buffer, batches, objects and
    devices carry any field without naming it."""
    root = PACKAGE.parent
    files = [p for p in PACKAGE.rglob("*.py") if "lab" not in p.relative_to(PACKAGE).parts]
    files += [p for p in (root / "src").rglob("*")
              if p.suffix in {".pyx", ".pxi", ".pxd", ".c", ".cpp", ".h", ".cu"}]
    for field, words in FIELD_WORDS.items():
        named = {str(p.relative_to(root)) for p in files if _code_words(p) & words}
        outside = named - {f"echo_native/{field}.py"}
        assert outside <= FIELD_HOMES and len(outside) <= 4, (field, sorted(outside))
        assert "src/ring/en_ring.h" in outside and "echo_native/targets.py" in outside
