"""Model registry: every cycle's model becomes ``candidate``; ``champion`` only if it wins.

The model is registered from the MLflow run of the stage that trained it (copied with the
transformers flavor, or by reference to its folder and DVC md5: ``tracking.model_storage``), so
the version's source run is that stage run, whose inputs and lineage tags say which data and
parent model produced it. The champion comparison (the stage's ``eval/accuracy`` against the
current champion's) is recorded on the version as tags and returned, so the flow logs it on its
cycle run. A stage whose eval items carry no labels has no ``eval/accuracy`` (``accuracy`` None): nothing
to hold against the champion's, so its version becomes champion only through a passed gate (the held-out
reward or the user's metric command against its parent, :mod:`rlhf_core.promotion.guards`) and stays candidate
otherwise. ``tracking.keep_model_versions`` then deletes old versions no alias points at.

Two flows promoting into one registry at once: reading the champion, comparing and moving the
alias is a compare-and-set, which MLflow does not offer, so without care both read the old
champion and the worse model can be set last.

* On one host the whole compare-and-set runs under the registry lock, a file lock in the
  ``.alignflow/`` folder next to the sqlite store (the project's own in the default set-up),
  so the second flow compares against the first one's result.
* On a shared server, which that lock cannot reach from another host, the writer re-reads the
  alias after setting it, twice, ``tracking.registry_settle_s`` apart: an overwrite by a worse
  model is set back, a better one is left and this version's verdict says so. This closes the
  race unless a writer stalls longer than the settle time between reading and setting the alias.

Registration, the alias moves and the model card are one Prefect transaction
(:func:`prefect.transactions.transaction`) on the registry's own protocol: the version is registered ``pending``, the
aliases move under the compare-and-set above, the card is written, then the version is tagged ``done``. A failure
at any point rolls back what was done, newest first: each alias still on this version goes back to the version it
named before (one a concurrent flow has moved since is left alone), and the version this registration made is
deleted (with its registered model, when this was its first version). The previous champion stays and nothing
half-registered is left; the task's retry then registers afresh. The model is pushed into the artifact store before
the version is made: a push that fails (the object store unreachable) is
:class:`rlhf_core.tracking.artifact_push.ArtifactPushFailed`, with nothing to roll back.
``ALIGNFLOW_FAULT=register:<point>`` (``version``, ``alias``, ``card``) fails it at that point, for the tests.

Run: called by the align, iterative_dpo and raft flows (``register_model``).
"""

from __future__ import annotations

import json
import logging
import random
import tempfile
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator
from urllib.parse import urlsplit

from filelock import FileLock, Timeout
from prefect import task
from prefect.transactions import CommitMode, transaction

from rlhf_core.common.faults import fires
from rlhf_core.config import GuardsConfig, TrackingConfig, build_config
from rlhf_core.tracking.artifact_push import pushing
from rlhf_core.tracking.lineage import dvc_md5
from rlhf_core.tracking.mlflow_runs import (
    MODEL_REF_FILE,
    REGISTRATION_TAG,
    STORAGE_TAG,
    MlflowTracker,
    project_root,
    prune_model_versions,
    resolve_tracking_uri,
)
from rlhf_core.tracking.model_card import render_model_card

CANDIDATE, CHAMPION = "candidate", "champion"
METRIC_TAG = "eval_accuracy"
LOCK_NAME = "registry.lock"
MAX_REREADS = 8  # a promotion re-sets the alias at most this many times before it accepts what it reads
log = logging.getLogger(__name__)


class RegistryError(RuntimeError):
    """The registry lock could not be had in time."""


class ModelRefChanged(RuntimeError):
    """A reference-stored version's folder is gone or no longer holds the content that was registered."""


@dataclass(frozen=True)
class Champion:
    """Which version holds the champion alias, and its recorded accuracy (nan if untagged)."""

    version: str
    accuracy: float


# --------------------------------------------------------------------------------------
# The lock (one host) and the re-read (shared server)
# --------------------------------------------------------------------------------------


def registry_lock_path(uri: str) -> Path:
    """The lock file: beside a sqlite store, so every project that points at that file shares it; else (a
    server) in the project's ``.alignflow``."""
    if uri.startswith("sqlite:///") and ":memory:" not in uri:
        return Path(uri[len("sqlite:///"):]).resolve().parent / ".alignflow" / LOCK_NAME
    return project_root() / ".alignflow" / LOCK_NAME


def shared_store(uri: str) -> bool:
    """A store that other hosts may write to: anything but a local sqlite file or file store."""
    return urlsplit(uri).scheme not in ("sqlite", "file", "")


@contextmanager
def registry_lock(uri: str, who: str, timeout_s: float = 600.0) -> Iterator[None]:
    """Hold the registry lock of store ``uri``; logs once when another flow holds it and this one waits."""
    path = registry_lock_path(uri)
    path.parent.mkdir(parents=True, exist_ok=True)
    lock = FileLock(str(path))
    try:
        lock.acquire(timeout=0)
    except Timeout:
        log.warning("%s: another flow is promoting in this registry; waiting for %s (up to %.0f s)",
                    who, path, timeout_s)
        try:
            lock.acquire(timeout=timeout_s)
        except Timeout:
            raise RegistryError(f"{who}: gave up waiting {timeout_s:.0f} s for the registry lock {path}") from None
    try:
        yield
    finally:
        lock.release()


def read_champion(client: Any, name: str) -> Champion | None:
    """The version the champion alias points at now, or None (read through the registered model's aliases:
    a lookup by alias raises the same error for a missing alias as for a server fault)."""
    version = client.get_registered_model(name).aliases.get(CHAMPION)
    if version is None:
        return None
    tags = client.get_model_version(name, str(version)).tags
    return Champion(str(version), float(tags.get(METRIC_TAG, "nan")))


def set_alias(client: Any, name: str, alias: str, version: str, attempts: int = 5) -> None:
    """``client.set_registered_model_alias``, retried when a concurrent writer wins the server's race.

    MLflow's SQL store sets an alias by looking for its row, then inserting or updating it: two flows
    setting an alias nobody held yet both insert, and the second gets a UNIQUE-constraint error (HTTP 400)
    although nothing is wrong with its request (seen under load on a shared server). The row exists by
    then, so the retry updates it; :func:`hold_title` then settles which model keeps ``champion``.
    """
    from mlflow.exceptions import MlflowException  # lazy: mlflow (only when a model is registered)

    for attempt in range(attempts):
        try:
            client.set_registered_model_alias(name, alias, version)
            return
        except MlflowException as exc:
            if "UNIQUE constraint" not in str(exc) and "already exists" not in str(exc).lower():
                raise
            if attempt == attempts - 1:
                raise
            log.warning("%s: setting alias %s raced another writer; retrying", name, alias)
            time.sleep(random.uniform(0.05, 0.3))


def _beats(accuracy: float, other: float, higher_is_better: bool) -> bool:
    return accuracy > other if higher_is_better else accuracy < other


def hold_title(client: Any, name: str, ours: Champion, higher_is_better: bool, settle_s: float) -> Champion:
    """After setting the champion alias to ``ours``: re-read it until it reads ``ours`` twice in a row
    (once when ``settle_s`` is 0: under the lock nothing else writes), ``settle_s`` apart. A worse model
    (or none) found there is overwritten again; a better or equal one, set by a concurrent flow, is left.
    Returns the version holding the title at the end."""
    confirmed, holder = 0, ours
    for _ in range(MAX_REREADS):
        time.sleep(settle_s)
        holder = read_champion(client, name) or Champion("", float("nan"))
        if holder.version == ours.version:
            confirmed += 1
            if confirmed >= (2 if settle_s > 0 else 1):
                return holder
        elif not holder.version or _beats(ours.accuracy, holder.accuracy, higher_is_better):
            log.warning("%s: champion alias moved to v%s (%.4f) after v%s (%.4f) took it; setting it back", name,
                        holder.version or "-", holder.accuracy, ours.version, ours.accuracy)
            set_alias(client, name, CHAMPION, ours.version)
            confirmed = 0
        else:
            return holder
    return holder


def promote_if_better(client: Any, name: str, version: str, accuracy: float, higher_is_better: bool,
                      settle_s: float) -> dict[str, Any]:
    """Move the champion alias to ``version`` if it beats the current champion, then verify it held
    (:func:`hold_title`). Returns ``promoted``, ``champion_version``, ``previous_champion_accuracy`` and a
    one-line ``verdict``."""
    before = read_champion(client, name)
    final = before
    if before is None or _beats(accuracy, before.accuracy, higher_is_better):
        set_alias(client, name, CHAMPION, version)
        final = hold_title(client, name, Champion(version, accuracy), higher_is_better, settle_s)
    promoted = final is not None and final.version == version
    verdict = f"candidate v{version} ({accuracy:.4f}) " + (
        f"vs champion v{before.version} ({before.accuracy:.4f}): " if before else "no champion: ")
    if promoted:
        verdict += "promoted to champion"
    elif before is not None and final.version == before.version:
        verdict += "champion kept"
    else:
        verdict += f"champion kept (v{final.version} ({final.accuracy:.4f}) was promoted concurrently)"
    return {"promoted": promoted, "champion_version": final.version if final else None,
            "previous_champion_accuracy": before.accuracy if before else None, "verdict": verdict}


# --------------------------------------------------------------------------------------
# The task
# --------------------------------------------------------------------------------------


def _metric_text(accuracy: float | None) -> str:
    """The version's ``eval_accuracy`` tag: the accuracy, or ``nan`` when the eval items had no labels."""
    return "nan" if accuracy is None else f"{accuracy:.6f}"


def promote_on_gate(client: Any, name: str, version: str, gate_passed: bool, why: str | None = None) -> dict[str, Any]:
    """A version without an accuracy (unlabelled eval items): champion when its stage's gate passed (the gate metric
    beat its parent's beyond noise, no guard fired), else candidate; no champion comparison, there is no accuracy
    to compare. ``why``: the gate's reasons, quoted in the verdict when it did not pass."""
    before = read_champion(client, name)
    head = f"candidate v{version} (no eval/accuracy: the eval items carry no labels) "
    if gate_passed:
        set_alias(client, name, CHAMPION, version)
        verdict = head + "promoted to champion on its gate against its parent"
    else:
        verdict = head + ("not promoted: no accuracy to hold against the champion's and no passed gate"
                          + (f" ({why})" if why else ""))
    return {"promoted": gate_passed, "champion_version": version if gate_passed else (before.version if before else None),
            "previous_champion_accuracy": before.accuracy if before else None, "verdict": verdict}


def _version_of(client: Any, cfg: TrackingConfig, model_dir: str, run_id: str, name: str,
                accuracy: float | None) -> tuple[str, str, bool]:
    """This run's version of ``name`` (registered now, ``pending``, if it has none yet), its model URI, and whether
    this registration owns it: made now, or left ``pending`` by an attempt that died without rolling back."""
    found = client.search_model_versions(f"name='{name}' and run_id='{run_id}'")
    if found:  # a stage run already registered (a cached stage in a re-run flow, a retry) keeps its version
        return str(found[0].version), found[0].source, found[0].tags.get(REGISTRATION_TAG) == "pending"
    md5 = dvc_md5(model_dir) if cfg.model_storage == "reference" else None
    with pushing(f"the model {name}", run_id, client.tracking_uri):  # before the version: nothing to undo if it fails
        model_uri = MlflowTracker(client, run_id, tracking=cfg).log_hf_model(
            model_dir, name, md5=md5, version_tags={METRIC_TAG: _metric_text(accuracy), REGISTRATION_TAG: "pending"},
            prune=False)
    return str(client.search_model_versions(f"name='{name}' and run_id='{run_id}'")[0].version), model_uri, True


# --------------------------------------------------------------------------------------
# The transaction's undo steps (Prefect rollback hooks) and its test faults
# --------------------------------------------------------------------------------------


class RegistrationFault(RuntimeError):
    """Raised by :func:`fault_point`: a test's fault in a registration."""


def fault_point(point: str) -> None:
    """Test hook ``ALIGNFLOW_FAULT=register:<point>[:<marker file>]`` (:func:`rlhf_core.common.faults.fires`): fail
    the registration at ``point``."""
    spec = fires("register", point)
    if spec is not None:
        raise RegistrationFault(f"register: fault injected at {point} (ALIGNFLOW_FAULT={spec})")


def undo_version(client: Any, name: str, version: str, made_model: bool) -> Callable[[Any], None]:
    """Rollback hook: delete ``version`` (its aliases go with it) and, when this registration made the registered
    model and no version of it is left, the model too."""

    def delete_half_registered_version(_txn: Any) -> None:
        client.delete_model_version(name, version)
        if made_model and not client.search_model_versions(f"name='{name}'"):
            client.delete_registered_model(name)
        log.warning("%s v%s: registration rolled back; the version is deleted", name, version)

    return delete_half_registered_version


def undo_aliases(client: Any, uri: str, name: str, version: str, before: dict[str, str]) -> Callable[[Any], None]:
    """Rollback hook: each alias still on ``version`` goes back to the version it named in ``before`` (or is
    removed); one that a concurrent flow has moved since is left to it (compare-and-set, under the registry lock)."""

    def restore_aliases(_txn: Any) -> None:
        with registry_lock(uri, f"{name} v{version} (rollback)"):
            now = client.get_registered_model(name).aliases
            for alias in (CHAMPION, CANDIDATE):
                if str(now.get(alias)) != version:
                    continue
                if alias in before:
                    set_alias(client, name, alias, str(before[alias]))
                else:
                    client.delete_registered_model_alias(name, alias)
        log.warning("%s v%s: aliases restored (%s)", name, version,
                    ", ".join(f"{a} v{v}" for a, v in before.items()) or "none before")

    return restore_aliases


def gate_blocks(run_tags: dict[str, str], guards: GuardsConfig | None) -> str | None:
    """Why the promotion gate keeps this version ``candidate`` (the stage run's ``guard.gate`` text), or None.

    The stage computed its guards and the gate against its parent (:func:`rlhf_core.stages.guard.check_stage_guards`);
    here the gate is enforced when ``guards.gate`` is on. A run without guard tags (guards off, or a stage that
    has none) is judged on the champion comparison alone, as before guards existed."""
    if guards is None or not guards.gate or run_tags.get("guard.gate_passed") != "false":
        return None
    return run_tags.get("guard.gate", "gate blocked")


def _gate_text(run_tags: dict[str, str], guards: GuardsConfig | None, blocked: str | None) -> str:
    """What the gate said, for the model card and the task's answer."""
    said = run_tags.get("guard.gate")
    if said is None:
        return "no guards on the source run: promoted on the champion comparison alone"
    if guards is None or not guards.gate:
        return f"gate off (guards.gate: false); the stage's gate said: {said}"
    return blocked or said


def move_aliases(client: Any, name: str, version: str, accuracy: float | None, higher_is_better: bool,
                 settle_s: float, run_tags: dict[str, str], guards: GuardsConfig | None,
                 blocked: str | None) -> dict[str, Any]:
    """``candidate`` to ``version``, and ``champion`` by the gate and the champion comparison (under the registry
    lock, :func:`promote_if_better`, :func:`promote_on_gate`); returns the outcome."""
    set_alias(client, name, CANDIDATE, version)
    if accuracy is None:
        return promote_on_gate(client, name, version, blocked is None and guards is not None and guards.gate
                               and run_tags.get("guard.gate_passed") == "true", blocked or run_tags.get("guard.gate"))
    if blocked is None:
        return promote_if_better(client, name, version, accuracy, higher_is_better, settle_s)
    before = read_champion(client, name)
    return {"promoted": False, "champion_version": before.version if before else None,
            "previous_champion_accuracy": before.accuracy if before else None,
            "verdict": f"candidate v{version} ({accuracy:.4f}): not promoted, {blocked}"}


@task(name="register-model", retries=1, retry_delay_seconds=5)
def register_model(model_dir: str, run_id: str, accuracy: float | None, registered_name: str,
                   tracking: dict[str, Any], higher_is_better: bool = True,
                   guards: dict[str, Any] | None = None) -> dict[str, Any]:
    """Register ``model_dir`` from stage run ``run_id``; alias it ``candidate``, and ``champion`` if it passes the
    gate (``guards``: the ``guards`` section; None skips the gate) and beats the champion. ``accuracy`` None (eval
    items without labels): champion only through a passed gate (:func:`promote_on_gate`). The version's
    description becomes its model card (:func:`model_card`); the stage's ``guard.*`` tags are copied onto it.
    All of it is one transaction: a failure leaves the aliases where they were and no version of this run behind
    (the module's docstring)."""
    import mlflow  # lazy: mlflow (only when a model is registered)
    from mlflow import MlflowClient  # lazy: mlflow (only when a model is registered)

    cfg = build_config(TrackingConfig, "tracking", tracking)
    guards_cfg = build_config(GuardsConfig, "guards", guards) if guards is not None else None
    uri = resolve_tracking_uri(cfg)
    client = MlflowClient(tracking_uri=uri)
    mlflow.set_tracking_uri(uri)  # the copy goes through MLflow's fluent API
    had_model = bool(client.search_registered_models(f"name='{registered_name}'"))
    # EAGER: committed when the block ends, so a later failure of the task (pruning) undoes nothing of it
    with transaction(commit_mode=CommitMode.EAGER) as txn:
        version, model_uri, ours = _version_of(client, cfg, model_dir, run_id, registered_name, accuracy)
        if ours:
            txn.on_rollback_hooks.append(undo_version(client, registered_name, version, made_model=not had_model))
        fault_point("version")
        client.set_model_version_tag(registered_name, version, METRIC_TAG, _metric_text(accuracy))
        run = client.get_run(run_id)
        for key, value in run.data.tags.items():
            if key.startswith("guard."):
                client.set_model_version_tag(registered_name, version, key, value[:4900])
        blocked = gate_blocks(run.data.tags, guards_cfg)
        with registry_lock(uri, f"{registered_name} v{version}"):
            before = {k: str(v) for k, v in client.get_registered_model(registered_name).aliases.items()
                      if k in (CANDIDATE, CHAMPION)}
            txn.on_rollback_hooks.append(undo_aliases(client, uri, registered_name, version, before))
            outcome = move_aliases(client, registered_name, version, accuracy, higher_is_better,
                                   cfg.registry_settle_s if shared_store(uri) else 0.0, run.data.tags, guards_cfg,
                                   blocked)
            fault_point("alias")
        outcome["gate"] = _gate_text(run.data.tags, guards_cfg, blocked)
        client.set_model_version_tag(registered_name, version, "promotion", outcome["verdict"][:4900])
        client.update_model_version(registered_name, version, description=model_card(
            client, registered_name, version, run, outcome))
        fault_point("card")
        client.set_model_version_tag(registered_name, version, REGISTRATION_TAG, "done")
    pruned = prune_model_versions(client, registered_name, cfg.keep_model_versions) if cfg.keep_model_versions else []
    return {"model_uri": model_uri, "version": version, **outcome, "pruned_versions": pruned}


def resolve_model_ref(client: Any, name: str, version_or_alias: str) -> Path:
    """The folder a reference-stored version of ``name`` points at (a version number or an alias such as
    ``champion``), after checking that its DVC md5 is still the registered one; :class:`ModelRefChanged`
    if the folder is gone or holds other content."""
    version = (client.get_model_version(name, version_or_alias) if str(version_or_alias).isdigit()
               else client.get_model_version_by_alias(name, version_or_alias))
    if version.tags.get(STORAGE_TAG) != "reference":
        raise ValueError(f"{name} v{version.version} holds a copy of its model, not a reference: load "
                         f"models:/{name}/{version.version} with mlflow.transformers")
    with tempfile.TemporaryDirectory() as tmp:
        pointer = json.loads(Path(client.download_artifacts(version.run_id, MODEL_REF_FILE, tmp)).read_text())
    folder = Path(pointer["path"])
    found = dvc_md5(folder) if folder.is_dir() else None
    if found != pointer["dvc_md5"]:
        state = f"now holds DVC md5 {found}" if found else "is gone"
        raise ModelRefChanged(
            f"{name} v{version.version} was registered by reference to {folder} with DVC md5 "
            f"{pointer['dvc_md5']}; that folder {state}. Restore it from DVC (check out the commit that "
            "produced it, then dvc checkout or dvc pull), or register by copy (tracking.model_storage: copy).")
    return folder


def parent_version(client: Any, tags: dict[str, str], limit: int = 200) -> str | None:
    """``NAME vN`` of a registered version whose source run output the model this run started from (its DVC md5,
    tag ``dvc.md5.model``), newest first; None if none is registered (or the registry is larger than ``limit``)."""
    md5 = tags.get("dvc.md5.model") or tags.get("guard.parent_md5")
    if not md5:
        return None
    versions = client.search_model_versions(max_results=limit)
    for v in sorted(versions, key=lambda v: int(v.creation_timestamp or 0), reverse=True):
        try:
            if client.get_run(v.run_id).data.tags.get("dvc.md5.output_model") == md5:
                return f"{v.name} v{v.version}"
        except Exception as exc:  # noqa: BLE001 - a deleted run: not a parent
            log.debug("%s v%s: source run unreadable (%s)", v.name, v.version, exc)
    return None


def model_card(client: Any, name: str, version: str, run: Any, outcome: dict[str, Any]) -> str:
    """The version's description (:func:`rlhf_core.tracking.model_card.render_model_card`) from its source run."""
    return render_model_card(name, version, run.info.run_id, run.data.tags, run.data.params, run.data.metrics,
                             outcome, parent_version(client, run.data.tags))
