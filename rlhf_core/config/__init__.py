"""The typed configuration of every stage (one dataclass per ``params.yaml`` section, validated on construction).

By concern: ``base`` (the error type, field checks, YAML reading, typed construction), ``choices`` (the closed
choices of enum-valued fields), ``data`` (dataset field names, the data report), ``embedded`` (the embedded
task's data and model, the tool task), ``importing`` (a model imported from a package's file or a folder),
``training`` (the offline trainers), ``rl`` and ``rl_sections`` (online RL and its sections), ``sampling``
(rejection sampling, evaluation), ``pipeline`` (tracking, retention, the align flow, cycles), ``guards`` (the promotion
guards), ``team`` (the team profile's services) and ``sections`` (``SECTIONS``, reading a params file, loading one
stage's config). The names below are the package's face: ``from rlhf_core.config import SFTConfig, load_config``.

May import ``rlhf_core.common`` only, and nothing that needs torch: the CLI reads and checks configs
without the ML stack.
"""

from rlhf_core.config.base import (MAX_INT, MAX_YAML_DEPTH, MAX_YAML_NODES, OVERRIDE_SOURCE, ConfigError, build_config,
                                   config_params, config_to_dict, field_docs, parse_overrides, section_fields,
                                   unknown_field)
from rlhf_core.config.data import MAX_LINE_BYTES, DataFields, DataReportConfig
from rlhf_core.config.embedded import GenerateConfig, ModelConfig, ToolEvalConfig, ToolGenerateConfig
from rlhf_core.config.guards import GUARD_NAMES, GuardsConfig
from rlhf_core.config.gym import GymGenerateConfig
from rlhf_core.config.importing import IMPORT_DTYPES, ImportModelConfig
from rlhf_core.config.pipeline import CyclesConfig, FlowConfig, RetentionConfig, TrackingConfig
from rlhf_core.config.rl import RLConfig
from rlhf_core.config.rl_sections import RENAMED
from rlhf_core.config.sampling import EvalConfig, RejectionConfig
from rlhf_core.config.team import TeamConfig
from rlhf_core.config.sections import (REAL_RECIPE_SECTIONS, SECTIONS, TOOL_TASK_SECTIONS, load_config, read_params,
                                       unknown_sections)
from rlhf_core.config.training import (LM_HEADS, PRECISIONS, SWITCHES, DistillConfig, DPOConfig, KTOConfig, RaftConfig,
                                       RewardConfig, SFTConfig, TrainerConfig)

__all__ = [
    "GUARD_NAMES", "IMPORT_DTYPES", "LM_HEADS", "MAX_INT", "MAX_LINE_BYTES", "MAX_YAML_DEPTH", "MAX_YAML_NODES",
    "OVERRIDE_SOURCE", "PRECISIONS", "REAL_RECIPE_SECTIONS", "SECTIONS", "SWITCHES", "TOOL_TASK_SECTIONS",
    "ConfigError", "CyclesConfig", "DataFields", "DataReportConfig", "DistillConfig", "DPOConfig", "EvalConfig",
    "FlowConfig", "GenerateConfig", "GuardsConfig", "GymGenerateConfig", "ImportModelConfig", "KTOConfig", "ModelConfig",
    "RLConfig", "RaftConfig", "RejectionConfig", "RewardConfig", "SFTConfig", "ToolEvalConfig", "ToolGenerateConfig",
    "RetentionConfig", "TeamConfig", "TrackingConfig",
    "TrainerConfig",
    "RENAMED", "build_config", "config_params", "config_to_dict", "field_docs", "load_config", "parse_overrides",
    "read_params", "section_fields",
    "unknown_field", "unknown_sections",
]
