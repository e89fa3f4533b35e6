"""Training tasks: one per training stage of the registry, each a nested MLflow run that returns paths and md5s.

Every task takes the stage's config as a plain dict, the md5s of its inputs (part of the
cache key, so changed data or models rerun the stage), the flow's parent run id, where to
run (``isolation``: this process, or a child process — see :mod:`tasks.worker`) and, for a
policy stage, the ``guards`` section. :func:`training_task` makes a stage's task from its
registration (rlhf_core/config/stage_registry.py: the task's name, the stage's help line).
"""

from __future__ import annotations

import functools
from typing import Any

from prefect import task
from prefect.cache_policies import CacheKeyFnPolicy

from rlhf_core.config import stage_registry as registry
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


@functools.cache
def training_task(name: str) -> Any:
    """The Prefect task of the training stage ``name``."""
    stage = registry.get(name)
    if not stage.trains:
        raise ValueError(f"stage {name!r} does not train; training stages: "
                         f"{', '.join(s.name for s in registry.training())}")

    def train(params: dict[str, Any], tracking: dict[str, Any], input_md5: dict[str, str],
              parent_run_id: str | None = None, isolation: str = "inline",
              guards: dict[str, Any] | None = None) -> dict[str, Any]:
        del input_md5  # cache key only: model and data content
        return _run_stage(name, params, tracking, parent_run_id, isolation, guards if stage.guarded else None)

    train.__name__ = train.__qualname__ = stage.task.replace("-", "_")
    train.__doc__ = f"{stage.help[:1].upper()}{stage.help[1:]}."
    # every stage's task runs this one function: its name keeps two stages' cache keys apart
    policy = TASK_DEFAULTS["cache_policy"] + CacheKeyFnPolicy(cache_key_fn=lambda context, parameters: name)
    return task(name=stage.task, **{**TASK_DEFAULTS, "cache_policy": policy})(train)


train_sft = training_task("sft")
train_reward = training_task("reward")
train_dpo = training_task("dpo")
train_raft = training_task("raft")
train_rl = training_task("rl")
