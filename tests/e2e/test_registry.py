"""The model registry for real: models stored by copy or by reference, retention of old versions,
and champion promotion raced by two OS processes against one MLflow store.

Everything is real: an MLflow sqlite store (and, in the slow tier, an ``mlflow server`` over
HTTP), the micro model's folder, DVC md5s, separate processes started with ``spawn``.
"""

from __future__ import annotations

import multiprocessing
import shutil
import signal
from pathlib import Path

import pytest

from helpers import free_port, registry_store, start_mlflow_server, stop_group
from registry_racer import race
from rlhf_core.config import TrackingConfig
from rlhf_core.tracking.lineage import dvc_md5
from rlhf_core.tracking.mlflow_runs import REGISTRATION_TAG, STORAGE_TAG, start_run
from tasks.registry import CANDIDATE, CHAMPION, METRIC_TAG, ModelRefChanged, register_model, resolve_model_ref

EXPERIMENT = "registry-test"


def _bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


@pytest.fixture()
def store(isolated_project, micro_model):
    """(client, experiment id, the project's own copy of the micro model)."""
    return registry_store(isolated_project, micro_model, EXPERIMENT)


def _register(client, exp, model, accuracy, name="policy", **tracking):
    run_id = client.create_run(exp).info.run_id
    return register_model.fn(model_dir=str(model), run_id=run_id, accuracy=accuracy, registered_name=name,
                             tracking={"experiment": EXPERIMENT, **tracking})


def test_reference_storage_records_path_and_md5_and_copies_no_weights(store, isolated_project):
    client, exp, model = store
    artifacts = isolated_project / "mlartifacts"
    out = _register(client, exp, model, 0.5, model_storage="reference")

    version = client.get_model_version("policy", out["version"])
    assert version.tags[STORAGE_TAG] == "reference" and version.tags[REGISTRATION_TAG] == "done"
    assert version.tags["dvc.md5"] == dvc_md5(model) and version.tags["alignflow.model_path"] == str(model)
    assert not list(artifacts.rglob("*.safetensors")) and _bytes(artifacts) < 4096  # a pointer, not weights
    assert resolve_model_ref(client, "policy", CHAMPION) == model

    # The stage path (rlhf_core.stages.wrappers): start_run's tracker, md5 from the run's dvc.md5.output_model tag.
    with start_run(TrackingConfig(experiment=EXPERIMENT, model_storage="reference"), "sft") as run:
        run.set_tags({"dvc.md5.output_model": dvc_md5(model)})
        run.log_hf_model(model, "alignflow-sft")
    (sft,) = client.search_model_versions("name='alignflow-sft'")
    assert sft.tags["dvc.md5"] == dvc_md5(model) and resolve_model_ref(client, "alignflow-sft", "1") == model

    # The folder is overwritten (the next flow run's cycle_1): following the reference says so.
    (model / "config.json").write_text((model / "config.json").read_text() + " ")
    with pytest.raises(ModelRefChanged, match=r"policy v1 was registered by reference to .* that folder now "
                                              r"holds DVC md5"):
        resolve_model_ref(client, "policy", CHAMPION)


def test_copy_storage_and_retention_keep_newest_and_aliased_versions(store, isolated_project):
    """keep_model_versions=2 over six registrations by copy (accuracies 0.5 0.7 0.6 0.4 0.3, and a
    sixth left ``pending`` as a concurrent flow's would be): kept are the 2 newest, the champion (v2)
    and the pending one; v1 and v3 go, with the weights they copied."""
    client, exp, model = store
    artifacts = isolated_project / "mlartifacts"
    weights = (model / "model.safetensors").stat().st_size
    for accuracy in (0.5, 0.7, 0.6):
        _register(client, exp, model, accuracy)  # default: copy, keep all
    assert len(list(artifacts.rglob("*.safetensors"))) == 3 and _bytes(artifacts) > 3 * weights
    assert all(v.tags[STORAGE_TAG] == "copy" for v in client.search_model_versions("name='policy'"))

    from rlhf_core.tracking.mlflow_runs import MlflowTracker

    pending_run = client.create_run(exp).info.run_id  # registered, its promotion not yet done
    MlflowTracker(client, pending_run).log_hf_model(model, "policy", version_tags={REGISTRATION_TAG: "pending"},
                                                     prune=False)
    assert _register(client, exp, model, 0.4, keep_model_versions=2)["pruned_versions"] == ["3", "1"]
    out = _register(client, exp, model, 0.3, keep_model_versions=2)
    assert out["pruned_versions"] == []  # v2 champion, v4 pending, v5 and v6 the newest two

    left = {str(v.version) for v in client.search_model_versions("name='policy'")}
    assert left == {"2", "4", "5", "6"}
    aliases = client.get_registered_model("policy").aliases
    assert str(aliases[CHAMPION]) == "2" and str(aliases[CANDIDATE]) == "6"
    assert len(list(artifacts.rglob("*.safetensors"))) == 4  # the two pruned copies are gone from disk
    model_id = client.get_model_version("policy", "2").source.split("/")[-1]
    assert (artifacts / "models" / model_id / "artifacts" / "model" / "model.safetensors").exists()


def test_retention_of_references_never_touches_the_model_folder(store):
    client, exp, model = store
    before = dvc_md5(model)
    for accuracy in (0.5, 0.4, 0.3):
        out = _register(client, exp, model, accuracy, model_storage="reference", keep_model_versions=1)
    assert out["pruned_versions"] == ["2"]  # v1 champion, v3 candidate
    assert {str(v.version) for v in client.search_model_versions("name='policy'")} == {"1", "3"}
    assert dvc_md5(model) == before and resolve_model_ref(client, "policy", CHAMPION) == model


# --------------------------------------------------------------------------------------
# Two flows promoting at once
# --------------------------------------------------------------------------------------

ROUNDS = 8


def _race(client, exp, model, name, envs, tracking, rounds=ROUNDS):
    """Two spawned processes register one version each per round, started together by a barrier
    shared with this test; after each round the champion must be the round's better candidate (both
    beat the previous champion, the better one alternates between the processes). Returns how many
    rounds the two registrations overlapped in time (and prints how often both compared against the
    same champion: the race the guards must settle)."""
    plans: list[list[tuple[str, float]]] = [[], []]
    for r in range(rounds):
        low, high = round(0.10 + 0.05 * r, 4), round(0.12 + 0.05 * r, 4)
        for worker, accuracy in enumerate((high, low) if r % 2 == 0 else (low, high)):
            plans[worker].append((client.create_run(exp).info.run_id, accuracy))
    ctx = multiprocessing.get_context("spawn")
    barrier, results = ctx.Barrier(3), ctx.Queue()
    procs = [ctx.Process(target=race, args=(envs[w], str(model), name, plans[w], tracking, barrier, results))
             for w in range(2)]
    for proc in procs:
        proc.start()
    overlapped = same_read = 0
    try:
        for r in range(rounds):
            barrier.wait(timeout=300)  # start
            barrier.wait(timeout=300)  # both registered
            outs = [results.get(timeout=60) for _ in range(2)]
            assert all(isinstance(o[1], dict) for o in outs), [o[1] for o in outs]
            champion = client.get_model_version(name, str(client.get_registered_model(name).aliases[CHAMPION]))
            best = max(plans[0][r][1], plans[1][r][1])
            assert float(champion.tags[METRIC_TAG]) == pytest.approx(best), (r, [o[1]["verdict"] for o in outs])
            winner = next(o[1] for o in outs if o[1]["version"] == str(champion.version))
            assert winner["promoted"] and winner["verdict"].endswith("promoted to champion")
            for _, out, _, _ in outs:  # each verdict is recorded on its version as returned
                assert client.get_model_version(name, out["version"]).tags["promotion"] == out["verdict"]
            overlapped += min(o[3] for o in outs) > max(o[2] for o in outs)
            both_read = {o[1]["verdict"].split(": ")[0].split(" vs ")[-1] for o in outs}
            same_read += len(both_read) == 1  # both compared against the same champion: a real race
    except BaseException:
        barrier.abort()  # a failed round must not leave a worker waiting out its barrier timeout
        failures = []
        while not results.empty():
            failures += [item[1] for item in [results.get(timeout=5)] if isinstance(item[1], str)]
        if failures:
            raise AssertionError("a racing process failed:\n" + "\n".join(failures)) from None
        raise
    finally:
        for proc in procs:
            proc.join(timeout=60)
            if proc.is_alive():
                proc.kill()
    print(f"{rounds} rounds: registrations overlapped in {overlapped}, both read the same champion in {same_read}")
    return overlapped


def test_two_processes_on_one_host_promote_the_best_every_round(store, isolated_project):
    """The project lock: both processes use the project's sqlite store and so its registry lock.
    (On the code before the lock, this race set the worse model last in 2 of 8 rounds.)"""
    client, exp, model = store
    env = {"ALIGNFLOW_HOME": str(isolated_project), "MLFLOW_TRACKING_URI": f"sqlite:///{isolated_project / 'mlflow.db'}"}
    overlapped = _race(client, exp, model, "policy", [env, env], {"model_storage": "reference"})
    assert overlapped >= ROUNDS // 2  # they really ran at the same time
    assert (isolated_project / ".alignflow" / "registry.lock").exists()


@pytest.mark.slow
def test_two_hosts_on_one_server_promote_the_best_every_round(tmp_path, micro_model):
    """A shared ``mlflow server``: each process has its own project folder, so its own lock (as on two
    hosts); only the re-read after setting the alias (tracking.registry_settle_s) keeps the best."""
    from mlflow import MlflowClient

    port = free_port()
    # One server worker: the race under test is the clients' read-compare-set, and two workers writing one
    # sqlite file under load answer "database is locked" (500), which the clients then retry for minutes
    # (it hung a slow-tier run once); a production server sits on a database server instead.
    server = start_mlflow_server(tmp_path, port, store="server.db", artifacts="server-artifacts", workers=1)
    try:
        uri = f"http://127.0.0.1:{port}"
        client = MlflowClient(tracking_uri=uri)
        exp = client.create_experiment(EXPERIMENT)
        model = tmp_path / "shared" / "policy"  # one folder both "hosts" see (a shared file system)
        shutil.copytree(micro_model, model)
        envs = [{"ALIGNFLOW_HOME": str(tmp_path / f"host{w}"), "MLFLOW_TRACKING_URI": uri} for w in range(2)]
        overlapped = _race(client, exp, model, "policy", envs,
                           {"model_storage": "reference", "registry_settle_s": 0.5}, rounds=6)
        assert overlapped >= 3
        locks = {p.resolve() for p in tmp_path.glob("host*/.alignflow/registry.lock")}
        assert len(locks) == 2  # two locks, neither guarding the other "host"
    finally:
        stop_group(server, signal.SIGTERM, timeout=30)
