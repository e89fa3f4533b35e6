"""What every alignflow task shares: retry rule and cache policy (and the core's source hash in its key)."""

from __future__ import annotations

import functools
import hashlib
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

from prefect.cache_policies import INPUTS, NO_CACHE, TASK_SOURCE, CacheKeyFnPolicy

import rlhf_core
from rlhf_core.config import ConfigError
from rlhf_core.data.io import DataError
from rlhf_core.data.validate import ValidationFailed
from rlhf_core.models import ModelLoadError
from rlhf_core.trainers.loop import NonFiniteError
from tasks.errors import StageRejected

# Bad input fails the same way every time: retrying it only delays the report. A NaN loss
# too: the retry would resume from the same checkpoint and meet the same NaN.
PERMANENT_ERRORS: tuple[type[BaseException], ...] = (ValidationFailed, DataError, ConfigError, ModelLoadError,
                                                     FileNotFoundError, NonFiniteError)



def _project_key(context: Any, parameters: dict[str, Any]) -> str:
    """The absolute project folder: stage paths are relative to it, so two projects with
    identical inputs must not share cached results (Prefect's result store is global)."""
    del context, parameters
    return str(Path.cwd().resolve())


def source_hash(root: Path) -> str:
    """sha256 over every ``*.py`` file under ``root``: each file's relative path and bytes, in path order."""
    digest = hashlib.sha256()
    for path in sorted(root.rglob("*.py"), key=lambda p: p.relative_to(root).as_posix()):
        data = path.read_bytes()
        digest.update(f"{path.relative_to(root).as_posix()}\0{len(data)}\0".encode())
        digest.update(data)
    return digest.hexdigest()


def package_version() -> str:
    """The installed alignflow version, else ``rlhf_core.__version__``, else ``unknown``."""
    try:
        return version("alignflow")
    except PackageNotFoundError:
        return str(getattr(rlhf_core, "__version__", "unknown"))


@functools.cache
def core_fingerprint() -> str:
    """The package version and the source hash of the ``rlhf_core`` this process imported.

    A task wrapper's source is only the entry into its stage: the trainer it runs lives in
    ``rlhf_core``, so an edited trainer (or an upgrade) must not reuse results of the old one.
    Computed once per process: the code a process runs does not change under it.
    """
    return f"{package_version()}:{source_hash(Path(rlhf_core.__file__).resolve().parent)}"


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


TASK_DEFAULTS: dict[str, Any] = dict(
    retries=1,
    retry_delay_seconds=2,
    retry_condition_fn=retry_transient,
    cache_policy=CACHE_POLICY,
    persist_result=True,
)
