"""The run dashboard of the embedded GRPO run (``alignflow flow align``, micro sizes, the RL stage only), opened
from its MLflow artifact in a real headless Chromium (tests/e2e/ui.py) with nothing but the file: every panel is
there, the metric cells equal what the run logged, and clicking a sample shows its per-token log-probs. The model
card of the registered version and ``alignflow diff`` link the page."""

from __future__ import annotations

import json

import yaml

from helpers import copy_project, run_cli
from ui import browser_page

PANELS = ["panel-metrics", "panel-timeline", "panel-staleness", "panel-distributions", "panel-mismatch",
          "panel-samples"]


def _run_rl_flow(tmp_path, monkeypatch):
    """The align flow with GRPO as its one alignment stage, 3 iterations of 2 mini-batches; its project and MLflow
    client."""
    from mlflow.tracking import MlflowClient

    project = copy_project(tmp_path / "proj")
    params = yaml.safe_load((project / "params.yaml").read_text())
    params["flow"]["stages"] = ["rl"]
    params["rl"]["max_steps"] = 3
    # two mini-batches a batch, as the embedded default has: pi_old (the trainer's log-probs) is recomputed
    params["rl"]["algorithm"]["mini_batch_size"] = 8
    (project / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    # the flow's temporary Prefect server: 20 s to start is short on a loaded 2-core machine
    monkeypatch.setenv("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "120")
    proc = run_cli(["flow", "align"], project)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    uri = f"sqlite:///{project / 'mlflow.db'}"
    return project, MlflowClient(tracking_uri=uri, registry_uri=uri)


def _stage_run(client, name: str):
    (run,) = [r for e in client.search_experiments() for r in client.search_runs([e.experiment_id])
              if r.info.run_name == name]
    return run


def test_grpo_dashboard_opens_offline_and_drills_into_a_sample(tmp_path, chromium, monkeypatch):
    project, client = _run_rl_flow(tmp_path, monkeypatch)
    rl = _stage_run(client, "rl")
    assert rl.data.tags["alignflow.dashboard"] == "dashboard.html"
    page_file = client.download_artifacts(rl.info.run_id, "dashboard.html", str(tmp_path))
    size = (tmp_path / "dashboard.html").stat().st_size
    print(f"dashboard of the micro GRPO run (3 steps): {size} bytes")
    assert size < 5 * 2**20

    logged = {name: {m.step: m.value for m in client.get_metric_history(rl.info.run_id, name)}
              for name in ("rollout/reward_mean", "train/kl", "train/entropy", "rollout/logprob_mismatch")}
    with browser_page(chromium) as page:
        page.goto(f"file://{page_file}")
        assert page.evaluate("document.body.getAttribute('data-ready')") == "1"
        assert page.evaluate("[...document.querySelectorAll('section')].map(s => s.id)") == PANELS
        cells = page.evaluate("Object.fromEntries([...document.querySelectorAll('td[data-metric]')]"
                              ".map(td => [td.dataset.step + ' ' + td.dataset.metric, td.textContent]))")
        for name, series in logged.items():
            assert sorted(series) == [1, 2, 3]
            for step, value in series.items():
                assert float(cells[f"{step} {name}"]) == value, (name, step)
        phases = set(page.evaluate("[...document.querySelectorAll('#timeline-svg rect.phase')]"
                                   ".map(r => r.dataset.phase)"))
        assert {"rollout", "reward", "log-probs", "update"} <= phases
        assert page.evaluate("document.querySelectorAll('#staleness-table td[data-staleness=\"0\"]').length") == 3
        assert page.evaluate("document.querySelectorAll('.dist svg polygon').length") == 8  # 2 bands x 4 quantities
        assert page.evaluate("document.querySelectorAll('#panel-mismatch svg polyline').length") == 2

        assert page.evaluate("document.querySelectorAll('#sample-detail .token-row').length") == 0
        page.click('button.sample[data-step="3"]')
        detail = page.evaluate("document.getElementById('sample-detail').innerText")
        assert detail.startswith("step 3, sample ")
        rows = page.evaluate("[...document.querySelectorAll('#sample-detail .token-row')]"
                             ".map(r => [...r.children].map(td => td.textContent))")
        assert rows and all(float(engine) < 0 and float(trainer) < 0 for _, engine, trainer, _ in rows)
        assert page.evaluate("document.querySelector('#sample-detail pre.prompt').textContent")
        assert all(url.startswith(("file:", "data:")) for url in page.requested()), page.requested()

    (version,) = client.search_model_versions(f"run_id = '{rl.info.run_id}'")
    assert f"runs:/{rl.info.run_id}/dashboard.html" in client.get_model_version(version.name,
                                                                                version.version).description
    sft = _stage_run(client, "sft")
    diff = run_cli(["diff", sft.info.run_id, rl.info.run_id], project)
    assert diff.returncode == 0, diff.stderr
    assert f"run dashboard: runs:/{rl.info.run_id}/dashboard.html" in diff.stdout
    flow_run = json.loads((project / "metrics/align_summary.json").read_text())["parent_run_id"]
    flow_diff = run_cli(["diff", flow_run, rl.info.run_id, "--json"], project)
    assert json.loads(flow_diff.stdout)["a"]["dashboards"] == [f"runs:/{rl.info.run_id}/dashboard.html"]
