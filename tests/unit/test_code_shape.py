"""Code shape of rlhf_core/, flows/, tasks/ (and bench/): short functions, short modules, no import cycles.

An algorithm should read top to bottom (STYLE.md 1), so no function or method runs past 80
lines and no module past 600 (a longer one holds more than one concern: split it where the concern
splits); the benchmark scripts under bench/ keep the same shape. Modules form a layered graph, so no two import each other, directly or through
others — function-local imports included, since they hide a cycle from Python, not from a
reader. The import graph comes from ``scripts/import_cycles.py`` (also runnable on its own).
"""

from __future__ import annotations

import ast
import importlib.util
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PACKAGES = ("rlhf_core", "flows", "tasks")
SHAPED = PACKAGES + ("bench",)  # folders whose functions and modules are held to the limits below
MAX_FUNCTION_LINES = 80
MAX_MODULE_LINES = 600


def _load_import_cycles():
    spec = importlib.util.spec_from_file_location("import_cycles", REPO / "scripts" / "import_cycles.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def long_functions(limit: int = MAX_FUNCTION_LINES) -> list[tuple[str, int, str, int]]:
    """(file, line, name, length) of every function or method, nested ones included, over ``limit`` lines."""
    out = []
    for package in SHAPED:
        for path in sorted((REPO / package).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), filename=str(path))):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    length = node.end_lineno - node.lineno + 1
                    if length > limit:
                        out.append((str(path.relative_to(REPO)), node.lineno, node.name, length))
    return sorted(out)


def test_no_function_is_longer_than_80_lines():
    offenders = long_functions()
    assert not offenders, f"functions longer than {MAX_FUNCTION_LINES} lines (split them into named helpers):\n" + \
        "\n".join(f"  {file}:{line} {name}: {length} lines" for file, line, name, length in offenders)


def long_modules(limit: int = MAX_MODULE_LINES) -> list[tuple[str, int]]:
    """(file, lines) of every module over ``limit`` lines."""
    out = []
    for package in SHAPED:
        for path in sorted((REPO / package).rglob("*.py")):
            lines = len(path.read_text(encoding="utf-8").splitlines())
            if lines > limit:
                out.append((str(path.relative_to(REPO)), lines))
    return out


def test_no_module_is_longer_than_600_lines():
    offenders = long_modules()
    assert not offenders, f"modules longer than {MAX_MODULE_LINES} lines (split them where the concern splits):\n" + \
        "\n".join(f"  {file}: {lines} lines" for file, lines in offenders)


def test_no_import_cycles():
    ic = _load_import_cycles()
    graph = ic.import_graph(REPO, PACKAGES)
    cycles = ic.import_cycles(REPO, PACKAGES)
    assert not cycles, "modules that import each other (function-local imports count):\n" + ic.describe(cycles, graph)


def test_import_graph_sees_function_local_and_relative_imports(tmp_path):
    """The checker itself: a cycle closed only by a function-local, relative import is found."""
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from pkg.b import g\n")
    (pkg / "b.py").write_text("def g():\n    from . import a\n")
    (pkg / "c.py").write_text("import pkg.a\n")
    ic = _load_import_cycles()
    assert ic.import_cycles(tmp_path, ("pkg",)) == [["pkg.a", "pkg.b"]]


def test_no_flows_module_shadows_the_standard_library():
    """Prefect puts a deployment entrypoint's folder (``flows/``) on ``sys.path``: a ``flows/profile.py`` there made
    ``import cProfile`` (torch, under transformers) find it instead of the standard library's ``profile``."""
    import sys

    shadows = sorted(p.name for p in (REPO / "flows").iterdir()
                     if p.stem in sys.stdlib_module_names and (p.suffix == ".py" or (p / "__init__.py").exists()))
    assert not shadows, f"flows/ modules named like standard-library ones: {shadows}"
