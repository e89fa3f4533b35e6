"""What every alignflow task shares: retry rule and cache policy."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from prefect.cache_policies import INPUTS, NO_CACHE, TASK_SOURCE, CacheKeyFnPolicy

from rlhf_core.config import ConfigError
from rlhf_core.data.io import DataError
from rlhf_core.data.validate import ValidationFailed
from rlhf_core.models import ModelLoadError
from rlhf_core.trainers.loop import NonFiniteError

# Bad input fails the same way every time: retrying it only delays the report. A NaN loss
# too: the retry would resume from the same checkpoint and meet the same NaN.
PERMANENT_ERRORS: tuple[type[BaseException], ...] = (ValidationFailed, DataError, ConfigError, ModelLoadError,
                                                     FileNotFoundError, NonFiniteError)



def _project_key(context: Any, parameters: dict[str, Any]) -> str:
    """The absolute project folder: stage paths are relative to it, so two projects with
    identical inputs must not share cached results (Prefect's result store is global)."""
    del context, parameters
    return str(Path.cwd().resolve())


# Inputs (config dicts and input md5s) + the task's code + the project folder. The parent
# run id differs per flow run but does not change a stage's output.
CACHE_POLICY = (INPUTS + TASK_SOURCE + CacheKeyFnPolicy(cache_key_fn=_project_key)) - "parent_run_id" - "isolation"

# Validation is cheap and is the gate's record in each flow run's lineage: never cached.
VALIDATION_CACHE_POLICY = NO_CACHE


def retry_transient(task: Any, task_run: Any, state: Any) -> bool:
    """Prefect retry condition: retry unless the failure is one of ``PERMANENT_ERRORS``."""
    del task, task_run
    from tasks.worker import StageRejected

    try:
        state.result()
    except (*PERMANENT_ERRORS, StageRejected):
        return False
    except Exception:  # noqa: BLE001 - any other failure may be transient
        return True
    return True


TASK_DEFAULTS: dict[str, Any] = dict(
    retries=1,
    retry_delay_seconds=2,
    retry_condition_fn=retry_transient,
    cache_policy=CACHE_POLICY,
    persist_result=True,
)
