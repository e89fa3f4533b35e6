"""``alignflow diff``: the real CLI on a real MLflow sqlite store.

The runs are made with the MLflow client the way the cycle flows log them (a flow parent run
with the config as params; nested cycle runs with ``git.commit``, ``dvc.md5.*`` tags and
``cycle/accuracy`` with ``cycle/accuracy_stderr``); what is tested is diff itself, so no
training runs. A registered model gets two versions (one from each cycle run) and ``champion``.
"""

from __future__ import annotations

import json
import math

import pytest

from flows.cli import main as alignflow
from flows.diff import MODEL_TAG, compare, split_stderr
from helpers import run_cli

COMMON_PARAMS = {"cycles.n_samples": "4", "train.learning_rate": "1e-05"}


def _cycle_run(client, exp_id: str, *, commit: str, beta: str, eval_md5: str, policy_md5: str,
               accuracy: float, stderr: float) -> str:
    """A parent flow run (params, eval md5) with one nested cycle run (tags, metrics); the cycle run's id."""
    parent = client.create_run(exp_id, run_name="iterative_dpo",
                               tags={"git.commit": commit, "dvc.md5.eval": eval_md5})
    for key, value in {**COMMON_PARAMS, "train.beta": beta}.items():
        client.log_param(parent.info.run_id, key, value)
    cycle = client.create_run(exp_id, run_name="cycle-1", tags={
        "mlflow.parentRunId": parent.info.run_id, "git.commit": commit, "alignflow.version": "0.1.0",
        "alignflow.cycle": "1", "dvc.md5.policy": policy_md5})
    client.log_metric(cycle.info.run_id, "cycle/accuracy", accuracy, step=1)
    client.log_metric(cycle.info.run_id, "cycle/accuracy_stderr", stderr, step=1)
    client.log_metric(cycle.info.run_id, "cycle/kept_fraction", 0.25, step=1)
    for run in (cycle, parent):
        client.set_terminated(run.info.run_id)
    return cycle.info.run_id


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    """Two nights' cycle runs and a registered model ``policy`` (v1 from night 1, v2 = champion from night 2)."""
    from mlflow.tracking import MlflowClient

    project = tmp_path_factory.mktemp("diff")
    uri = f"sqlite:///{project / 'mlflow.db'}"
    client = MlflowClient(tracking_uri=uri, registry_uri=uri)
    exp_id = client.create_experiment("alignflow-test", artifact_location=(project / "mlartifacts").as_uri())
    night1 = _cycle_run(client, exp_id, commit="a" * 40, beta="0.1", eval_md5="e" * 32, policy_md5="1" * 32,
                        accuracy=0.40, stderr=0.05)
    night2 = _cycle_run(client, exp_id, commit="b" * 40, beta="0.2", eval_md5="e" * 32, policy_md5="2" * 32,
                        accuracy=0.55, stderr=0.04)
    client.create_registered_model("policy")
    for run_id in (night1, night2):
        client.create_model_version("policy", f"runs:/{run_id}/model", run_id=run_id)
    client.set_registered_model_alias("policy", "champion", "2")
    return {"project": project, "night1": night1, "night2": night2, "uri": uri}


def _diff(store, capsys, *args: str) -> tuple[int, str, str]:
    """``alignflow diff ARGS`` in this process (the CLI's own ``main``): the exit status, stdout, stderr.
    The first test runs it as a separate process; these skip the ~3 s of imports each."""
    code = alignflow(["diff", *args, "--tracking-uri", store["uri"]])
    out, err = capsys.readouterr()
    return code, out, err


def _lines_of(out: str, title: str) -> list[str]:
    """The rows of one block (``changed (4):`` up to the blank line)."""
    block = out.split(f"\n{title} (", 1)[1].split("\n\n", 1)[0]
    return block.splitlines()[2:]


def test_two_cycle_runs_changed_rows_first(store):
    proc = run_cli(["diff", store["night1"], store["night2"]], store["project"])
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    changed = _lines_of(out, "changed")
    keys = [line.split()[1] for line in changed]
    # Sections in order code, data, params, metrics; the unchanged eval md5 and n_samples are not shown.
    assert keys == ["git.commit", "dvc.md5.policy", "train.beta", "cycle/accuracy"], out
    assert "0.4 ± 0.05" in changed[-1] and "0.55 ± 0.04" in changed[-1], out
    expected = math.sqrt(0.05 ** 2 + 0.04 ** 2)  # 0.064
    assert f"+0.15 ± {expected:.2g} (unpaired)" in changed[-1], out
    assert out.index("changed (") < out.index("unchanged rows not shown")
    assert "dvc.md5.eval" not in out and "parent run(s)" in out
    assert "the paired one" in out and "upper bound" in out  # the footnote: the error printed is not the paired one



def test_all_lists_unchanged_rows_too(store, capsys):
    shown_all = _diff(store, capsys, "--all", store["night1"], store["night2"])[1]
    unchanged = [line.split()[1] for line in _lines_of(shown_all + "\n\n", "unchanged")]
    assert {"dvc.md5.eval", "cycles.n_samples", "cycle/kept_fraction"} <= set(unchanged)


def test_model_versions_and_alias(store, capsys):
    code, out, err = _diff(store, capsys, "models:/policy/1", "policy@champion", "--exit-code")
    assert code == 1, err  # --exit-code: they differ
    assert f"A: run {store['night1']}" in out and "model version policy/1" in out
    assert f"B: run {store['night2']}" in out and "model version policy/2" in out
    code, out, err = _diff(store, capsys, "models:/policy@champion", "models:/policy/2", "--exit-code")
    assert code == 0 and "no differences" in out, out + err


def test_json_output(store, capsys):
    code, out, err = _diff(store, capsys, "--json", store["night1"], "policy@champion")
    assert code == 0, err
    report = json.loads(out)
    assert report["different"] and report["delta_stderr_kind"] == "unpaired"
    assert report["b"]["model_version"] == "policy/2"
    acc = next(r for r in report["rows"] if r["key"] == "cycle/accuracy")
    assert acc["status"] == "changed" and acc["a_stderr"] == 0.05 and acc["b_stderr"] == 0.04
    assert acc["delta"] == pytest.approx(0.15)


def test_unknown_run_id_exits_2_naming_it(store):
    unknown = "0123456789abcdef0123456789abcdef"
    proc = run_cli(["diff", store["night1"], unknown], store["project"])
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert f"no run '{unknown}' in the tracking store" in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr and proc.stdout == ""


@pytest.mark.parametrize("ref, named", [
    ("not-a-run-id", "no run 'not-a-run-id'"),
    ("models:/policy/9", "no version 9 of registered model 'policy'"),
    ("policy@nightly", "no alias 'nightly' of registered model 'policy'"),
    ("models:/nosuch/1", "registered model 'nosuch'"),
])
def test_unknown_version_or_alias_exits_2_naming_it(store, capsys, ref, named):
    code, out, err = _diff(store, capsys, ref, store["night2"])
    assert code == 2 and named in err and out == "", err


def test_missing_store_is_an_error_not_a_new_store(tmp_path, capsys):
    code, _, err = _diff({"uri": f"sqlite:///{tmp_path / 'none.db'}"}, capsys, "x", "y")
    assert code == 2 and "no MLflow store" in err, err
    assert not (tmp_path / "none.db").exists()


def test_compare_pairs_each_metric_with_its_stderr():
    """Pure comparison: ``eval/accuracy_stderr_sft`` (the align flow's naming) is ``eval/accuracy_sft``'s error;
    a stderr with no metric of its own name stays a row."""
    metrics = {"eval/accuracy_sft": 0.5, "eval/accuracy_stderr_sft": 0.05, "orphan_stderr": 0.1}
    values, errors = split_stderr(metrics)
    assert values == {"eval/accuracy_sft": 0.5, "orphan_stderr": 0.1}
    assert errors == {"eval/accuracy_sft": 0.05}
    a = {"params": {"lr": "1"}, "tags": {"git.commit": "x"}, "metrics": metrics}
    b = {"params": {"lr": "1", "beta": "2"}, "tags": {"git.commit": "x"}, "metrics": {"eval/accuracy_sft": 0.5}}
    rows = {(r.section, r.key): r.status for r in compare(a, b)}
    assert rows == {("params", "beta"): "only_b", ("metrics", "orphan_stderr"): "only_a",
                    ("code", "git.commit"): "same", ("params", "lr"): "same", ("metrics", "eval/accuracy_sft"): "same"}


# --------------------------------------------------------------------------------------
# Paired errors: runs that logged guards/per_item.json (what every guarded policy stage logs)
# --------------------------------------------------------------------------------------

PROMPTS = [f"{i}+{i}=" for i in range(10)]
CORRECT_A = [1, 1, 1, 0, 0, 1, 0, 1, 0, 0]  # mean 0.5
CORRECT_B = [1, 1, 1, 1, 0, 1, 0, 1, 1, 0]  # mean 0.7: B fixed items 3 and 8, broke none
REWARD_A = [1.0, 2.0, 3.0, 4.0, 5.0, 1.0, 2.0, 3.0, 4.0, 5.0]
REWARD_B = [r + (0.1 if i % 2 == 0 else 0.3) for i, r in enumerate(REWARD_A)]  # +0.2 on average


def _per_item(parent_correct, child_correct, parent_reward, child_reward, eval_md5="e" * 32) -> dict:
    return {"eval_file": "data/eval.jsonl", "eval_md5": eval_md5, "parent": "models/parent", "child": "models/child",
            "items": [{"i": i, "prompt": p, "label": str(2 * i), "slice": None, "parent_answer": "x",
                       "child_answer": "y", "parent_correct": pc, "child_correct": cc, "parent_reward": pr,
                       "child_reward": cr}
                      for i, (p, pc, cc, pr, cr) in enumerate(zip(PROMPTS, parent_correct, child_correct,
                                                                  parent_reward, child_reward))]}


def _stage_run(client, exp_id, name, *, correct, per_item=None, model_md5, parent_md5=None, parent_run=None) -> str:
    """A stage run as _train_stage logs it: eval/accuracy with its stderr (the per-item mean and its error),
    the output model's md5, and, for a guarded stage, guard.parent_md5 and guards/per_item.json."""
    from rlhf_core.promotion.guards import mean_and_se

    tags = {MODEL_TAG: model_md5, **({"guard.parent_md5": parent_md5} if parent_md5 else {}),
            **({"mlflow.parentRunId": parent_run} if parent_run else {})}
    run = client.create_run(exp_id, run_name=name, tags=tags)
    accuracy, stderr = mean_and_se(correct)
    client.log_metric(run.info.run_id, "eval/accuracy", accuracy)
    client.log_metric(run.info.run_id, "eval/accuracy_stderr", stderr)
    if per_item is not None:
        client.log_dict(run.info.run_id, per_item, "guards/per_item.json")
    client.set_terminated(run.info.run_id)
    return run.info.run_id


@pytest.fixture(scope="module")
def paired_store(tmp_path_factory):
    """Runs with per-item results: two dpo stage runs from the same parent on the same 10 items (A, B); an sft
    stage run (no per-item results) and a cycle run whose dpo stage run below it was trained from the sft model;
    a dpo run on another eval set; a registered model ``paired`` (v1 = B's stage run)."""
    from mlflow.tracking import MlflowClient

    project = tmp_path_factory.mktemp("paired")
    uri = f"sqlite:///{project / 'mlflow.db'}"
    client = MlflowClient(tracking_uri=uri, registry_uri=uri)
    exp_id = client.create_experiment("alignflow-paired", artifact_location=(project / "mlartifacts").as_uri())
    parent = [0] * 10
    a = _stage_run(client, exp_id, "dpo", correct=CORRECT_A, model_md5="a" * 32, parent_md5="p" * 32,
                   per_item=_per_item(parent, CORRECT_A, REWARD_A, REWARD_A))
    b = _stage_run(client, exp_id, "dpo", correct=CORRECT_B, model_md5="b" * 32, parent_md5="p" * 32,
                   per_item=_per_item(parent, CORRECT_B, REWARD_A, REWARD_B))
    sft = _stage_run(client, exp_id, "sft", correct=CORRECT_A, model_md5="s" * 32)
    cycle = client.create_run(exp_id, run_name="cycle-1", tags={MODEL_TAG: "c" * 32})
    client.log_metric(cycle.info.run_id, "cycle/accuracy", 0.7)
    below = _stage_run(client, exp_id, "dpo", correct=CORRECT_B, model_md5="c" * 32, parent_md5="s" * 32,
                       parent_run=cycle.info.run_id,
                       per_item=_per_item(CORRECT_A, CORRECT_B, REWARD_A, REWARD_B))
    client.set_terminated(cycle.info.run_id)
    other_eval = _stage_run(client, exp_id, "dpo", correct=CORRECT_B, model_md5="o" * 32, parent_md5="p" * 32,
                            per_item=_per_item(parent, CORRECT_B, REWARD_A, REWARD_B, eval_md5="f" * 32))
    client.create_registered_model("paired")
    client.create_model_version("paired", f"runs:/{b}/model", run_id=b)
    return {"project": project, "uri": uri, "a": a, "b": b, "sft": sft, "cycle": cycle.info.run_id,
            "below": below, "other_eval": other_eval}


PAIRED_SE = math.sqrt(1.6 / 90)
"""d = B - A per item: 1 on items 3 and 8, else 0; mean 0.2; sum (d - 0.2)^2 = 2 * 0.64 + 8 * 0.04 = 1.6;
paired se = sqrt(1.6 / (n (n - 1))) = sqrt(1.6 / 90) = 0.1333."""
UNPAIRED_SE = math.sqrt(2.5 / 90 + 2.1 / 90)
"""se_A^2 = 10 * 0.25 / 90 (mean 0.5), se_B^2 = (7 * 0.09 + 3 * 0.49) / 90 = 2.1 / 90; sqrt of the sum = 0.2261."""
REWARD_SE = math.sqrt(10 * 0.01 / 90)
"""Reward d alternates 0.1, 0.3: mean 0.2, each 0.1 off it; paired se = sqrt(10 * 0.01 / 90) = 0.0333."""


def test_same_items_give_the_paired_error(paired_store, capsys):
    code, out, err = _diff(paired_store, capsys, paired_store["a"], paired_store["b"])
    assert code == 0, err
    rows = {line.split()[1]: line for line in _lines_of(out, "changed")}
    assert f"+0.2 ± {PAIRED_SE:.2g} (paired)" in rows["eval/accuracy"], out  # the logged metric is the per-item mean
    assert f"+0.2 ± {PAIRED_SE:.2g} (paired)" in rows["per_item/accuracy"], out
    assert f"+0.2 ± {REWARD_SE:.2g} (paired)" in rows["per_item/reward"], out
    assert "(unpaired)" not in out and "n = 10" in out and "on the same 10 eval items" in out

    report = json.loads(_diff(paired_store, capsys, "--json", paired_store["a"], "models:/paired/1")[1])
    assert report["delta_stderr_kind"] == "paired" and report["pairing"]["n"] == 10
    acc = next(r for r in report["rows"] if r["key"] == "eval/accuracy")
    assert acc["delta_stderr_kind"] == "paired" and acc["delta_stderr"] == pytest.approx(PAIRED_SE)
    assert PAIRED_SE < UNPAIRED_SE == pytest.approx(math.sqrt(acc["a_stderr"] ** 2 + acc["b_stderr"] ** 2))


def test_b_trained_from_a_pairs_from_b_alone(paired_store, capsys):
    """A (an sft run) logged no per-item results; B's stage run below the cycle run was trained from A's model,
    so its guard.parent_md5 is A's model md5 and its per_item.json holds A's model's answers as the parent's."""
    code, out, err = _diff(paired_store, capsys, paired_store["sft"], paired_store["cycle"])
    assert code == 0, err
    assert f"per-item results from run {paired_store['below']} below it" in out
    assert "B was trained from A's model" in out
    per_item = next(line for line in _lines_of(out, "changed") if "per_item/accuracy" in line)
    assert f"+0.2 ± {PAIRED_SE:.2g} (paired)" in per_item, out
    # The other way round: A trained from B's model; B - A is parent - child.
    out = _diff(paired_store, capsys, paired_store["below"], paired_store["sft"])[1]
    per_item = next(line for line in _lines_of(out, "changed") if "per_item/accuracy" in line)
    assert f"-0.2 ± {PAIRED_SE:.2g} (paired)" in per_item and "A was trained from B's model" in out


def test_other_eval_items_fall_back_to_unpaired_with_the_reason(paired_store, capsys):
    out = _diff(paired_store, capsys, paired_store["a"], paired_store["other_eval"])[1]
    acc = next(line for line in _lines_of(out, "changed") if "eval/accuracy" in line)
    assert f"± {UNPAIRED_SE:.2g} (unpaired)" in acc and "per_item/" not in out, out
    assert "no paired error: the eval sets differ" in out and "the unpaired error is the right one" in out
    out = _diff(paired_store, capsys, paired_store["sft"], paired_store["b"])[1]  # b was not trained from sft
    assert "(unpaired)" in out and "no per-item results (guards/per_item.json) for A" in out, out


def test_a_logged_metric_keeps_the_unpaired_error_unless_it_is_the_per_item_mean():
    """Pure: per-item accuracy 0.5 -> 0.7 on 10 items (paired se sqrt(1.6 / 90), see PAIRED_SE). A logged
    eval/accuracy of 0.5 -> 0.7 is that mean and gets the paired error; one of 0.52 -> 0.7 was measured on
    other items or settings and keeps sqrt(0.05^2 + 0.04^2)."""
    from flows.diff import ItemSource, apply_pairing, pair_items

    items = _per_item([0] * 10, CORRECT_A, REWARD_A, REWARD_A)["items"]
    items_b = _per_item([0] * 10, CORRECT_B, REWARD_A, REWARD_B)["items"]
    pairing = pair_items(ItemSource("ra", {"eval_md5": "e", "items": items}),
                         ItemSource("rb", {"eval_md5": "e", "items": items_b}))
    assert pairing.kind == "paired" and pairing.n == 10
    for a_value, expected_kind, expected_se in ((0.5, "paired", PAIRED_SE), (0.52, "unpaired", math.hypot(0.05, 0.04))):
        side = {"params": {}, "tags": {}}
        rows = apply_pairing(compare({**side, "metrics": {"eval/accuracy": a_value, "eval/accuracy_stderr": 0.05}},
                                     {**side, "metrics": {"eval/accuracy": 0.7, "eval/accuracy_stderr": 0.04}}), pairing)
        acc = next(r for r in rows if r.key == "eval/accuracy")
        assert acc.delta_stderr_kind == expected_kind and acc.delta_stderr == pytest.approx(expected_se)
        assert next(r for r in rows if r.key == "per_item/accuracy").delta_stderr == pytest.approx(PAIRED_SE)
