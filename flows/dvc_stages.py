"""``dvc.yaml`` from the stage registry, each stage's code deps derived from the source.

Every DVC stage is declared once, with its stage (rlhf_core/config/stage_registry.py: command, data deps,
params, outs, metrics); this module writes them to the checkout's ``dvc.yaml`` and, without the
repository's own stages and code deps, to the ``alignflow init`` template
(flows/project_template/dvc.yaml). A recipe of its own (a stage's ``file``, e.g. recipes/real/dvc.yaml) gets its
file, and its template copy without code deps (flows/project_template/recipes/real/dvc.yaml, which
``alignflow init --recipe real`` writes). ``tests/unit/test_dvc_deps.py`` fails when a committed file differs
from the generated one.

A stage's outputs depend on the code it runs, so every alignflow source file its command can load
is one of its ``deps``: edit that file and ``dvc status`` reports the stage changed, ``dvc repro``
reruns it, and no model built by old code is reused. They are read from the source with ``ast``
(a stage is never run to find them).

What a stage's command runs:

* ``alignflow <sub>`` runs ``flows/cli.py``: its ``main``, the command's handler (``cmd_<sub>``, ``-`` read
  as ``_``, or the shared ``cmd_stage`` of the registry's training-shaped commands) and the stage's entry
  function from the registry. The CLI reaches the last through the registry by name, which no static
  reader follows, so it is named. An entry outside alignflow's packages (a plugin's stage) adds none of
  its files: they are the plugin's to list among its stage's deps.
* ``python -m <module> ...`` runs that module.
* A code file named in the stage's params sections (``reward_function: rlhf_core/embedded/reward.py:reward``,
  read with the config's field defaults under it), which the stage loads by path.

From there, the import closure within ``rlhf_core``, ``flows`` and ``tasks``:

* A module counts whole: every import in it, function-local ones included. A lazy import defers
  loading; it does not mean the code never runs. Importing ``pkg.mod`` also runs ``pkg/__init__.py``.
* The two dispatch modules, :data:`DISPATCH`, hold one function per stage; read whole, they would make
  every stage depend on every other stage's trainer. They are read by calls instead: their top-level
  statements, the entry functions, and the functions those call by name (here or through an import of
  a dispatch module), transitively; a nested function counts with the function around it. A top-level
  import there counts where that code uses a name it binds (an import's module body defines, the code
  that uses its names runs). A function
  such a module passes as a value (a callback) would escape that reading, so the generator refuses
  one, the CLI's ``cmd_*`` handlers apart (argparse's table; the command's own is an entry point).

Config defaults: ``params.yaml`` sets only some fields of each section, and DVC hashes the section's
values, not the dataclass defaults in the ``rlhf_core/config`` package. So every file of that package is
one of every stage's deps, whatever its imports reach, and a changed default reaches DVC.

Run from the checkout's root::

    alignflow dvc-stages            # each stage's code deps, counted
    alignflow dvc-stages --check    # exit 1 with a diff when dvc.yaml or the template is stale
    alignflow dvc-stages --write    # regenerate both

(``python scripts/dvc_deps.py`` is the same command.)
"""

from __future__ import annotations

import argparse
import ast
import difflib
import shlex
import sys
from pathlib import Path
from typing import Any, Iterator, NamedTuple

from flows.source_graph import PACKAGES, REPO, from_base, import_targets, module_files, resolve_module
from rlhf_core.config import SECTIONS, build_config, config_to_dict, read_params, stage_registry as registry
from rlhf_core.config.stage_registry import DvcStage

DISPATCH = ("flows.cli", "rlhf_core.stages.wrappers")
"""Modules of one function per stage, read by calls (module docstring)."""

CLI = "flows.cli"
HANDLER_PREFIX = "cmd_"
"""``alignflow <sub>``'s handler in flows/cli.py is ``cmd_<sub>`` (``-`` read as ``_``), else :data:`SHARED_HANDLER`."""
SHARED_HANDLER = "cmd_stage"
"""The handler of every :data:`rlhf_core.config.stage_registry.TRAIN` command without one of its own."""
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

    def top_imports(self, module: str) -> dict[str, str]:
        """Local name -> our module it stands for, for each name a top-level import of ``module`` binds
        (``from rlhf_core.data.io import read_records``: ``read_records`` -> ``rlhf_core.data.io``)."""
        out: dict[str, str] = {}
        for node in self.tree(module).body:
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                for alias in node.names:
                    target = self.bindings(module).get(alias.asname or alias.name.split(".")[0], "")
                    found = resolve_module(target, self.known)
                    if found is not None:
                        out[alias.asname or alias.name.split(".")[0]] = found
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
        elif not isinstance(stmt, (ast.Import, ast.ImportFrom)):  # an import counts where its name is used
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
    """The units that ``unit`` runs directly: the modules it imports, the dispatch functions it calls; in a
    dispatch module, the modules whose names it uses that a top-level import binds."""
    bindings, local = index.bindings(unit.module), index.defs(unit.module)
    used = index.top_imports(unit.module) if unit.module in DISPATCH else {}
    out: set[Unit] = set()
    for root in _region(index, unit):
        for node in ast.walk(root):
            if isinstance(node, ast.Name) and node.id in used:
                out.add(Unit(used[node.id]))
            elif isinstance(node, (ast.Import, ast.ImportFrom)):
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
        stage = registry.STAGES.get(argv[1])
        if stage is None or stage.command == registry.NONE:
            raise StageError(f"`{cmd}`: no command {argv[1]} in the stage registry (rlhf_core/config/stage_registry.py)")
        handler = f"{HANDLER_PREFIX}{argv[1].replace('-', '_')}"
        if handler not in index.defs(CLI) and stage.command == registry.TRAIN:
            handler = SHARED_HANDLER
        if handler not in index.defs(CLI):
            raise StageError(f"`{cmd}`: {index.relpath(CLI)} has no {handler}, the handler of `alignflow {argv[1]}`")
        units = [Unit(CLI), Unit(CLI, "main"), Unit(CLI, handler)]
        module, _, function = stage.entry.partition(":")
        if module.split(".")[0] not in PACKAGES:  # a plugin's entry: its own files are its DvcStage.deps to list
            return units
        if module not in index.known or function not in index.defs(module):
            raise StageError(f"`{cmd}`: {module} has no function {function} (the stage's entry)")
        return units + [Unit(module), Unit(module, function)]
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

    params = read_params(index.root / "params.yaml")
    by_path = {index.relpath(m): m for m in index.known}
    units = []
    for section in sections:  # every value the stage runs with: the file's, else the default (sections within too)
        values = config_to_dict(build_config(SECTIONS[section], section, dict(params.get(section) or {}),
                                             str(index.root / "params.yaml")))
        for text in _strings(values):
            path = text.partition(":")[0]
            if path in by_path:
                units.append(Unit(by_path[path]))
    return units


def _sections(stage: DvcStage) -> list[str]:
    """The params.yaml sections a DVC stage lists (``sft``, or ``sft.lr`` -> ``sft``)."""
    names = [p.split(".")[0] for p in stage.params]
    return [name for name in names if name in SECTIONS]


def stage_code_deps(index: SourceIndex, stages: list[DvcStage]) -> dict[str, list[str]]:
    """DVC stage name -> its alignflow source files, sorted."""
    for module in DISPATCH:
        values = sorted(f for f in passed_as_values(index, module) if not f.startswith(HANDLER_PREFIX))
        if values:
            raise StageError(f"{index.relpath(module)} uses {', '.join(values)} as a value, not in a call: "
                             "the code deps read its functions by calls (flows/dvc_stages.py)")
    config_files = {path for path in map(index.relpath, index.known) if path.startswith(CONFIG_PACKAGE + "/")}
    out = {}
    for stage in stages:
        entries = command_entries(index, stage.cmd) + param_entries(index, _sections(stage))
        out[stage.name] = sorted(closure(index, entries) | config_files)
    return out


# --------------------------------------------------------------------------------------
# dvc.yaml: written from the registry
# --------------------------------------------------------------------------------------

DVC_YAML = "dvc.yaml"
TEMPLATE_DVC_YAML = "flows/project_template/dvc.yaml"

CHECKOUT_HEADER = """\
# The align pipeline as DVC stages: the same commands the Prefect flow's tasks run.
# `make repro` (or `PATH=.venv/bin:$PATH dvc repro`) regenerates data and models; their
# md5s land in dvc.lock, which is committed, so any run is reproducible from a commit.
# Written from the stage registry (rlhf_core/config/stage_registry.py) by `alignflow dvc-stages --write`,
# never edited by hand (tests/unit/test_dvc_deps.py fails when it drifts). Each stage also depends on
# the alignflow source files it runs, derived from the imports and listed after its data deps.
# A project made by `alignflow init` gets this file without those deps and without the tool
# task's stages (flows/project_template/dvc.yaml, written by the same command).
"""

TEMPLATE_HEADER = """\
# The align pipeline as DVC stages: the same commands the Prefect flow's tasks run, so
# `dvc repro` (in the environment where alignflow is installed) regenerates data and models;
# their md5s land in dvc.lock: commit it, and any run is reproducible from a commit.
# The alignflow checkout's own dvc.yaml is this file plus each stage's alignflow source files
# as deps. Here alignflow is an installed package: every MLflow run records its version (tag
# alignflow.version) and `alignflow reproduce` warns when the installed one differs; after
# upgrading alignflow, `dvc repro --force` retrains with the new version. A reward function
# file of your own (rl.reward.function) belongs in the rl stage's deps.
"""


def _flow_value(value: Any) -> str:
    """A foreach item: a scalar, or a mapping written on one line (``{file: sft.jsonl, kind: sft}``)."""
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {v}" for k, v in value.items()) + "}"
    return str(value)


RECIPE_HEADER = """\
# A recipe of its own beside the align pipeline: `dvc repro {file}` runs it, while `dvc repro` and
# `make repro` (the working directory's dvc.yaml) leave it alone. Its stages run from the checkout's root (wdir);
# their md5s land in the dvc.lock beside this file. Written from the stage registry
# (rlhf_core/config/stage_registry.py) by `alignflow dvc-stages --write`, never edited by hand; each stage also
# depends on the alignflow source files it runs.
"""


TEMPLATE_RECIPE_HEADER = """\
# A recipe of its own beside the align pipeline, written by `alignflow init --recipe {name}`: `dvc repro {file}`
# runs it, while `dvc repro` (the project's dvc.yaml) leaves it alone. Its stages run from the project's root
# (wdir), read their params.yaml sections there, and their md5s land in the dvc.lock beside this file. The
# alignflow checkout's own copy is this file plus each stage's alignflow source files as deps.
"""


def template_path(file: str) -> str:
    """Where the ``alignflow init`` template keeps a dvc.yaml of the checkout's (``file``, relative to the root)."""
    return TEMPLATE_DVC_YAML if file == DVC_YAML else f"flows/project_template/{file}"


def _wdir(file: str) -> str:
    """``wdir`` of a stage in ``file``: the checkout's root, relative to the file's folder ("" for the root's)."""
    depth = len(Path(file).parent.parts)
    return "/".join([".."] * depth)


def _body(stage: DvcStage, code_deps: list[str] | None, pad: str) -> list[str]:
    """The stage's ``cmd``, ``deps``, ``params``, ``outs`` and ``metrics`` lines, indented by ``pad``."""
    wdir = _wdir(stage.file)
    lines = [f"{pad}cmd: {stage.cmd}", *([f"{pad}wdir: {wdir}"] if wdir else [])]
    deps = [*stage.deps, *(code_deps or [])]
    uncached = [f"{pad}      cache: false"]
    for key, items, cached in (("deps", deps, True), ("params", stage.params, True),
                               ("outs", stage.outs, stage.cache_outs), ("metrics", stage.metrics, False)):
        if items:
            lines.append(f"{pad}{key}:")
            for item in items:
                lines += [f"{pad}  - {item}"] if cached else [f"{pad}  - {item}:", *uncached]
    return lines


def render(stages: list[DvcStage], code_deps: dict[str, list[str]] | None, header: str) -> str:
    """A dvc.yaml of ``stages``; ``code_deps``: each stage's source deps (None: data deps only)."""
    blocks = []
    for stage in stages:
        lines = [f"  {line}" for line in stage.comment] + [f"  {stage.name}:"]
        deps = None if code_deps is None else code_deps[stage.name]
        if stage.foreach:
            lines.append("    foreach:")
            lines += [f"      {key}: {_flow_value(value)}" for key, value in stage.foreach]
            lines += ["    do:", *_body(stage, deps, "      ")]
        else:
            lines += _body(stage, deps, "    ")
        blocks.append("\n".join(lines) + "\n")
    return header + "stages:\n" + "\n".join(blocks)


def generate(root: Path = REPO) -> dict[str, str]:
    """The checkout's ``dvc.yaml`` (and each recipe's of its own) and the template's, relative path -> text, from
    the registry."""
    stages = registry.dvc_stages()
    code_deps = stage_code_deps(SourceIndex(root), stages)
    files = {DVC_YAML: CHECKOUT_HEADER, **{s.file: RECIPE_HEADER.format(file=s.file) for s in stages
                                          if s.file != DVC_YAML}}
    out = {file: render([s for s in stages if s.file == file], code_deps, header) for file, header in files.items()}
    out[TEMPLATE_DVC_YAML] = render([s for s in stages if s.in_template], None, TEMPLATE_HEADER)
    for file in files.keys() - {DVC_YAML}:
        recipe = [s for s in stages if s.file == file]
        out[template_path(file)] = render(recipe, None, TEMPLATE_RECIPE_HEADER.format(file=file, name=Path(file).parent.name))
    return out


def check(root: Path = REPO) -> str:
    """A unified diff from ``root``'s files to the generated ones ("" when they are equal)."""
    out = []
    for rel, text in generate(root).items():
        path = root / rel
        current = path.read_text(encoding="utf-8") if path.is_file() else ""
        out += difflib.unified_diff(current.splitlines(keepends=True), text.splitlines(keepends=True),
                                    rel, f"{rel} (generated)")
    return "".join(out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="alignflow dvc-stages", description=__doc__.split("\n\n")[0])
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--write", action="store_true", help="rewrite dvc.yaml and the project template's")
    mode.add_argument("--check", action="store_true", help="exit 1, printing a diff, when either is stale")
    parser.add_argument("--root", type=Path, default=REPO, help="the alignflow checkout (default: this one)")
    args = parser.parse_args(argv)
    if args.write:
        for rel, text in generate(args.root).items():
            (args.root / rel).parent.mkdir(parents=True, exist_ok=True)
            (args.root / rel).write_text(text, encoding="utf-8")
        return 0
    if args.check:
        diff = check(args.root)
        print(diff or "dvc.yaml: up to date with the stage registry", end="" if diff else "\n")
        if diff:
            print("\nregenerate: alignflow dvc-stages --write", file=sys.stderr)
        return 1 if diff else 0
    for name, files in stage_code_deps(SourceIndex(args.root), registry.dvc_stages()).items():
        print(f"{name}: {len(files)} source files")
    return 0


if __name__ == "__main__":
    sys.exit(main())
