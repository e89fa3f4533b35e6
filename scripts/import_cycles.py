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

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script: the checkout's packages
from flows.source_graph import PACKAGES, REPO, import_targets, module_files  # noqa: E402


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
