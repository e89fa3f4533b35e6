"""Derive each DVC stage's code dependencies from the source, and keep ``dvc.yaml`` equal to them.

A stage's outputs depend on the code it runs, so every alignflow source file its command can load
is one of its ``deps``: edit that file and ``dvc status`` reports the stage changed, ``dvc repro``
reruns it, and no model built by old code is reused. A list kept by hand drifts, so here they
are read from the source with ``ast`` (a stage is never run to find them).

What a stage's command runs:

* ``alignflow <sub>`` runs ``flows/cli.py``: its ``main``, the handler ``cmd_<sub>`` and
  ``rlhf_core.stages.wrappers.<sub>`` (``-`` read as ``_``). The CLI reaches the last two through argparse's
  handler table and ``getattr(stages, name)``, which no static reader follows, so they are named.
* ``python -m <module> ...`` runs that module.
* A code file named in the stage's params sections (``reward_function: rlhf_core/embedded/reward.py:reward``,
  read with the config's field defaults under it), which the stage loads by path.

From there, the import closure within ``rlhf_core``, ``flows`` and ``tasks``:

* A module counts whole: every import in it, function-local ones included. A lazy import defers
  loading; it does not mean the code never runs. Importing ``pkg.mod`` also runs ``pkg/__init__.py``.
* The two dispatch modules, :data:`DISPATCH`, hold one function per stage; read whole, they would make
  every stage depend on every other stage's trainer. They are read by calls instead: their top-level
  statements, the entry functions, and the functions those call by name (here or through an import of
  a dispatch module), transitively; a nested function counts with the function around it. A function
  such a module passes as a value (a callback) would escape that reading, so the generator refuses
  one, the CLI's ``cmd_*`` handlers apart (argparse's table; the stage's own is an entry point).

Config defaults: ``params.yaml`` sets only some fields of each section, and DVC hashes the section's
values, not the dataclass defaults in the ``rlhf_core/config`` package. So every file of that package is
one of every stage's deps, whatever its imports reach, and a changed default reaches DVC.

``dvc.yaml`` stays a committed, readable file. It is rewritten with ruamel.yaml's round trip, which
keeps the header, comments, flow mappings and key order; only the source-file part of each stage's
deps changes: the data deps keep their order, the stage's alignflow ``.py`` files follow, sorted.
``tests/unit/test_dvc_deps.py`` fails when the committed file differs from the generated one.

Run from the repository root::

    python scripts/dvc_deps.py            # each stage's code deps, counted
    python scripts/dvc_deps.py --check    # exit 1 with a diff when dvc.yaml is stale
    python scripts/dvc_deps.py --write    # regenerate dvc.yaml
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import difflib
import io
import shlex
import sys
from pathlib import Path
from typing import Any, Iterator, NamedTuple

from ruamel.yaml import YAML

from import_cycles import PACKAGES, REPO, from_base, import_targets, module_files

DISPATCH = ("flows.cli", "rlhf_core.stages.wrappers")
"""Modules of one function per stage, read by calls (module docstring)."""

CLI = "flows.cli"
HANDLER_PREFIX = "cmd_"
"""``alignflow <sub>``'s handler in flows/cli.py is ``cmd_<sub>`` (``-`` read as ``_``)."""
STAGES = "rlhf_core.stages.wrappers"
CONFIG_PACKAGE = "rlhf_core/config"
"""Where the config dataclasses and their defaults live: every stage depends on all of it (module docstring)."""

_DEFS = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)


class StageError(ValueError):
    """A stage whose command's code cannot be told from the source."""


class Unit(NamedTuple):
    """Code that runs: a module (``function`` None: a dispatch module's top level, any other module whole)
    or one top-level function or class of a dispatch module."""

    module: str
    function: str | None = None


class SourceIndex:
    """The parsed modules of ``packages`` under ``root``: trees, top-level definitions, import bindings."""

    def __init__(self, root: Path = REPO, packages: tuple[str, ...] = PACKAGES):
        self.root = root
        self.files = module_files(root, packages)
        self.known = set(self.files)
        self._trees: dict[str, ast.Module] = {}
        self._bindings: dict[str, dict[str, str]] = {}
        self._reached: dict[Unit, set[Unit]] = {}  # shared by every stage's closure

    def tree(self, module: str) -> ast.Module:
        if module not in self._trees:
            path = self.files[module]
            self._trees[module] = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        return self._trees[module]

    def is_package(self, module: str) -> bool:
        return self.files[module].name == "__init__.py"

    def defs(self, module: str) -> dict[str, ast.AST]:
        """Top-level functions and classes of ``module`` by name."""
        return {node.name: node for node in self.tree(module).body if isinstance(node, _DEFS)}

    def assigned(self, module: str) -> set[str]:
        """Names bound by top-level assignments (``cmd_sft = _tracked_stage(...)``)."""
        return {target.id for node in self.tree(module).body if isinstance(node, ast.Assign)
                for target in node.targets if isinstance(target, ast.Name)}

    def bindings(self, module: str) -> dict[str, str]:
        """Local name -> the dotted name it is bound to, for every import anywhere in ``module``."""
        if module in self._bindings:
            return self._bindings[module]
        out = self._bindings[module] = {}
        for node in ast.walk(self.tree(module)):
            if isinstance(node, ast.Import):
                for alias in node.names:  # `import a.b` binds a to a; `import a.b as x` binds x to a.b
                    top = alias.name.split(".")[0]
                    out[alias.asname or top] = alias.name if alias.asname else top
            elif isinstance(node, ast.ImportFrom):
                base = from_base(node, module, self.is_package(module))
                for alias in node.names:
                    out[alias.asname or alias.name] = f"{base}.{alias.name}"
        return out

    def reached(self, unit: Unit) -> set[Unit]:
        """:func:`reached`, read once per unit."""
        if unit not in self._reached:
            self._reached[unit] = reached(self, unit)
        return self._reached[unit]

    def relpath(self, module: str) -> str:
        return self.files[module].relative_to(self.root).as_posix()


# --------------------------------------------------------------------------------------
# the closure: units of code reached from a stage's entry points
# --------------------------------------------------------------------------------------


def _region(index: SourceIndex, unit: Unit) -> list[ast.AST]:
    """The syntax that runs when ``unit`` runs."""
    if unit.function is not None:
        return [index.defs(unit.module)[unit.function]]
    tree = index.tree(unit.module)
    if unit.module not in DISPATCH:
        return [tree]
    region: list[ast.AST] = []
    for stmt in tree.body:  # a def statement runs its decorators and defaults, not its body
        if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef)):
            region += [*stmt.decorator_list, *stmt.args.defaults, *(d for d in stmt.args.kw_defaults if d)]
        else:
            region.append(stmt)
    return region


def _dotted(node: ast.AST, module: str, bindings: dict[str, str], local: dict[str, ast.AST]) -> str | None:
    """The dotted name a called expression refers to (``stages.sft`` -> ``rlhf_core.stages.wrappers.sft``), if static."""
    attrs: list[str] = []
    while isinstance(node, ast.Attribute):
        attrs.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return None
    base = f"{module}.{node.id}" if node.id in local else bindings.get(node.id)
    return ".".join([base, *reversed(attrs)]) if base else None


def reached(index: SourceIndex, unit: Unit) -> set[Unit]:
    """The units that ``unit`` runs directly: the modules it imports, the dispatch functions it calls."""
    bindings, local = index.bindings(unit.module), index.defs(unit.module)
    out: set[Unit] = set()
    for root in _region(index, unit):
        for node in ast.walk(root):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                out |= {Unit(m) for m in import_targets(node, unit.module, index.is_package(unit.module), index.known)}
            elif isinstance(node, ast.Call):
                module, _, name = (_dotted(node.func, unit.module, bindings, local) or "").rpartition(".")
                if module in DISPATCH and name in index.defs(module):
                    out.add(Unit(module, name))
    out |= {Unit(pkg) for pkg in _packages_of(unit.module) if pkg in index.known}
    return out - {unit}


def passed_as_values(index: SourceIndex, module: str) -> set[str]:
    """Top-level functions of ``module`` that it names other than in a call (a callback, a handler table).
    Reading by calls misses what such a function imports, so in a dispatch module only the CLI's handlers
    (``cmd_*``, named as entry points by :func:`command_entries`) may be used that way."""
    functions = {name for name, node in index.defs(module).items() if not isinstance(node, ast.ClassDef)}
    tree = index.tree(module)
    called = {id(node.func) for node in ast.walk(tree) if isinstance(node, ast.Call)}
    return {node.id for node in ast.walk(tree) if isinstance(node, ast.Name) and node.id in functions
            and isinstance(node.ctx, ast.Load) and id(node) not in called}


def _packages_of(module: str) -> Iterator[str]:
    """``a.b.c`` -> ``a``, ``a.b``: the packages whose ``__init__.py`` importing it runs."""
    parts = module.split(".")
    for end in range(1, len(parts)):
        yield ".".join(parts[:end])


def closure(index: SourceIndex, entries: list[Unit]) -> set[str]:
    """Source files (relative paths) of every unit reached from ``entries``."""
    seen: set[Unit] = set()
    stack = list(entries)
    while stack:
        unit = stack.pop()
        if unit not in seen:
            seen.add(unit)
            stack.extend(index.reached(unit) - seen)
    return {index.relpath(unit.module) for unit in seen}


# --------------------------------------------------------------------------------------
# a stage's entry points: its command, and code files its params name
# --------------------------------------------------------------------------------------


def command_entries(index: SourceIndex, cmd: str) -> list[Unit]:
    """The units a stage's command starts in (module docstring)."""
    argv = shlex.split(cmd)
    if argv[:1] == ["alignflow"] and len(argv) > 1:
        name = argv[1].replace("-", "_")
        handler, stage = f"{HANDLER_PREFIX}{name}", name
        if handler not in index.defs(CLI) and handler not in index.assigned(CLI):
            raise StageError(f"`{cmd}`: {index.relpath(CLI)} has no {handler}, the handler of `alignflow {argv[1]}`")
        if stage not in index.defs(STAGES):
            raise StageError(f"`{cmd}`: {index.relpath(STAGES)} has no function {stage}")
        units = [Unit(CLI), Unit(CLI, "main"), Unit(STAGES, stage)]
        # a handler made by a top-level call (cmd_sft = _tracked_stage(...)) is reached with the top level
        return units + ([Unit(CLI, handler)] if handler in index.defs(CLI) else [])
    if argv[:2] == ["python", "-m"] and len(argv) > 2 and argv[2] in index.known:
        return [Unit(argv[2])]
    raise StageError(f"`{cmd}`: not `alignflow <command>` nor `python -m <alignflow module>`; "
                     "its code deps cannot be derived")


def _strings(value: Any) -> Iterator[str]:
    if isinstance(value, str):
        yield value
    elif isinstance(value, dict):
        for v in value.values():
            yield from _strings(v)
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from _strings(v)


def param_entries(index: SourceIndex, sections: list[str]) -> list[Unit]:
    """Modules of ours that the params ``sections`` name as ``path.py[:name]`` (params.yaml over the field
    defaults of the section's config class): code a stage loads by path, e.g. its reward function."""
    if not sections:
        return []
    from rlhf_core.config import SECTIONS, read_params

    params = read_params(index.root / "params.yaml")
    by_path = {index.relpath(m): m for m in index.known}
    units = []
    for section in sections:
        values = {f.name: f.default for f in dataclasses.fields(SECTIONS[section])
                  if f.default is not dataclasses.MISSING}
        values.update(params.get(section) or {})
        for text in _strings(values):
            path = text.partition(":")[0]
            if path in by_path:
                units.append(Unit(by_path[path]))
    return units


def _sections(body: dict[str, Any]) -> list[str]:
    """The params.yaml sections a dvc.yaml stage lists (``sft``, or ``sft.lr`` -> ``sft``)."""
    from rlhf_core.config import SECTIONS

    names = [str(p).split(".")[0] for p in body.get("params", []) if isinstance(p, str)]
    return [name for name in names if name in SECTIONS]


def stage_code_deps(index: SourceIndex, stages: dict[str, Any]) -> dict[str, list[str]]:
    """Stage name -> its alignflow source files, sorted, for every stage of a dvc.yaml ``stages`` mapping."""
    for module in DISPATCH:
        values = sorted(f for f in passed_as_values(index, module) if not f.startswith(HANDLER_PREFIX))
        if values:
            raise StageError(f"{index.relpath(module)} uses {', '.join(values)} as a value, not in a call: "
                             "the code deps read its functions by calls (scripts/dvc_deps.py)")
    config_files = {path for path in map(index.relpath, index.known) if path.startswith(CONFIG_PACKAGE + "/")}
    out = {}
    for name, stage in stages.items():
        body = stage.get("do", stage)  # a foreach stage's template
        entries = command_entries(index, body["cmd"]) + param_entries(index, _sections(body))
        out[name] = sorted(closure(index, entries) | config_files)
    return out


# --------------------------------------------------------------------------------------
# dvc.yaml: read, replace the source deps, write
# --------------------------------------------------------------------------------------


def _yaml() -> YAML:
    yaml = YAML()  # round trip: comments, blank lines, flow mappings and key order kept
    yaml.preserve_quotes = True
    yaml.width = 4096  # never fold a long `cmd:` line
    yaml.indent(mapping=2, sequence=4, offset=2)
    return yaml


def is_source_dep(dep: Any) -> bool:
    """A dep on one of alignflow's own ``.py`` files (what this module derives)."""
    path = Path(str(dep))
    return path.suffix == ".py" and bool(path.parts) and path.parts[0] in PACKAGES


def generate(root: Path = REPO) -> str:
    """``root``'s dvc.yaml text with every stage's source deps replaced by its derived code deps."""
    yaml = _yaml()
    doc = yaml.load((root / "dvc.yaml").read_text(encoding="utf-8"))
    derived = stage_code_deps(SourceIndex(root), doc["stages"])
    for name, stage in doc["stages"].items():
        body = stage.get("do", stage)
        deps = body.get("deps")
        if deps is None:
            raise StageError(f"stage {name}: no deps list to hold its code deps")
        data = [dep for dep in deps if not is_source_dep(dep)]
        del deps[:]
        deps.extend(data + derived[name])
    out = io.StringIO()
    yaml.dump(doc, out)
    return out.getvalue()


def check(root: Path = REPO) -> str:
    """A unified diff from ``root``'s dvc.yaml to the generated one ("" when they are equal)."""
    current = (root / "dvc.yaml").read_text(encoding="utf-8")
    return "".join(difflib.unified_diff(current.splitlines(keepends=True), generate(root).splitlines(keepends=True),
                                        "dvc.yaml", "dvc.yaml (generated)"))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--write", action="store_true", help="rewrite dvc.yaml with the derived code deps")
    mode.add_argument("--check", action="store_true", help="exit 1, printing a diff, when dvc.yaml is stale")
    parser.add_argument("--root", type=Path, default=REPO, help="the project (default: this checkout)")
    args = parser.parse_args(argv)
    if args.write:
        (args.root / "dvc.yaml").write_text(generate(args.root), encoding="utf-8")
        return 0
    if args.check:
        diff = check(args.root)
        print(diff or "dvc.yaml: code deps up to date", end="" if diff else "\n")
        if diff:
            print("\nregenerate: python scripts/dvc_deps.py --write", file=sys.stderr)
        return 1 if diff else 0
    yaml = _yaml()
    stages = yaml.load((args.root / "dvc.yaml").read_text(encoding="utf-8"))["stages"]
    for name, files in stage_code_deps(SourceIndex(args.root), stages).items():
        print(f"{name}: {len(files)} source files")
    return 0


if __name__ == "__main__":
    sys.exit(main())
