"""alignflow's own modules and the imports between them, read from the source with ``ast`` (nothing is imported).

Shared by ``scripts/import_cycles.py`` (the import graph's cycles) and :mod:`flows.dvc_stages` (each DVC stage's
code deps). Importing ``pkg.mod`` is an edge to ``pkg.mod`` only; the ``pkg/__init__.py`` Python also runs is the
reader's to add.
"""

from __future__ import annotations

import ast
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


def resolve_module(name: str, known: set[str]) -> str | None:
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
    return {t for t in (resolve_module(n, known) for n in names) if t is not None}
