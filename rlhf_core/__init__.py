"""alignflow's training core, one package per concern (lowest first):

``common`` (process helpers) · ``config`` (typed stage configs) · ``data`` (readers, validation gate,
tokenization) · ``embedded`` (the tiny default model and tasks) · ``models`` (loading, precision,
attention, LM head) · ``algorithms`` (pure math) · ``distributed`` (data parallelism, weight sync) ·
``rewards`` · ``rollout`` (engines, environments, evaluation) · ``promotion`` (guards) and
``tracking`` (MLflow, lineage, checkpoints), one level: neither imports the other · ``trainers`` (one file per
algorithm, the Ray launcher) · ``stages`` (one stage end to end).

A package imports only packages before it; the closed choices of the configs (``config.choices``) sit low so
that the configs import nothing above them. Imports nothing from ``flows`` or ``tasks``; Ray is imported only in
``trainers``, DeepSpeed in ``distributed``, vLLM in ``rollout``, MLflow and Prefect in ``tracking``. All of it is
checked by ``pyproject.toml``'s import-linter contracts (``lint-imports``). Runs with torch and transformers
alone (MLflow, Ray and DeepSpeed are optional at import time).
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
from types import ModuleType

from rlhf_core.common import offline as _env  # noqa: F401  (sets offline switches before anything else)
from rlhf_core.common import quiet as _quiet

_quiet.install()  # third-party chatter dropped at its loggers, in every process that imports rlhf_core

__version__ = "0.1.0"

MOVED = {
    "rlhf_core.rl_math": "rlhf_core.algorithms.rl_math",
    "rlhf_core.losses": "rlhf_core.algorithms.losses",
    "rlhf_core.logprobs": "rlhf_core.algorithms.logprobs",
}
"""Import paths users' reward files and notebooks may name (the math modules), old -> new: importing
the old name gives the very module object of the new one."""


class _MovedFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Resolves a name of :data:`MOVED` to its new module (same object, so patches and isinstance agree)."""

    def find_spec(self, name: str, path: object = None, target: object = None) -> importlib.machinery.ModuleSpec | None:
        return importlib.machinery.ModuleSpec(name, self) if name in MOVED else None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        return ModuleType(spec.name)  # a placeholder: exec_module swaps the real module in

    def exec_module(self, module: ModuleType) -> None:
        sys.modules[module.__name__] = importlib.import_module(MOVED[module.__name__])


if not any(isinstance(f, _MovedFinder) for f in sys.meta_path):
    sys.meta_path.append(_MovedFinder())
