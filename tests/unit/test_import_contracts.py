"""The import contracts of ``pyproject.toml`` (``[tool.importlinter]``) hold for this checkout.

They fix which package of ``rlhf_core`` may import which (the layers of ``rlhf_core/__init__.py``), that the
training core imports nothing from ``flows`` or ``tasks``, that the math stays pure and the configs light, and
where Ray, DeepSpeed, vLLM, MLflow and Prefect may be imported. A broken contract fails this test with
import-linter's report: which import, in which file, on which line.

Run alone: ``lint-imports`` in the repository root.
"""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

LINT = "from importlinter.cli import lint_imports; raise SystemExit(lint_imports(no_cache=True, no_logo=True))"


def test_import_contracts_hold():
    # this checkout first on the path: an installed (editable) alignflow may point at another one
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    result = subprocess.run([sys.executable, "-c", LINT], cwd=REPO, env=env, capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, "import contracts broken (pyproject.toml [tool.importlinter]):\n" + \
        result.stdout + result.stderr


def test_core_docstring_lists_the_layers_in_order():
    """``rlhf_core/__init__.py``'s list of packages (its second paragraph): the layers contract's, lowest first."""
    config = tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))
    contracts = config["tool"]["importlinter"]["contracts"]
    layers = next(c for c in contracts if c["id"] == "layers")["layers"]
    lowest_first = [name.strip() for layer in reversed(layers) for name in layer.split("|")]
    docstring = ast.get_docstring(ast.parse((REPO / "rlhf_core" / "__init__.py").read_text(encoding="utf-8")))
    named = re.findall(r"``(\w+)``", docstring.split("\n\n")[1])
    assert named == lowest_first, f"rlhf_core/__init__.py names {named}; the layers contract: {lowest_first}"
