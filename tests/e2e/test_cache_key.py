"""The cache key covers the training core: edit a trainer in ``rlhf_core/`` and its cached stage reruns.

A fresh copy of the project runs ``alignflow flow align`` (data, base model, SFT; no alignment
stages) three times, each a new process importing the copy's own code (``PYTHONPATH``) and
reporting to one Prefect server: the second run takes SFT from Prefect's cache; after a comment
is appended to the copy's ``rlhf_core/trainers/sft.py``, the third run trains SFT again.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys

import pytest
import yaml

from helpers import cli_env, copy_project


def _task_states(api: str, flow_run_id: str) -> dict[str, str]:
    """{task run name: state name} of one flow run on the Prefect server at ``api``."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId
    from prefect.settings import PREFECT_API_URL, temporary_settings

    async def fetch() -> dict[str, str]:
        async with get_client() as client:
            runs = await client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id])))
        return {r.name: r.state.name for r in runs}

    with temporary_settings({PREFECT_API_URL: api}):
        return asyncio.run(fetch())


def _run_align(project, api: str) -> dict[str, str]:
    """``alignflow flow align`` in ``project`` with the copy's code; returns its task states."""
    env = {**cli_env(project), "PYTHONPATH": str(project), "PREFECT_API_URL": api,
           "PREFECT_HOME": str(project / ".prefect"), "OMP_WAIT_POLICY": "PASSIVE"}
    proc = subprocess.run([sys.executable, "-m", "flows.cli", "flow", "align"], cwd=project, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    from mlflow.tracking import MlflowClient

    parent = json.loads((project / "metrics/align_summary.json").read_text())["parent_run_id"]
    tags = MlflowClient(tracking_uri=f"sqlite:///{project / 'mlflow.db'}").get_run(parent).data.tags
    return _task_states(api, tags["prefect.flow_run_id"])


def _sft_state(states: dict[str, str]) -> str:
    (name,) = [n for n in states if n.startswith("train-sft")]
    return states[name]


@pytest.mark.slow  # two flow runs of a stage (about 50 s); the default tier keeps test_flow's cache check
def test_editing_core_source_reruns_the_cached_stage(tmp_path, prefect_api):
    project = copy_project(tmp_path / "proj")
    params = yaml.safe_load((project / "params.yaml").read_text())
    params["flow"]["stages"] = []  # SFT is the one training stage the check needs
    params["tracking"]["log_model"] = False
    (project / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))

    assert _sft_state(_run_align(project, prefect_api)) == "Completed"
    again = _run_align(project, prefect_api)  # a new process: the key is stable across processes
    assert _sft_state(again) == "Cached", again
    assert {name for name, state in again.items() if state != "Cached"} == {
        "validate-sft", "validate-preferences", "validate-prompts", "validate-eval"}  # never cached

    with (project / "rlhf_core/trainers/sft.py").open("a") as f:
        f.write("\n# an edit to the trainer: cached SFT results no longer apply\n")
    edited = _run_align(project, prefect_api)
    assert _sft_state(edited) == "Completed", edited
    assert "Cached" not in edited.values(), edited  # every task's key covers the core
