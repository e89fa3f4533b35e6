"""The sections of ``params.yaml``, each read into its dataclass; reading a params file and one stage's config.

``params.yaml`` is also DVC's params file, so the values a stage ran with are recorded in
``dvc.lock`` and in the stage's MLflow run. Each section of the YAML maps onto one dataclass
(:data:`SECTIONS`); every field has a one-line docstring, and ``__post_init__`` rejects values a user
could plausibly get wrong with a message that names the section and field.

The shipped ``params.yaml`` holds only what differs from the dataclass defaults. A section may group its fields
in sections of its own (``rl``'s ``kl``, ``rollout`` ...): nested in the file, dotted on the command line.

Command-line overrides use ``--set field=value`` (YAML syntax for the value), e.g.
``alignflow sft --set lr=3e-4 --set max_steps=200`` or ``alignflow rl --set kl.coef=0.05``.
"""

from __future__ import annotations

import difflib
import typing
from pathlib import Path
from typing import Any

from rlhf_core.common.shown import shown
from rlhf_core.config.base import T, ConfigError, _load_yaml, build_config
from rlhf_core.config.data import DataReportConfig
from rlhf_core.config.embedded import GenerateConfig, ModelConfig, ToolEvalConfig, ToolGenerateConfig
from rlhf_core.config.guards import GuardsConfig
from rlhf_core.config.gym import GymGenerateConfig
from rlhf_core.config.importing import ImportModelConfig
from rlhf_core.config.pipeline import CyclesConfig, FlowConfig, RetentionConfig, TrackingConfig
from rlhf_core.config.rl import RLConfig
from rlhf_core.config.sampling import EvalConfig, RejectionConfig
from rlhf_core.config.team import TeamConfig
from rlhf_core.config.training import DistillConfig, DPOConfig, KTOConfig, RaftConfig, RewardConfig, SFTConfig


# The repository's embedded tool task (rlhf_core/rollout/tool_task.py): its own sections beside the default's. Not in
# the `alignflow init` template (flows/project_template/params.yaml): a user's project gets the default task only.
TOOL_TASK_SECTIONS = ("tool_generate", "tool_model", "tool_sft", "tool_data_report", "tool_rl", "tool_guards",
                      "tool_evaluate")
# The repository's real recipe (a pretrained model imported from a package's file, on a reasoning-gym task): its own
# sections after the tool task's, not in the `alignflow init` template either.
REAL_RECIPE_SECTIONS = ("real_import", "real_generate", "real_data_report", "real_sft", "real_rl", "real_guards",
                        "real_rejection", "real_raft", "real_evaluate")

SECTIONS: dict[str, type] = {
    "generate": GenerateConfig,
    "gym_generate": GymGenerateConfig,
    "model": ModelConfig,
    "import_model": ImportModelConfig,
    # a trainer's config class names its own section (``section``, the one its errors name)
    **{cls.section: cls for cls in (SFTConfig, DPOConfig, RewardConfig, KTOConfig, DistillConfig)},
    "rejection": RejectionConfig,
    **{cls.section: cls for cls in (RaftConfig, RLConfig)},
    "cycles": CyclesConfig,
    "data_report": DataReportConfig,
    "evaluate": EvalConfig,
    "tracking": TrackingConfig,
    "flow": FlowConfig,
    "guards": GuardsConfig,
    "team": TeamConfig,
    "retention": RetentionConfig,
    "tool_generate": ToolGenerateConfig,
    "tool_model": ModelConfig,
    "tool_sft": SFTConfig,
    "tool_data_report": DataReportConfig,
    "tool_rl": RLConfig,
    "tool_guards": GuardsConfig,
    "tool_evaluate": ToolEvalConfig,
    "real_import": ImportModelConfig,
    "real_generate": GymGenerateConfig,
    "real_data_report": DataReportConfig,
    "real_sft": SFTConfig,
    "real_rl": RLConfig,
    "real_guards": GuardsConfig,
    "real_rejection": RejectionConfig,
    "real_raft": RaftConfig,
    "real_evaluate": EvalConfig,
}


def read_params(path: str | Path) -> dict[str, Any]:
    """Read a params YAML file into a dict of sections, each a mapping or None (empty file -> empty dict)."""
    path = Path(path)
    try:
        text = path.read_bytes().decode("utf-8")
    except FileNotFoundError:
        raise ConfigError(f"{path}: params file not found") from None
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read the params file: {exc.strerror}") from None
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{path}: not UTF-8 text (byte {exc.start}); a params file is YAML") from None
    data = _load_yaml(text, str(path)) or {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: top level must be a mapping of sections")
    unknown = set(data) - set(SECTIONS)
    if unknown:
        raise ConfigError(f"{path}: {unknown_sections(unknown)}")
    for name, values in data.items():
        if values is not None and not isinstance(values, dict):
            raise ConfigError(f"{path}: section {name!r} must be a mapping of field: value, got "
                              f"{type(values).__name__}")
    return data


def unknown_sections(unknown: typing.Collection[str]) -> str:
    """``unknown section(s) [...]; did you mean ...?`` (difflib), else the known sections."""
    names = sorted(shown(name) if not isinstance(name, str) else name for name in unknown)
    close = {name: difflib.get_close_matches(name, sorted(SECTIONS), n=1, cutoff=0.6) for name in names}
    if all(close.values()):
        return f"unknown section(s) {names}; did you mean {', '.join(c[0] for c in close.values())}?"
    return f"unknown section(s) {names}; known: {', '.join(sorted(SECTIONS))}"


def load_config(cls: type[T], section: str, params_path: str | Path | None = "params.yaml",
                overrides: dict[str, Any] | None = None) -> T:
    """Load one stage's config from ``params_path`` (if it exists) plus overrides (errors in those name
    the command line, :data:`OVERRIDE_SOURCE`)."""
    values: dict[str, Any] = {}
    source = "<defaults>"
    if params_path is not None and Path(params_path).exists():
        values = dict(read_params(params_path).get(section) or {})
        source = str(params_path)
    values.update(overrides or {})
    return build_config(cls, section, values, source, overridden=set(overrides or {}))
