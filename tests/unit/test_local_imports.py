"""Every import inside a function of rlhf_core/, flows/ or tasks/ is there for a heavy or optional dependency.

An import belongs at the top of its module, where a reader sees what the module needs. One goes inside a
function only to keep a heavy dependency off a path that must stay light (``alignflow --help``, the config and
validate commands: tests/unit/test_cli_startup.py) or to reach an optional one (an extra, a GPU-only
kernel), and its first line says which: ``# lazy: <dependency> (<why>)``, the dependency one of
:data:`LAZY_DEPENDENCIES`. Breaking an import cycle is no reason: tests/unit/test_code_shape.py counts
function-local imports in its cycle check.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PACKAGES = ("rlhf_core", "flows", "tasks")

LAZY_DEPENDENCIES = {
    # heavy: a second or more to import, or pulling pandas/pyarrow with them
    "torch", "transformers", "ray", "mlflow", "prefect", "great_expectations", "dvc", "datasets", "pandas",
    "pyarrow", "numpy", "matplotlib", "tokenizers", "safetensors", "requests", "filelock",
    # optional: an extra or a platform's kernel, not always installed
    "vllm", "deepspeed", "peft", "triton", "liger_kernel", "prefect_ray", "uvicorn", "gguf", "reasoning_gym",
    "psycopg", "boto3",  # the team extra (the team profile's services)
}
"""The names a ``# lazy:`` comment may give: heavy or optional packages."""

LAZY = re.compile(r"#.*\blazy: ([A-Za-z_][\w.]*) \(")


def unmarked_local_imports(root: Path = REPO) -> list[str]:
    """``file:line: reason`` of each import inside a function whose first line has no ``# lazy: <dependency> (``
    naming one of :data:`LAZY_DEPENDENCIES`."""
    offenders = []
    for package in PACKAGES:
        for path in sorted((root / package).rglob("*.py")):
            source = path.read_text(encoding="utf-8")
            lines = source.splitlines()
            seen: set[int] = set()
            for fn in ast.walk(ast.parse(source, filename=str(path))):
                if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    continue
                for node in ast.walk(fn):
                    if not isinstance(node, (ast.Import, ast.ImportFrom)) or node.lineno in seen:
                        continue
                    seen.add(node.lineno)
                    match = LAZY.search(lines[node.lineno - 1])
                    where = f"{path.relative_to(root).as_posix()}:{node.lineno}"
                    if match is None:
                        offenders.append(f"{where}: no '# lazy: <dependency> (<why>)' comment")
                    elif match.group(1) not in LAZY_DEPENDENCIES:
                        offenders.append(f"{where}: '{match.group(1)}' is not in LAZY_DEPENDENCIES")
    return offenders


def test_every_function_local_import_names_its_heavy_or_optional_dependency():
    offenders = unmarked_local_imports()
    assert not offenders, (
        "function-local imports without a heavy or optional dependency named (move the import to the top of its "
        "module, or add '# lazy: <dependency> (<why>)' on its first line):\n  " + "\n  ".join(offenders))


def test_the_check_finds_an_unmarked_import(tmp_path):
    (tmp_path / "rlhf_core").mkdir()
    (tmp_path / "rlhf_core" / "m.py").write_text(
        "def f():\n    import os\n    import torch  # lazy: torch (heavy)\n    import yaml  # lazy: yaml (light)\n"
        "    from rlhf_core import x  # lazy: stages (a stage's own)\n")
    for package in PACKAGES[1:]:
        (tmp_path / package).mkdir()
    assert unmarked_local_imports(tmp_path) == [
        "rlhf_core/m.py:2: no '# lazy: <dependency> (<why>)' comment",
        "rlhf_core/m.py:4: 'yaml' is not in LAZY_DEPENDENCIES",
        "rlhf_core/m.py:5: 'stages' is not in LAZY_DEPENDENCIES",
    ]
