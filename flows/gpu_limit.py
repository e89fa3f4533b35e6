"""The GPU concurrency limit: flows of every project on one Prefect server take turns on the GPUs.

A flow run holds ``flow.gpu_slots`` slots of the Prefect global concurrency limit ``flow.gpu_limit``
(``alignflow-gpus``) from its first GPU stage to its last; a run that finds every slot held waits for one, and
says so in its Prefect log. The limit lives on the Prefect server, so it spans projects and machines, where the
project's flow lock (:func:`flows.align.one_flow_at_a_time`) spans one project folder only. The limit's size is
the GPUs the flows share: made on first use with one slot per device of the machine (:func:`device_count`), by
``alignflow services up`` from ``team.gpu_devices``, or resized with ``prefect gcl update alignflow-gpus --limit N``.
"""

from __future__ import annotations

import logging
import shutil
import subprocess
import time
from contextlib import ExitStack, contextmanager
from typing import Any, Iterator

from prefect import get_client
from prefect.client.schemas.actions import GlobalConcurrencyLimitCreate, GlobalConcurrencyLimitUpdate
from prefect.client.schemas.objects import ConcurrencyLeaseHolder
from prefect.concurrency.asyncio import ConcurrencySlotAcquisitionError
from prefect.concurrency.sync import concurrency
from prefect.exceptions import MissingContextError, ObjectAlreadyExists, ObjectNotFound
from prefect.logging import get_run_logger
from prefect.runtime import flow_run

from rlhf_core.config import ConfigError, FlowConfig

LOCKED = 423
"""Prefect's answer to a slot request when every slot is held."""


def device_count() -> int:
    """This machine's GPUs as ``nvidia-smi -L`` lists them; 1 without any (a CPU machine's runs still take turns)."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return 1
    try:
        listed = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired):
        return 1
    return max(1, sum(line.startswith("GPU ") for line in listed.splitlines()))


def ensure_gpu_limit(name: str, slots: int) -> int:
    """The limit ``name`` on the Prefect server, made with ``slots`` slots if missing (an existing one keeps its
    size, which its owner may have set); returns its size."""
    with get_client(sync_client=True) as client:
        try:
            return client.read_global_concurrency_limit_by_name(name).limit
        except ObjectNotFound:
            pass
        try:
            client.create_global_concurrency_limit(GlobalConcurrencyLimitCreate(name=name, limit=slots))
        except ObjectAlreadyExists:  # another flow made it first
            pass
        return client.read_global_concurrency_limit_by_name(name).limit


def resize_gpu_limit(name: str, slots: int) -> int:
    """Set the limit ``name`` to ``slots`` slots; returns the size the server now reports."""
    with get_client(sync_client=True) as client:
        client.update_global_concurrency_limit(name, GlobalConcurrencyLimitUpdate(limit=slots))
        return client.read_global_concurrency_limit_by_name(name).limit


def limit_state(name: str) -> dict[str, Any]:
    """``{limit, active_slots, active}`` of the limit ``name``, as the Prefect server reports it."""
    with get_client(sync_client=True) as client:
        limit = client.read_global_concurrency_limit_by_name(name)
    return {"limit": limit.limit, "active_slots": limit.active_slots, "active": limit.active}


def _run_logger() -> logging.Logger | logging.LoggerAdapter:
    """The flow run's logger (its lines reach the Prefect server), else this module's."""
    try:
        return get_run_logger()
    except MissingContextError:
        return logging.getLogger(__name__)


def _holder() -> ConcurrencyLeaseHolder | None:
    """The flow run that holds the slots, shown with the limit's lease on the server."""
    run_id = flow_run.get_id()
    return ConcurrencyLeaseHolder(type="flow_run", id=run_id) if run_id else None


def _slots(cfg: FlowConfig, max_retries: int | None = None) -> Any:
    """Prefect's context manager of the run's slots. A failed lease renewal (the server briefly away) leaves the
    stage running rather than killing hours of training; the lease then lapses after its 300 s."""
    return concurrency(cfg.gpu_limit, occupy=cfg.gpu_slots, max_retries=max_retries, strict=True, holder=_holder(),
                       raise_on_lease_renewal_failure=False)


def _every_slot_held(exc: ConcurrencySlotAcquisitionError) -> bool:
    response = getattr(exc.__cause__, "response", None)
    return getattr(response, "status_code", None) == LOCKED


def gpu_limit_tags(cfg: FlowConfig, waited: float) -> dict[str, str]:
    """The flow's parent-run tags: the limit it held (``none``) and the seconds it waited for it."""
    return {"prefect.gpu_limit": cfg.gpu_limit or "none", "prefect.gpu_wait_s": f"{waited:.1f}"}


@contextmanager
def gpu_stages(cfg: FlowConfig) -> Iterator[float]:
    """Hold ``cfg.gpu_slots`` slots of ``cfg.gpu_limit`` for the body (nothing when the name is empty); yields the
    seconds the run waited for them. A run that finds every slot held logs that it waits, and for what."""
    if not cfg.gpu_limit:
        yield 0.0
        return
    size = ensure_gpu_limit(cfg.gpu_limit, device_count())
    if cfg.gpu_slots > size:
        raise ConfigError(f"flow.gpu_slots: {cfg.gpu_slots} slots asked of Prefect limit {cfg.gpu_limit!r}, which has "
                         f"{size}: the run would wait for ever (prefect gcl update {cfg.gpu_limit} --limit N)")
    log, start = _run_logger(), time.monotonic()
    with ExitStack() as stack:
        try:
            stack.enter_context(_slots(cfg, max_retries=0))
        except ConcurrencySlotAcquisitionError as exc:
            if not _every_slot_held(exc):
                raise
            log.warning("GPU limit %r: all %d slot(s) held by other flow runs on this Prefect server; waiting for "
                        "%d", cfg.gpu_limit, size, cfg.gpu_slots)
            stack.enter_context(_slots(cfg))
        waited = time.monotonic() - start
        log.info("GPU limit %r: holding %d of %d slot(s) (waited %.1f s)", cfg.gpu_limit, cfg.gpu_slots, size, waited)
        yield waited
