"""Issue 20, item 3: a cycle whose pairs near-duplicate heavily and hold eval prompts is stopped by
the data report before anything trains, naming file, line and field of each finding.

The flow runs for real (Prefect, MLflow, the gate and the data report); only the sampler is
replaced, by one that writes the cycle's pairs as a drifting policy might: Unicode and whitespace
variants of a few prompts, and prompts copied from the eval set (one changed only in case and
spacing, one long prompt sharing 13 words with a long eval prompt). One flow run holds both
faults (each is reported on its own), to keep the default tier's time down.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from rlhf_core.tracking.lineage import dvc_md5

pytestmark = pytest.mark.usefixtures("prefect_server")

LONG_EVAL = "please sort the following digits in ascending order and write only the digits with no spaces 4213="
"""A long eval prompt: 18 words, so a 13-word overlap test applies."""


@pytest.fixture()
def project(isolated_project, micro_model, micro_data):
    """Cycles from the micro model (rule scorer, no versioning); the eval set is the micro one plus
    :data:`LONG_EVAL`."""
    eval_file = isolated_project / "eval.jsonl"
    eval_file.write_text(micro_data["eval"].read_text() + json.dumps({"prompt": LONG_EVAL, "label": "1234"}) + "\n")
    params = {"cycles": {"start_model": str(micro_model), "scorer": "rule", "version": False, "cycles": 1},
              "rejection": {"prompts_file": str(micro_data["prompts"])},
              "dpo": {"eval_file": str(eval_file), "max_steps": 2, "batch_size": 8, "eval_items": 8, "num_threads": 1},
              "tracking": {"experiment": "data-report"}}
    (isolated_project / "params.yaml").write_text(yaml.safe_dump(params))
    return isolated_project


def _prompts(path, n):
    return [json.loads(line)["prompt"] for line in path.read_text().splitlines()[:n]]


FULLWIDTH = str.maketrans("0123456789", "０１２３４５６７８９")


def bad_pairs(micro_data):
    """30 pairs. Lines 1-10: distinct prompts, but line 3 is an eval prompt in other case and spacing, and
    line 7 shares 13 words with :data:`LONG_EVAL`. Lines 11-30: 5 more prompts, each 4 times (as is, a
    leading space, a trailing tab, fullwidth digits): no two rows equal, but 15 of 30 repeat an earlier
    row after NFKC and whitespace normalisation (rate 0.5)."""
    prompts = _prompts(micro_data["prompts"], 15)
    rows = [{"prompt": p, "chosen": "12", "rejected": "21"} for p in prompts[:10]]
    eval_prompt = _prompts(micro_data["eval"], 1)[0]
    rows[2]["prompt"] = "  " + eval_prompt.upper().replace(" ", "   ")
    rows[6]["prompt"] = "Now: " + " ".join(LONG_EVAL.split()[2:15]) + " 9876="
    for p in prompts[10:]:
        for variant in (p, " " + p, p + "\t", p.translate(FULLWIDTH)):
            rows.append({"prompt": variant, "chosen": "12", "rejected": "21"})
    return rows


EXPECTED = [
    ":3: field 'prompt': eval contamination: found in the eval set",
    ":7: field 'prompt': eval contamination: shares a 13-word sequence with a prompt of the eval set",
    ":12: field 'prompt': duplicate-prompt rate 0.500 is above data_report.max_duplicate_prompt_rate=0.25",
    (":12: field 'prompt+chosen+rejected': near-duplicate rate (rows equal to an earlier row after normalising "
     "case, Unicode and whitespace) 0.500 is above data_report.max_near_duplicate_rate=0.05"),
    "repeats='line 11'",
]


def test_a_cycle_with_near_duplicate_or_eval_prompts_in_its_pairs_stops_before_training(project, micro_data,
                                                                                         monkeypatch):
    from mlflow.tracking import MlflowClient

    from flows import cycles
    from rlhf_core.data.validate import ValidationFailed

    pairs = project / "data/cycles/iterative_dpo/pairs.jsonl"

    def sample(plan, k, *args, **kwargs):  # what sample_and_score returns, with these pairs
        pairs.parent.mkdir(parents=True, exist_ok=True)
        pairs.write_text("".join(json.dumps(r) + "\n" for r in bad_pairs(micro_data)))
        kept = pairs.with_name("kept.jsonl")
        kept.write_text(json.dumps({"prompt": "1+1=", "completion": "2", "score": 1.0}) + "\n")
        return {"outputs": {"pairs": str(pairs), "kept": str(kept)},
                "md5": {"pairs": dvc_md5(pairs), "kept": dvc_md5(kept)}, "metrics": {}}

    monkeypatch.setattr(cycles, "sample_and_score", sample)
    with pytest.raises(ValidationFailed) as caught:
        cycles.iterative_dpo(params_file="params.yaml")
    message = str(caught.value)
    assert message.startswith(f"{pairs}: data report FAILED for the preference dataset"), message
    for text in EXPECTED:
        assert (f"{pairs}{text}" if text.startswith(":") else text) in message, message
    assert not (project / "models").exists()  # nothing trained

    client = MlflowClient(tracking_uri=f"sqlite:///{project / 'mlflow.db'}")
    runs = client.search_runs([client.get_experiment_by_name("data-report").experiment_id])
    status = {r.info.run_name: r.info.status for r in runs}
    assert status["cycle-1"] == "FAILED" and status["validate-cycle-1-pairs"] == "FAILED", status
    assert "dpo" not in status
    cycle_run = next(r for r in runs if r.info.run_name == "cycle-1")
    page = client.download_artifacts(cycle_run.info.run_id, "data_report/cycle-1-pairs.html", str(project))
    text = Path(page).read_text(encoding="utf-8")
    assert "alignflow data report: FAILED" in text and "Expectation Validation Result" in text  # GX's page
