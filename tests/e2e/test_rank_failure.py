"""A data-parallel rank SIGKILLed mid-run: the stage fails within 60 s, Prefect retries, the retry resumes.

Real Prefect (test server) running the production training task with its retry policy, real Ray
(a local instance, two ranks over gloo on the CPU), real DeepSpeed ZeRO-2 on its CPU accelerator,
real MLflow (sqlite). Rank 1's worker process SIGKILLs itself right after the step-4 checkpoint
(``ALIGNFLOW_FAULT`` with ``ALIGNFLOW_FAULT_RANK=1 ALIGNFLOW_FAULT_SIGNAL=KILL``; no handler runs), while
rank 0 goes on into the next step's collective and waits for a peer that is gone. The launcher
must notice the dead actor, kill the survivor and fail the task; the retry must start from the
step-4 checkpoint and end with the weights of a run nobody killed (fp32: the same md5), having
loaded the optimizer state that run had at step 4.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import threading
import time
from pathlib import Path

import pytest
import torch

from rlhf_core.config import RLConfig, SFTConfig, build_config, config_to_dict
from rlhf_core.tracking.lineage import dvc_md5

pytestmark = pytest.mark.usefixtures("prefect_server")

_FAIL_WITHIN_S = 60.0


@pytest.fixture
def ray_session():
    """Ray started by the task itself (as in production) is stopped after the test."""
    import ray

    saved = os.environ.pop("RAY_ADDRESS", None)
    yield
    ray.shutdown()
    if saved is not None:
        os.environ["RAY_ADDRESS"] = saved


def _task_states(flow_run_id: str) -> list:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    async def fetch():
        async with get_client() as client:
            [task_run] = await client.read_task_runs(
                flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id])))
            return sorted(await client.read_task_run_states(task_run.id), key=lambda s: s.timestamp)

    return asyncio.run(fetch())


def _keep_a_copy(src: Path, dst: Path, marker: Path, stop: threading.Event) -> None:
    """Copy the checkpoint the retry will resume from as soon as the rank is dead (the stage removes
    its checkpoints once it succeeds)."""
    while not stop.is_set():
        if marker.exists() and src.is_dir():
            shutil.copytree(src, dst)
            return
        time.sleep(0.05)


def _run_killed(task_fn, params: dict, input_md5: dict, project: Path, fault: str, monkeypatch):
    """Run ``task_fn`` in a flow with rank 1 SIGKILLed at ``fault``; returns (flow state, copied checkpoint,
    seconds from the kill to the task's failed attempt)."""
    from prefect import flow

    marker = project / "rank-1-killed"
    monkeypatch.setenv("ALIGNFLOW_FAULT", f"{fault}:{marker}")
    monkeypatch.setenv("ALIGNFLOW_FAULT_RANK", "1")
    monkeypatch.setenv("ALIGNFLOW_FAULT_SIGNAL", "KILL")
    copy, stop = project / "resumed-from", threading.Event()
    watcher = threading.Thread(target=_keep_a_copy, args=(Path(params["checkpoint_dir"]) / "step-0000004", copy,
                                                           marker, stop), daemon=True)
    watcher.start()

    @flow(name="one-stage-with-a-dying-rank")
    def one_stage() -> dict:
        return task_fn(params, {"experiment": "rank-failure", "log_model": False}, input_md5=input_md5)

    state = one_stage(return_state=True)
    stop.set()
    watcher.join(timeout=30)
    for key in ("ALIGNFLOW_FAULT", "ALIGNFLOW_FAULT_RANK", "ALIGNFLOW_FAULT_SIGNAL"):
        monkeypatch.delenv(key)
    assert marker.exists(), "rank 1 never reached the fault"
    assert state.is_completed(), state
    states = _task_states(str(state.state_details.flow_run_id))
    failed_at = next(s.timestamp for s in states if s.name == "AwaitingRetry")
    took = failed_at.timestamp() - marker.stat().st_mtime
    print(f"task states {[s.name for s in states]}; rank 1 killed -> attempt failed in {took:.1f} s")
    assert [s.name for s in states].count("AwaitingRetry") == 1 and states[-1].name == "Completed"
    assert 0 < took <= _FAIL_WITHIN_S, took
    return state, copy


def _resumed_from(project: Path) -> list[float]:
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{project / 'mlflow.db'}")
    exp = client.get_experiment_by_name("rank-failure")
    runs = client.search_runs([exp.experiment_id])
    return [m.value for r in runs for m in client.get_metric_history(r.info.run_id, "checkpoint/resumed_from_step")]


def _same_optimizer_state(a: Path, b: Path) -> None:
    sa = torch.load(a / "trainer_state.pt", weights_only=True)["optimizer"]
    sb = torch.load(b / "trainer_state.pt", weights_only=True)["optimizer"]
    assert sa["exp_avg"] and sa["lr"] == sb["lr"]
    for key in ("step", "exp_avg", "exp_avg_sq"):
        assert sa[key].keys() == sb[key].keys() and all(torch.equal(sa[key][n], sb[key][n]) for n in sa[key]), key


def _sft_params(micro_model, micro_data, project: Path, name: str, parallel: str) -> dict:
    return config_to_dict(SFTConfig(
        model_path=str(micro_model), train_file=str(micro_data["sft"]), eval_file=str(micro_data["eval"]),
        output_dir=str(project / name / "model"), checkpoint_dir=str(project / name / "ckpt"), max_steps=8,
        batch_size=8, grad_accum=2, lr=3e-3, warmup_steps=1, eval_items=4, num_threads=1, precision="fp32",
        save_every=2, keep_checkpoints=10, num_workers=2, parallel=parallel))


# DDP in the default tier (30 s); ZeRO-2 (60 s: DeepSpeed's CPU op build) in the slow tier, to keep make test
# within its 20 minutes (test_precision_tiny's two-rank ZeRO-2 resume runs DeepSpeed in the default tier).
@pytest.mark.parametrize("parallel", ["ddp", pytest.param("zero2", marks=pytest.mark.slow)])
def test_killed_sft_rank_fails_fast_and_the_retry_resumes_exactly(isolated_project, micro_model, micro_data,
                                                                  monkeypatch, ray_session, parallel):
    from rlhf_core.trainers.ray_launcher import train_data_parallel
    from rlhf_core.trainers.sft import train_sft as train_sft_directly
    from tasks.training import train_sft

    project = isolated_project
    params = _sft_params(micro_model, micro_data, project, "killed", parallel)
    _, resumed_from = _run_killed(train_sft, params, {"sft": dvc_md5(micro_data["sft"])}, project, "sft:4",
                                  monkeypatch)
    assert _resumed_from(project) == [4.0]
    assert not list(Path(params["checkpoint_dir"]).glob("step-*")), "the finished stage removes its checkpoints"

    whole = train_data_parallel(train_sft_directly, SFTConfig(**_sft_params(micro_model, micro_data, project,
                                                                           "whole", parallel)), show_progress=False)
    assert dvc_md5(whole.output_dir / "model.safetensors") == dvc_md5(Path(params["output_dir"]) / "model.safetensors")
    _same_optimizer_state(resumed_from, project / "whole" / "ckpt" / "step-0000004")


@pytest.mark.slow
def test_killed_grpo_learner_rank_fails_fast_and_the_retry_resumes_exactly(isolated_project, micro_model, micro_data,
                                                                           monkeypatch, ray_session):
    """GRPO on Ray (colocated, 2 policy ranks under ZeRO-2): learner rank 1 dies as iteration 5 updates."""
    from rlhf_core.trainers.rl_on_ray import train_rl_on_ray
    from tasks.training import train_rl

    project = isolated_project
    reward = project / "length_reward.py"
    reward.write_text("def reward(prompts, completions, labels):\n    return [len(c) / 10 for c in completions]\n")

    def params(name: str) -> dict:
        return config_to_dict(build_config(RLConfig, "rl", {"model_path": str(micro_model),
                                                            "prompts_file": str(micro_data["prompts"]),
                                                            "eval_file": str(micro_data["eval"]),
                                                            "output_dir": str(project / name / "model"),
                                                            "checkpoint_dir": str(project / name / "ckpt"),
                                                            "reward.function": f"{reward}:reward", "max_steps": 6,
                                                            "rollout.prompts_per_step": 4, "rollout.group_size": 4,
                                                            "rollout.max_new_tokens": 6, "batch_size": 64,
                                                            "algorithm.mini_batch_size": 8, "lr": 3e-3,
                                                            "warmup_steps": 0, "eval_items": 4,
                                                            "eval_at_start": False, "num_threads": 1,
                                                            "precision": "fp32", "save_every": 2,
                                                            "keep_checkpoints": 10, "log_rollouts_every": 0,
                                                            "distribution.placement": "colocated", "num_workers": 2,
                                                            "parallel": "zero2"}))

    killed = params("killed")
    _, resumed_from = _run_killed(train_rl, killed, {"prompts": dvc_md5(micro_data["prompts"])}, project,
                                  "rl-learner:5", monkeypatch)
    assert _resumed_from(project) == [4.0]
    whole = train_rl_on_ray(build_config(RLConfig, "rl", {**params("whole")}), show_progress=False)
    assert dvc_md5(whole.output_dir / "model.safetensors") == dvc_md5(Path(killed["output_dir"]) / "model.safetensors")
    _same_optimizer_state(resumed_from, project / "whole" / "ckpt" / "step-0000004")
