"""What every alignflow task shares: retry rule and cache policy."""

from __future__ import annotations

from typing import Any

from prefect.cache_policies import INPUTS, TASK_SOURCE

from rlhf_core.config import ConfigError
from rlhf_core.data.io import DataError
from rlhf_core.data.validate import ValidationFailed
from rlhf_core.models import ModelLoadError

# Bad input fails the same way every time: retrying it only delays the report.
PERMANENT_ERRORS = (ValidationFailed, DataError, ConfigError, ModelLoadError, FileNotFoundError)

# The parent run id differs per flow run but does not change a stage's output.
CACHE_POLICY = (INPUTS + TASK_SOURCE) - "parent_run_id"


def retry_transient(task: Any, task_run: Any, state: Any) -> bool:
    """Prefect retry condition: retry unless the failure is one of ``PERMANENT_ERRORS``."""
    del task, task_run
    try:
        state.result()
    except PERMANENT_ERRORS:
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
