"""What every alignflow task shares: retry rule and cache policy (and the core's source hash in its key)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from prefect.cache_policies import INPUTS, NO_CACHE, TASK_SOURCE, CacheKeyFnPolicy
from prefect.serializers import JSONSerializer

from rlhf_core.tracking.checkpoint import StorageError
from rlhf_core.config import ConfigError
from rlhf_core.data.io import DataError
from rlhf_core.data.validate import ValidationFailed
from rlhf_core.tracking.lineage import core_fingerprint, package_version, source_hash  # noqa: F401  (re-exported)
from rlhf_core.models.loading import ModelLoadError
from rlhf_core.common.redact import redact_secrets
from rlhf_core.trainers.step import NonFiniteError
from tasks.errors import StageRejected

# Bad input fails the same way every time: retrying it only delays the report. A NaN loss
# too: the retry would resume from the same checkpoint and meet the same NaN. A full or
# read-only disk (StorageError) stays full until someone frees it.
PERMANENT_ERRORS: tuple[type[BaseException], ...] = (ValidationFailed, DataError, ConfigError, ModelLoadError,
                                                     FileNotFoundError, NonFiniteError, StorageError)



def _project_key(context: Any, parameters: dict[str, Any]) -> str:
    """The absolute project folder: stage paths are relative to it, so two projects with
    identical inputs must not share cached results (Prefect's result store is global)."""
    del context, parameters
    return str(Path.cwd().resolve())


def _core_key(context: Any, parameters: dict[str, Any]) -> str:
    """The training core's part of the cache key: :func:`core_fingerprint`."""
    del context, parameters
    return core_fingerprint()


# Inputs (config dicts and input md5s) + the task's code + the training core's code and the
# package version + the project folder. The parent run id differs per flow run but does not
# change a stage's output.
CACHE_POLICY = (INPUTS + TASK_SOURCE + CacheKeyFnPolicy(cache_key_fn=_core_key)
                + CacheKeyFnPolicy(cache_key_fn=_project_key)) - "parent_run_id" - "isolation"

# Validation is cheap and is the gate's record in each flow run's lineage: never cached.
VALIDATION_CACHE_POLICY = NO_CACHE


def retry_transient(task: Any, task_run: Any, state: Any) -> bool:
    """Prefect retry condition: retry unless the failure is one of ``PERMANENT_ERRORS``."""
    del task, task_run
    try:
        state.result()
    except (*PERMANENT_ERRORS, StageRejected):
        return False
    except Exception:  # noqa: BLE001 - any other failure may be transient
        return True
    return True


def encode_failure(obj: Any) -> dict[str, str]:
    """JSON for what Prefect persists of a failed task, its exception: the type's name and the
    redacted message, as data (never an object to rebuild). Any other value JSON cannot hold is
    an error: a task returns paths, md5s, metrics and run ids."""
    if isinstance(obj, BaseException):
        return {"error": type(obj).__name__, "message": redact_secrets(str(obj))}
    raise TypeError(f"a task result must be JSON (dicts of paths, md5s, metrics), got {type(obj).__name__}")


# Task results are persisted as plain JSON: no cloudpickle and no object hook, so a cached result
# these tasks wrote is read back with json.loads alone, importing no class and running no code it
# names. A return value JSON cannot hold fails the task loudly instead of being pickled. (Prefect
# reads a record with the serializer the record's own metadata names, so the result store,
# ~/.prefect/storage or PREFECT_LOCAL_STORAGE_PATH, must still be writable by its user alone.)
RESULT_SERIALIZER = JSONSerializer(object_encoder="tasks.common.encode_failure", object_decoder=None)

TASK_DEFAULTS: dict[str, Any] = dict(
    retries=1,
    retry_delay_seconds=2,
    retry_condition_fn=retry_transient,
    cache_policy=CACHE_POLICY,
    persist_result=True,
    result_serializer=RESULT_SERIALIZER,
)
