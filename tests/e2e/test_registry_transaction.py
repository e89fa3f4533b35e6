"""The champion alias moves inside a transaction (tasks/registry.py): a registration that fails after the version is
registered, after the aliases moved, or after the model card was written leaves the previous champion and candidate
where they were and no version of the failed run behind; its Prefect retry then registers afresh.

Real parts: an MLflow sqlite store, the micro model's folder (registered by reference: a pointer and its DVC md5),
a Prefect server for the retried task; the failure is raised in the registration itself
(``ALIGNFLOW_FAULT=register:<point>``).
"""

from __future__ import annotations

import pytest

from helpers import registry_store
from rlhf_core.tracking.mlflow_runs import REGISTRATION_TAG
from tasks.registry import CANDIDATE, CHAMPION, RegistrationFault, register_model

EXPERIMENT = "registry-transaction"


@pytest.fixture()
def store(isolated_project, micro_model):
    """(client, experiment id, the project's own copy of the micro model)."""
    return registry_store(isolated_project, micro_model, EXPERIMENT)


def _register(client, exp, model, accuracy, run_id=None, name="policy"):
    run_id = run_id or client.create_run(exp).info.run_id
    out = register_model.fn(model_dir=str(model), run_id=run_id, accuracy=accuracy, registered_name=name,
                            tracking={"experiment": EXPERIMENT, "model_storage": "reference"})
    return run_id, out


def _aliases(client, name="policy"):
    return {alias: str(version) for alias, version in client.get_registered_model(name).aliases.items()}


def _versions(client, name="policy"):
    return {str(v.version): (v.run_id, v.tags.get(REGISTRATION_TAG))
            for v in client.search_model_versions(f"name='{name}'")}


def test_a_registration_failing_half_way_leaves_the_champion_and_nothing_half_registered(store, monkeypatch):
    """At each point in turn (one store for all: a fresh MLflow store costs its migrations), then the retry."""
    client, exp, model = store
    first, out = _register(client, exp, model, 0.50)
    assert out["promoted"]
    better = client.create_run(exp).info.run_id
    for point in ("version", "alias", "card"):
        monkeypatch.setenv("ALIGNFLOW_FAULT", f"register:{point}")
        with pytest.raises(RegistrationFault, match=f"register: fault injected at {point}"):
            _register(client, exp, model, 0.90, run_id=better)
        assert _aliases(client) == {CHAMPION: out["version"], CANDIDATE: out["version"]}, point
        assert _versions(client) == {out["version"]: (first, "done")}, f"{point}: the failed run's version is gone"

    monkeypatch.delenv("ALIGNFLOW_FAULT")
    _, again = _register(client, exp, model, 0.90, run_id=better)  # the retry: registered afresh, promoted
    assert again["promoted"] and _aliases(client)[CHAMPION] == again["version"]
    assert sorted(run for run, _ in _versions(client).values()) == sorted([first, better])
    assert all(state == "done" for _, state in _versions(client).values())

    monkeypatch.setenv("ALIGNFLOW_FAULT", "register:card")  # a first registration: its registered model goes too
    with pytest.raises(RegistrationFault):
        _register(client, exp, model, 0.5, name="fresh")
    assert client.search_registered_models("name='fresh'") == []


def test_a_rollback_leaves_an_alias_a_concurrent_flow_moved(store, monkeypatch):
    """Compare-and-set on the way back too: the champion moved to another flow's version after ours took it is not
    set back to the old champion."""
    from tasks import registry

    client, exp, model = store
    _, old = _register(client, exp, model, 0.50)
    other, theirs = _register(client, exp, model, 0.40)  # candidate only
    real_move = registry.move_aliases

    def move_then_lose_the_title(client_, name, version, *args):
        outcome = real_move(client_, name, version, *args)
        client_.set_registered_model_alias(name, CHAMPION, theirs["version"])  # a concurrent flow's promotion
        return outcome

    monkeypatch.setattr(registry, "move_aliases", move_then_lose_the_title)
    monkeypatch.setenv("ALIGNFLOW_FAULT", "register:alias")
    with pytest.raises(RegistrationFault):
        _register(client, exp, model, 0.90)
    aliases = _aliases(client)
    assert aliases[CHAMPION] == theirs["version"], "the concurrent flow's champion is left to it"
    assert aliases[CANDIDATE] == theirs["version"], "our candidate alias went back to the one before"
    assert set(_versions(client)) == {old["version"], theirs["version"]}


@pytest.mark.usefixtures("prefect_server")
def test_the_prefect_retry_after_a_rollback_registers_once(store, monkeypatch, tmp_path):
    """The task inside a flow: its first attempt fails after the alias moved and is rolled back; Prefect's retry
    (register-model retries once) registers the version, which ends champion; one version of the run exists."""
    from prefect import flow

    client, exp, model = store
    _, old = _register(client, exp, model, 0.50)
    monkeypatch.setenv("ALIGNFLOW_FAULT", f"register:alias:{tmp_path / 'fired'}")
    run_id = client.create_run(exp).info.run_id

    @flow
    def promote() -> dict:
        return register_model.with_options(retry_delay_seconds=0)(
            model_dir=str(model), run_id=run_id, accuracy=0.9, registered_name="policy",
            tracking={"experiment": EXPERIMENT, "model_storage": "reference"})

    out = promote()
    assert (tmp_path / "fired").exists(), "the first attempt failed at the alias move"
    assert out["promoted"] and _aliases(client)[CHAMPION] == out["version"]
    runs = [run for run, _ in _versions(client).values()]
    assert runs.count(run_id) == 1 and out["version"] != old["version"]
