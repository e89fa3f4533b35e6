"""Report import cycles among alignflow's own modules (rlhf_core/, flows/, tasks/).

Builds the module import graph from the source with ``ast`` — every ``import`` and
``from ... import``, at top level, inside functions and under ``if TYPE_CHECKING`` — and
prints each strongly connected component of more than one module. A function-local import
counts: it hides a cycle from Python's import machinery, not from the design. Importing
``pkg.mod`` is an edge to ``pkg.mod`` only, not to the ``pkg/__init__.py`` Python also runs.
``tests/unit/test_code_shape.py`` runs the same check.

Run: ``python scripts/import_cycles.py`` (exit status 1 when a cycle is found).
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("rlhf_core", "flows", "tasks")


def module_files(root: Path = REPO, packages: tuple[str, ...] = PACKAGES) -> dict[str, Path]:
    """Dotted module name -> source file, for every .py under ``packages`` (``pkg/__init__.py`` is ``pkg``)."""
    out: dict[str, Path] = {}
    for package in packages:
        for path in sorted((root / package).rglob("*.py")):
            parts = list(path.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join(parts)] = path
    return out


def _resolve(name: str, known: set[str]) -> str | None:
    """The longest prefix of dotted ``name`` that is one of our modules (None for third-party)."""
    parts = name.split(".")
    for end in range(len(parts), 0, -1):
        candidate = ".".join(parts[:end])
        if candidate in known:
            return candidate
    return None


def from_base(node: ast.ImportFrom, module: str, is_package: bool) -> str:
    """The absolute module a ``from ... import`` statement in ``module`` imports from."""
    base = node.module or ""
    if node.level:  # relative: a package is its own anchor, a module its package; one dot up per extra level
        anchor = module.split(".") if is_package else module.split(".")[:-1]
        anchor = anchor[:len(anchor) - (node.level - 1)]
        base = ".".join(anchor + ([base] if base else []))
    return base


def import_targets(node: ast.Import | ast.ImportFrom, module: str, is_package: bool, known: set[str]) -> set[str]:
    """Our modules that one import statement in ``module`` loads."""
    if isinstance(node, ast.Import):
        names = [alias.name for alias in node.names]
    else:
        base = from_base(node, module, is_package)
        # `from pkg import mod` loads the submodule pkg.mod; `from pkg.mod import f` loads pkg.mod.
        names = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
    return {t for t in (_resolve(n, known) for n in names) if t is not None}


def import_graph(root: Path = REPO, packages: tuple[str, ...] = PACKAGES) -> dict[str, set[str]]:
    """Module -> the modules of ours it imports anywhere in its source (self-imports dropped)."""
    files = module_files(root, packages)
    known = set(files)
    graph: dict[str, set[str]] = {name: set() for name in files}
    for name, path in files.items():
        is_package = path.name == "__init__.py"
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), filename=str(path))):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                graph[name] |= import_targets(node, name, is_package, known) - {name}
    return graph


def strongly_connected(graph: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's strongly connected components of ``graph``, each sorted, largest first."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            components.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(components, key=lambda c: (-len(c), c))


def import_cycles(root: Path = REPO, packages: tuple[str, ...] = PACKAGES) -> list[list[str]]:
    """Groups of two or more of our modules that import each other, directly or through others."""
    return [c for c in strongly_connected(import_graph(root, packages)) if len(c) > 1]


def describe(cycles: list[list[str]], graph: dict[str, set[str]]) -> str:
    """One paragraph per cycle: its modules and the edges that stay inside it."""
    lines = []
    for component in cycles:
        members = set(component)
        lines.append(f"cycle of {len(component)} modules: {', '.join(component)}")
        for module in component:
            for target in sorted(graph[module] & members):
                lines.append(f"    {module} -> {target}")
    return "\n".join(lines)


def main() -> int:
    graph = import_graph()
    cycles = import_cycles()
    if not cycles:
        print(f"no import cycles among {len(graph)} modules of {', '.join(PACKAGES)}")
        return 0
    print(describe(cycles, graph))
    return 1


if __name__ == "__main__":
    sys.exit(main())
