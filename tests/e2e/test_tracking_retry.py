"""Tracking lost after the final save: the retry reuses the saved model, registers it once, then clears.

Real Prefect (test server) running the production ``train-sft`` task with its retry policy, real
MLflow (sqlite store, the transformers flavor, the model registry). The failure is the stage's fault
hook ``ALIGNFLOW_FAULT=sft:tracking:<marker>``: it fires once, in ``rlhf_core.stages.wrappers._train_stage``
after the model is saved and before it is logged and registered, where a tracking server that went
away would fail the stage. (A real server stopped at exactly that point would need the stage to wait
for the test; tests/e2e/test_mlflow_outage.py stops one mid-stage.)
"""

from __future__ import annotations

import logging

import pytest

from rlhf_core.config import SFTConfig, TrackingConfig, config_to_dict
from rlhf_core.tracking.lineage import dvc_md5

pytestmark = pytest.mark.usefixtures("prefect_server")

MAX_STEPS = 8


class _Lines(logging.Handler):
    """Keeps every formatted message a logger emits."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def test_a_retry_after_the_final_save_reuses_the_model_and_registers_it_once(isolated_project, micro_model,
                                                                              micro_data, monkeypatch):
    """``train-sft`` under a parent run; attempt 1 trains 8 steps, saves the model, then loses tracking
    before registration. Attempt 2 (Prefect's retry) trains nothing: it warns that it reuses the finished
    output, the model files are the ones attempt 1 wrote (older than the fault), and no resume happened.
    MLflow then holds one stage run, FINISHED, attempt tag 2, whose train/loss history has exactly one
    point per step 1..8 and whose eval ran once; exactly one model version, from that run; and the
    stage cleared its checkpoints and finished record at the end."""
    from mlflow.tracking import MlflowClient
    from prefect import flow

    from rlhf_core.tracking.mlflow_runs import start_run
    from tasks.training import train_sft

    project = isolated_project
    ckpt = project / "checkpoints" / "sft"
    params = config_to_dict(SFTConfig(
        model_path=str(micro_model), train_file=str(micro_data["sft"]), eval_file=str(micro_data["eval"]),
        output_dir=str(project / "models" / "sft"), checkpoint_dir=str(ckpt), max_steps=MAX_STEPS, batch_size=16,
        lr=3e-3, warmup_steps=1, eval_every=0, eval_items=16, save_every=4, log_every=1, num_threads=1))
    tracking = {"experiment": "tracking-retry", "log_model": True, "registered_model": "tracking-retry-sft"}
    marker = project / "tracking-fault-fired"
    monkeypatch.setenv("ALIGNFLOW_FAULT", f"sft:tracking:{marker}")

    @flow(name="one-sft-stage-that-loses-tracking")
    def one_stage() -> str:
        with start_run(TrackingConfig(**tracking), "parent") as parent:
            train_sft(params, tracking, input_md5={"sft_train": dvc_md5(micro_data["sft"])},
                      parent_run_id=parent.run_id)
            return parent.run_id

    # Prefect's logging setup keeps rlhf_core's records from pytest's caplog: listen on the logger itself
    seen = _Lines()
    loop_log = logging.getLogger("rlhf_core.trainers.loop")
    loop_log.addHandler(seen)
    try:
        parent_id = one_stage()
    finally:
        loop_log.removeHandler(seen)
    assert marker.exists(), "the fault fired on the first attempt"
    [reused] = [line for line in seen.lines if "reusing the finished output" in line]
    assert reused.startswith(f"sft: reusing the finished output of this run, {project / 'models' / 'sft'} "
                             f"(saved after step {MAX_STEPS};"), reused
    assert not [line for line in seen.lines if "resuming from" in line], seen.lines
    weights = project / "models" / "sft" / "model.safetensors"
    assert weights.stat().st_mtime_ns < marker.stat().st_mtime_ns, "the retry rewrote the model"

    client = MlflowClient(tracking_uri=f"sqlite:///{project / 'mlflow.db'}")
    exp = client.get_experiment_by_name("tracking-retry")
    [run] = client.search_runs([exp.experiment_id], filter_string=f"tags.mlflow.parentRunId = '{parent_id}'")
    assert run.info.status == "FINISHED" and run.data.tags["alignflow.attempt"] == "2", run.data.tags
    history = {key: [m.step for m in client.get_metric_history(run.info.run_id, key)] for key in run.data.metrics}
    assert history["train/loss"] == list(range(1, MAX_STEPS + 1)), history["train/loss"]
    assert history["eval/accuracy"] == [MAX_STEPS] and "checkpoint/resumed_from_step" not in history
    assert run.data.tags["dvc.md5.output_model"] == dvc_md5(project / "models" / "sft")

    versions = client.search_model_versions("name='tracking-retry-sft'")
    assert [(str(v.version), v.run_id) for v in versions] == [("1", run.info.run_id)], versions
    assert not list(ckpt.glob("step-*")) and not (ckpt / "finished.json").exists()


def test_registering_a_runs_model_twice_keeps_one_version(isolated_project, micro_model):
    """``log_hf_model`` called again on the same run (what a retried stage does when its first attempt
    registered and then failed) returns the first version's URI and logs nothing; the run stays RUNNING
    until its stage closes it."""
    from mlflow.tracking import MlflowClient

    from rlhf_core.tracking.mlflow_runs import start_run

    cfg = TrackingConfig(experiment="register-twice", registered_model="register-twice")
    with start_run(cfg, "stage") as run:
        first = run.log_hf_model(micro_model, "register-twice")
        client = MlflowClient(tracking_uri=f"sqlite:///{isolated_project / 'mlflow.db'}")
        assert client.get_run(run.run_id).info.status == "RUNNING"
        assert run.log_hf_model(micro_model, "register-twice") == first
    versions = client.search_model_versions("name='register-twice'")
    assert [(str(v.version), v.run_id) for v in versions] == [("1", run.run_id)]
    assert client.get_run(run.run_id).info.status == "FINISHED"
