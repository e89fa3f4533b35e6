"""A training task that fails mid-run is retried by Prefect and continues from its checkpoint.

Real Prefect (test server), the real ``train-dpo`` task with its production retry policy, real
MLflow (sqlite). The failure is the loop's fault hook with a marker file, so it fires on the first
attempt only; the retry must resume at the checkpointed step and end bit-identical to a run that
never failed.
"""

from __future__ import annotations

import asyncio

import pytest

from rlhf_core.config import DPOConfig, config_to_dict
from rlhf_core.tracking.lineage import dvc_md5
from rlhf_core.trainers.dpo import train_dpo as train_dpo_directly

pytestmark = pytest.mark.usefixtures("prefect_server")


def _states(flow_run_id: str) -> tuple[list[str], int]:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    async def fetch():
        async with get_client() as client:
            [task_run] = await client.read_task_runs(
                flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id])))
            states = await client.read_task_run_states(task_run.id)
            return [s.name for s in sorted(states, key=lambda s: s.timestamp)], task_run.run_count

    return asyncio.run(fetch())


def test_failed_dpo_task_resumes_on_retry(isolated_project, micro_model, micro_data, monkeypatch):
    from mlflow.tracking import MlflowClient
    from prefect import flow

    from tasks.training import train_dpo

    project = isolated_project
    params = config_to_dict(DPOConfig(
        model_path=str(micro_model), train_file=str(micro_data["preferences"]), eval_file=str(micro_data["eval"]),
        output_dir=str(project / "models" / "dpo"), checkpoint_dir=str(project / "checkpoints" / "dpo"),
        max_steps=12, batch_size=8, lr=3e-3, warmup_steps=2, eval_items=20, save_every=4, beta=0.5, num_threads=1))
    tracking = {"experiment": "retry-test", "log_model": False}
    marker = project / "fault-fired"
    monkeypatch.setenv("ALIGNFLOW_FAULT", f"dpo:10:{marker}")

    @flow(name="one-dpo-stage")
    def one_stage() -> dict:
        return train_dpo(params, tracking, input_md5={"preferences": dvc_md5(micro_data["preferences"])})

    state = one_stage(return_state=True)
    assert state.is_completed(), state
    assert marker.exists(), "the fault fired on the first attempt"
    names, run_count = _states(str(state.state_details.flow_run_id))
    assert run_count == 2 and "AwaitingRetry" in names and names[-1] == "Completed", names

    # MLflow: the failed attempt and the resumed one, which started at the step-8 checkpoint
    client = MlflowClient(tracking_uri=f"sqlite:///{project / 'mlflow.db'}")
    exp = client.get_experiment_by_name("retry-test")
    runs = sorted(client.search_runs([exp.experiment_id]), key=lambda r: r.info.start_time)
    assert [r.info.status for r in runs] == ["FAILED", "FINISHED"]
    resumed = client.get_metric_history(runs[1].info.run_id, "checkpoint/resumed_from_step")
    assert [m.value for m in resumed] == [8.0]
    steps_logged = {m.step for m in client.get_metric_history(runs[1].info.run_id, "train/loss")}
    assert min(steps_logged) > 8, "the retry did not redo finished steps"

    # no progress lost: the same weights as a run that never failed
    monkeypatch.delenv("ALIGNFLOW_FAULT")
    whole = train_dpo_directly(DPOConfig(**{**params, "output_dir": str(project / "whole"),
                                            "checkpoint_dir": str(project / "whole-ckpt")}), show_progress=False)
    assert dvc_md5(whole.output_dir / "model.safetensors") == dvc_md5(project / "models" / "dpo" / "model.safetensors")
    assert not list((project / "checkpoints" / "dpo").glob("step-*"))


def test_killed_training_process_is_retried_and_resumes(isolated_project, micro_model, micro_data):
    """isolation=process: the train-dpo task's child process is SIGKILLed after its second
    checkpoint; Prefect retries the task, the new child resumes at that checkpoint's step, and the
    weights equal those of a run that was never killed."""
    import os
    import signal
    import threading
    import time

    from mlflow.tracking import MlflowClient
    from prefect import flow

    from tasks.training import train_dpo
    from tasks.worker import pid_file

    project = isolated_project
    ckpt_dir = project / "checkpoints" / "dpo"
    params = config_to_dict(DPOConfig(
        model_path=str(micro_model), train_file=str(micro_data["preferences"]), eval_file=str(micro_data["eval"]),
        output_dir=str(project / "models" / "dpo"), checkpoint_dir=str(ckpt_dir), max_steps=60, batch_size=8,
        lr=3e-3, warmup_steps=2, eval_items=20, save_every=5, beta=0.5, num_threads=1))
    killed: dict[str, object] = {}

    def kill_after_two_checkpoints() -> None:
        deadline = time.time() + 300
        while time.time() < deadline:
            steps = sorted(ckpt_dir.glob("step-*"))
            if len(steps) >= 2 and pid_file("dpo").exists():
                killed["pid"] = int(pid_file("dpo").read_text())
                killed["checkpoints"] = [p.name for p in steps]
                os.kill(killed["pid"], signal.SIGKILL)
                return
            time.sleep(0.02)

    watcher = threading.Thread(target=kill_after_two_checkpoints, daemon=True)
    watcher.start()

    @flow(name="one-dpo-stage-in-a-process")
    def one_stage() -> dict:
        return train_dpo(params, {"experiment": "kill-test", "log_model": False},
                         input_md5={"preferences": dvc_md5(micro_data["preferences"])}, isolation="process")

    state = one_stage(return_state=True)
    watcher.join(timeout=5)
    assert "pid" in killed, "the watcher never saw two checkpoints"
    assert state.is_completed(), state
    names, run_count = _states(str(state.state_details.flow_run_id))
    assert run_count == 2 and "AwaitingRetry" in names and names[-1] == "Completed", names

    client = MlflowClient(tracking_uri=f"sqlite:///{project / 'mlflow.db'}")
    exp = client.get_experiment_by_name("kill-test")
    runs = sorted(client.search_runs([exp.experiment_id]), key=lambda r: r.info.start_time)
    assert len(runs) == 2 and runs[-1].info.status == "FINISHED"
    resumed = [m.value for m in client.get_metric_history(runs[-1].info.run_id, "checkpoint/resumed_from_step")]
    newest_seen = max(int(name.split("-")[1]) for name in killed["checkpoints"])
    # the newest complete checkpoint when the kill landed: the one seen, or one written in between
    assert len(resumed) == 1 and resumed[0] >= newest_seen > 0 and resumed[0] % 5 == 0, (resumed, killed)
    print(f"killed pid {killed['pid']} with checkpoints {killed['checkpoints']}; the retry resumed at step "
          f"{int(resumed[0])}")

    whole = train_dpo_directly(DPOConfig(**{**params, "output_dir": str(project / "whole"),
                                            "checkpoint_dir": str(project / "whole-ckpt")}), show_progress=False)
    assert dvc_md5(whole.output_dir / "model.safetensors") == dvc_md5(project / "models" / "dpo" / "model.safetensors")
