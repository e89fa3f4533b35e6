"""Training tasks: one per alignment stage, each a nested MLflow run that returns paths and md5s.

Every task takes the stage's config as a plain dict, the md5s of its inputs (part of the
cache key, so changed data or models rerun the stage) and the flow's parent run id.
"""

from __future__ import annotations

from typing import Any

from prefect import task

from rlhf_core import stages
from rlhf_core.config import (
    DistillConfig,
    DPOConfig,
    KTOConfig,
    RaftConfig,
    RewardConfig,
    RLConfig,
    SFTConfig,
    TrackingConfig,
    build_config,
)
from tasks.common import TASK_DEFAULTS


def _tracking(tracking: dict[str, Any]) -> TrackingConfig:
    return build_config(TrackingConfig, "tracking", tracking)


@task(name="train-sft", **TASK_DEFAULTS)
def train_sft(params: dict[str, Any], tracking: dict[str, Any], input_md5: dict[str, str],
              parent_run_id: str | None = None) -> dict[str, Any]:
    """Supervised fine-tuning; the model is logged and registered."""
    del input_md5  # cache key only: model and data content
    return stages.sft(build_config(SFTConfig, "sft", params), _tracking(tracking), parent_run_id).to_dict()


@task(name="train-reward-model", **TASK_DEFAULTS)
def train_reward(params: dict[str, Any], tracking: dict[str, Any], input_md5: dict[str, str],
                 parent_run_id: str | None = None) -> dict[str, Any]:
    """Bradley-Terry reward model on preference pairs."""
    del input_md5
    return stages.reward(build_config(RewardConfig, "reward", params), _tracking(tracking), parent_run_id).to_dict()


@task(name="train-dpo", **TASK_DEFAULTS)
def train_dpo(params: dict[str, Any], tracking: dict[str, Any], input_md5: dict[str, str],
              parent_run_id: str | None = None) -> dict[str, Any]:
    """DPO / IPO / cDPO on preference pairs."""
    del input_md5
    return stages.dpo(build_config(DPOConfig, "dpo", params), _tracking(tracking), parent_run_id).to_dict()


@task(name="train-kto", **TASK_DEFAULTS)
def train_kto(params: dict[str, Any], tracking: dict[str, Any], input_md5: dict[str, str],
              parent_run_id: str | None = None) -> dict[str, Any]:
    """KTO on unpaired (or split preference) examples."""
    del input_md5
    return stages.kto(build_config(KTOConfig, "kto", params), _tracking(tracking), parent_run_id).to_dict()


@task(name="train-raft", **TASK_DEFAULTS)
def train_raft(params: dict[str, Any], tracking: dict[str, Any], input_md5: dict[str, str],
               parent_run_id: str | None = None) -> dict[str, Any]:
    """SFT of the policy on its kept best-of-n samples."""
    del input_md5
    return stages.raft(build_config(RaftConfig, "raft", params), _tracking(tracking), parent_run_id).to_dict()


@task(name="distill-teacher", **TASK_DEFAULTS)
def distill_teacher(params: dict[str, Any], tracking: dict[str, Any], input_md5: dict[str, str],
                    parent_run_id: str | None = None) -> dict[str, Any]:
    """Token-level distillation of a teacher into a student."""
    del input_md5
    return stages.distill(build_config(DistillConfig, "distill", params), _tracking(tracking),
                          parent_run_id).to_dict()


@task(name="train-rl", **TASK_DEFAULTS)
def train_rl(params: dict[str, Any], tracking: dict[str, Any], input_md5: dict[str, str],
             parent_run_id: str | None = None) -> dict[str, Any]:
    """Online RL (GRPO, PPO, ...) from the policy's own rollouts."""
    del input_md5
    return stages.rl(build_config(RLConfig, "rl", params), _tracking(tracking), parent_run_id).to_dict()
