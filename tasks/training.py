"""Training tasks: one per alignment stage, each a nested MLflow run that returns paths and md5s.

Every task takes the stage's config as a plain dict, the md5s of its inputs (part of the
cache key, so changed data or models rerun the stage), the flow's parent run id and where to
run (``isolation``: this process, or a child process — see :mod:`tasks.worker`).
"""

from __future__ import annotations

from typing import Any

from prefect import task

from tasks.common import TASK_DEFAULTS
from tasks.worker import run_in_child, run_inline


def _run_stage(stage: str, params: dict[str, Any], tracking: dict[str, Any], parent_run_id: str | None,
               isolation: str, guards: dict[str, Any] | None = None) -> dict[str, Any]:
    """``inline``: in this process; ``process``: in a child process whose death is a retryable failure.
    ``guards``: the ``guards`` section, for a policy stage's guards (None: none)."""
    if isolation == "process":
        return run_in_child(stage, params, tracking, parent_run_id, guards)
    if isolation != "inline":
        raise ValueError(f"isolation must be inline or process, got {isolation!r}")
    return run_inline(stage, params, tracking, parent_run_id, guards)


@task(name="train-sft", **TASK_DEFAULTS)
def train_sft(params: dict[str, Any], tracking: dict[str, Any], input_md5: dict[str, str],
              parent_run_id: str | None = None, isolation: str = "inline") -> dict[str, Any]:
    """Supervised fine-tuning; the model is logged and registered."""
    del input_md5  # cache key only: model and data content
    return _run_stage("sft", params, tracking, parent_run_id, isolation)


@task(name="train-reward-model", **TASK_DEFAULTS)
def train_reward(params: dict[str, Any], tracking: dict[str, Any], input_md5: dict[str, str],
                 parent_run_id: str | None = None, isolation: str = "inline") -> dict[str, Any]:
    """Bradley-Terry reward model on preference pairs."""
    del input_md5
    return _run_stage("reward", params, tracking, parent_run_id, isolation)


@task(name="train-dpo", **TASK_DEFAULTS)
def train_dpo(params: dict[str, Any], tracking: dict[str, Any], input_md5: dict[str, str],
              parent_run_id: str | None = None, isolation: str = "inline",
              guards: dict[str, Any] | None = None) -> dict[str, Any]:
    """DPO / IPO / cDPO on preference pairs."""
    del input_md5
    return _run_stage("dpo", params, tracking, parent_run_id, isolation, guards)


@task(name="train-kto", **TASK_DEFAULTS)
def train_kto(params: dict[str, Any], tracking: dict[str, Any], input_md5: dict[str, str],
              parent_run_id: str | None = None, isolation: str = "inline",
              guards: dict[str, Any] | None = None) -> dict[str, Any]:
    """KTO on unpaired (or split preference) examples."""
    del input_md5
    return _run_stage("kto", params, tracking, parent_run_id, isolation, guards)


@task(name="train-raft", **TASK_DEFAULTS)
def train_raft(params: dict[str, Any], tracking: dict[str, Any], input_md5: dict[str, str],
               parent_run_id: str | None = None, isolation: str = "inline",
               guards: dict[str, Any] | None = None) -> dict[str, Any]:
    """SFT of the policy on its kept best-of-n samples."""
    del input_md5
    return _run_stage("raft", params, tracking, parent_run_id, isolation, guards)


@task(name="distill-teacher", **TASK_DEFAULTS)
def distill_teacher(params: dict[str, Any], tracking: dict[str, Any], input_md5: dict[str, str],
                    parent_run_id: str | None = None, isolation: str = "inline",
                    guards: dict[str, Any] | None = None) -> dict[str, Any]:
    """Token-level distillation of a teacher into a student."""
    del input_md5
    return _run_stage("distill", params, tracking, parent_run_id, isolation, guards)


@task(name="train-rl", **TASK_DEFAULTS)
def train_rl(params: dict[str, Any], tracking: dict[str, Any], input_md5: dict[str, str],
             parent_run_id: str | None = None, isolation: str = "inline",
             guards: dict[str, Any] | None = None) -> dict[str, Any]:
    """Online RL (GRPO, PPO, ...) from the policy's own rollouts."""
    del input_md5
    return _run_stage("rl", params, tracking, parent_run_id, isolation, guards)
