"""The rules `alignflow reproduce` judges by, on hand-made values: how a run records a path, which metadata
difference is ignored, how weights, data and metrics differences count, the verdict line, and when a naming
setting needs no --trust. The end-to-end runs are in tests/e2e/test_reproduce*.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from flows.reproduce_compare import (
    SAME_PLACE,
    Comparison,
    Difference,
    FolderView,
    Roots,
    compare_folder,
    compare_md5s,
    compare_metadata,
    compare_metrics,
    compare_registry,
    disk_view,
    render,
    report_fields,
    same_place,
)
from flows.reproduce_trust import PROTECTS, enforce, local_store, review_config
from rlhf_core.tracking.lineage import dir_listing, dir_md5, listing_md5, project_relative

ROOTS = Roots(Path("/home/me/proj"), Path("/tmp/alignflow-reproduce-x/worktree"))


def test_a_path_is_recorded_relative_to_the_project_when_it_lies_there(tmp_path):
    project, outside = tmp_path / "proj", tmp_path / "elsewhere"
    (project / "data").mkdir(parents=True)
    outside.mkdir()
    (project / "linked").symlink_to(outside)  # inside by name, outside once resolved
    assert project_relative("data/sft.jsonl", project) == "data/sft.jsonl"
    assert project_relative("./data//sft.jsonl", project) == "data/sft.jsonl"
    assert project_relative(project / "data" / "sft.jsonl", project) == "data/sft.jsonl"
    assert project_relative(f"{project}/models/../data/sft.jsonl", project) == "data/sft.jsonl"
    assert project_relative("linked/model", project) == "linked/model"  # as written: the project's own name
    assert project_relative(project, project) == "."
    # outside the project: absolute and normalised, whatever way it was written
    assert project_relative("../elsewhere/hf-model", project) == str(outside / "hf-model")
    assert project_relative(outside / "hf-model", project) == str(outside / "hf-model")
    assert project_relative("/etc/../etc/hosts", project) == "/etc/hosts"


def test_a_symlinked_project_folder_still_records_relative_paths(tmp_path):
    real = tmp_path / "real"
    (real / "data").mkdir(parents=True)
    (tmp_path / "alias").symlink_to(real)
    assert project_relative(real / "data" / "x.jsonl", tmp_path / "alias") == "data/x.jsonl"


def test_the_ignore_rule_is_the_same_project_relative_path_and_nothing_else():
    """Ignored: the original's absolute path under its project against the rerun's relative one (bug 1 of
    issue 49), and each side's absolute path under its own root. Counted: another file, another folder,
    a path under the *other* side's root, a non-path value."""
    assert same_place("/home/me/proj/data/sft.jsonl", "data/sft.jsonl", ROOTS)
    assert same_place("data/sft.jsonl", "/tmp/alignflow-reproduce-x/worktree/data/sft.jsonl", ROOTS)
    assert same_place("/home/me/proj/models/sft", "/tmp/alignflow-reproduce-x/worktree/models/sft", ROOTS)
    assert same_place("./models/sft", "models/sft/", ROOTS)
    assert not same_place("data/sft.jsonl", "data/sft_v2.jsonl", ROOTS)
    assert not same_place("/home/me/proj/data/sft.jsonl", "/home/me/proj/data/sft.jsonl.bak", ROOTS)
    assert not same_place("/tmp/alignflow-reproduce-x/worktree/data/a", "data/a", ROOTS)  # rerun root on the left
    assert not same_place("/shared/models/base", "/other/models/base", ROOTS)
    assert not same_place(0.003, 0.004, ROOTS) and not same_place("", "data/a", ROOTS)


def test_metadata_differences_are_listed_each_ignored_or_counted():
    original = json.dumps({"stage": "sft", "base_model": "models/base",
                           "config": {"train_file": "/home/me/proj/data/sft.jsonl", "lr": 0.003}}).encode()
    rerun = json.dumps({"stage": "sft", "base_model": "models/base",
                        "config": {"train_file": "data/sft.jsonl", "lr": 0.004, "seed": 1}}).encode()
    found = {d.what: d for d in compare_metadata("models/sft/alignflow.json", original, rerun, ROOTS)}
    assert set(found) == {f"models/sft/alignflow.json config.{k}" for k in ("train_file", "lr", "seed")}
    assert found["models/sft/alignflow.json config.train_file"].ignored == SAME_PLACE
    assert not found["models/sft/alignflow.json config.lr"].ignored
    assert found["models/sft/alignflow.json config.seed"].original == "<absent>"
    (text,) = compare_metadata("models/sft/chat_template.jinja", b"{{ a }}", b"{{ b }}", ROOTS)
    assert text.kind == "metadata" and not text.ignored  # not JSON: one counted difference
    assert compare_metadata("x.jinja", b"same", b"same", ROOTS) == []


def _model(folder: Path, weights: bytes, train_file: str, extra: dict | None = None) -> Path:
    folder.mkdir(parents=True)
    (folder / "model.safetensors").write_bytes(weights)
    (folder / "config.json").write_text(json.dumps({"hidden_size": 32}))
    (folder / "alignflow.json").write_text(json.dumps({"config": {"train_file": train_file, **(extra or {})}}))
    return folder


def test_a_model_folder_differing_only_by_where_the_project_lay_is_identical(tmp_path):
    """The situation of issue 49 item 1: equal weights, alignflow.json naming the same file two ways."""
    original = _model(tmp_path / "a" / "models" / "sft", b"w" * 64, str(tmp_path / "a" / "data" / "sft.jsonl"))
    rerun = _model(tmp_path / "b" / "models" / "sft", b"w" * 64, "data/sft.jsonl")
    assert dir_md5(original, cache=False) != dir_md5(rerun, cache=False)
    roots = Roots(tmp_path / "a", tmp_path / "b")
    diffs = compare_folder("model_sft", disk_view(original, False), disk_view(rerun, False), roots)
    assert [(d.kind, d.ignored) for d in diffs] == [("metadata", SAME_PLACE)]

    views = lambda tag, a, b: (disk_view(original, False), disk_view(rerun, False))  # noqa: E731
    comparison = compare_md5s({"dvc.md5.model_sft": dir_md5(original, cache=False)},
                              {"dvc.md5.model_sft": dir_md5(rerun, cache=False)}, views, roots)
    assert comparison.identical and comparison.verdict() == "IDENTICAL"
    assert comparison.compared["weights"] == 1 and len(comparison.differences) == 1


def test_weights_and_files_on_one_side_count(tmp_path):
    roots = Roots(tmp_path / "a", tmp_path / "b")
    original = _model(tmp_path / "a" / "m", b"w" * 64, "data/sft.jsonl")
    rerun = _model(tmp_path / "b" / "m", b"v" * 64, "data/sft.jsonl")
    (rerun / "extra.txt").write_text("new")
    diffs = compare_folder("model_dpo", disk_view(original, False), disk_view(rerun, False), roots)
    assert [(d.kind, d.what, d.ignored) for d in diffs] == [("metadata", "model_dpo/extra.txt", ""),
                                                            ("weights", "model_dpo/model.safetensors", "")]
    assert diffs[0].original == "<absent>"


def test_data_md5s_and_unreadable_folders_count():
    def no_views(tag, a, b):
        return None, None

    original = {"dvc.md5.sft": "a" * 32, "dvc.md5.eval": "c" * 32, "dvc.md5.model_sft": "d" * 32 + ".dir"}
    rerun = {"dvc.md5.sft": "b" * 32, "dvc.md5.eval": "c" * 32, "dvc.md5.model_sft": "e" * 32 + ".dir"}
    comparison = compare_md5s(original, rerun, no_views, ROOTS)
    assert comparison.compared == {**comparison.compared, "data": 2, "weights": 1}
    kinds = {d.what: d.kind for d in comparison.counted}
    assert kinds == {"sft": "data", "model_sft (a folder's files could not be read to compare)": "weights"}


def test_a_cached_listing_reads_like_the_folder(tmp_path):
    """The original's folder may be read from a DVC cache: FolderView over cache objects."""
    model = _model(tmp_path / "m", b"w" * 64, "data/sft.jsonl")
    listing = dir_listing(model, cache=False)
    assert listing_md5(listing) == dir_md5(model, cache=False)
    cache = tmp_path / "cache"
    for rel, md5 in listing.items():
        (cache / md5[:2]).mkdir(parents=True, exist_ok=True)
        (cache / md5[:2] / md5[2:]).write_bytes((model / rel).read_bytes())
    view = FolderView(listing, cache_root=cache)
    assert view.read("config.json") == (model / "config.json").read_bytes()
    assert compare_folder("m", view, disk_view(model, False), Roots(tmp_path, tmp_path)) == []


def test_metrics_compare_every_step_exactly():
    same = {"eval/accuracy_sft": [[0, 0.25]]}
    assert compare_metrics(same, same).identical
    two_steps = {"eval/accuracy": [[1, 0.5], [2, 0.5]]}
    (d,) = compare_metrics(two_steps, {"eval/accuracy": [[1, 0.5], [2, 0.5000001]]}).counted
    assert d.kind == "metrics" and d.original == [[1, 0.5], [2, 0.5]]
    (d,) = compare_metrics({"eval/accuracy_dpo": [[0, 0.3]]}, {}).counted
    assert (d.original, d.rerun) == (0.3, "<absent>")


def test_the_verdict_is_one_line_naming_the_first_counted_differences():
    comparison = Comparison([Difference("metadata", "m/alignflow.json config.train_file", "/p/a", "a", SAME_PLACE)])
    assert comparison.verdict() == "IDENTICAL"
    comparison.add(Comparison([Difference("weights", f"model_{i}/model.safetensors", "a", "b") for i in range(5)]))
    verdict = comparison.verdict()
    assert verdict.startswith("DIFFERENT: weights model_0/model.safetensors") and verdict.endswith("(and 2 more)")
    assert "\n" not in verdict and "config.train_file" not in verdict


def test_a_registry_change_by_the_rerun_counts():
    before = {"my-policy": {"versions": [1], "aliases": {"candidate": "1", "champion": "1"}}}
    assert compare_registry(before, json.loads(json.dumps(before))).identical
    moved = {"my-policy": {"versions": [1, 2], "aliases": {"candidate": "2", "champion": "1"}}}
    (d,) = compare_registry(before, moved).counted
    assert d.kind == "registry" and "changed by the rerun" in d.what


def test_the_report_ends_with_the_verdict():
    comparison = compare_metrics({"eval/accuracy_sft": [[0, 0.25]]}, {"eval/accuracy_sft": [[0, 0.5]]})
    result = {"target": "f" * 32, "commit": "a" * 40, "flow": "align", "rerun_id": "e" * 32, "warnings": ["w"],
              **report_fields(comparison)}
    lines = render(result).splitlines()
    assert lines[0] == "warning: w" and lines[-1] == result["verdict"]
    assert lines[-1] == "DIFFERENT: metrics eval/accuracy_sft: 0.25 (original) != 0.5 (rerun)"
    assert "  metrics:  1 metric(s), 1 difference(s)" in lines


# --------------------------------------------------------------------------------------
# --trust: relaxed only for naming settings in the project's own SQLite store
# --------------------------------------------------------------------------------------


def test_only_a_sqlite_file_inside_the_project_is_a_local_store(tmp_path):
    assert local_store(f"sqlite:///{tmp_path}/mlflow.db", tmp_path)
    assert not local_store(f"sqlite:///{tmp_path.parent}/mlflow.db", tmp_path)
    assert not local_store("sqlite:///:memory:", tmp_path)
    assert not local_store("http://127.0.0.1:5000", tmp_path)
    assert not local_store(f"postgresql://u@h/{tmp_path}/db", tmp_path)


@pytest.mark.parametrize("section,field,value,relaxed", [
    ("cycles", "registered_model", "my-policy", True),  # the README's own --set
    ("tracking", "experiment", "my experiment 2", True),
    ("tracking", "registered_model", "my.sft_model", True),
    ("tracking", "experiment", "/Shared/team/exp", False),  # a path, never a plain name
    ("cycles", "registered_model", "https://evil/x", False),
    ("tracking", "tracking_uri", "sqlite:///elsewhere.db", False),  # a tracking target, not a name
    ("tracking", "artifact_dir", "/srv/artifacts", False),
    ("rl", "reward.function", "other.py:reward", False),
])
def test_naming_settings_need_no_trust_only_for_the_projects_own_store(tmp_path, section, field, value, relaxed):
    commit = {"tracking": {"experiment": "alignflow", "registered_model": "alignflow-sft", "tracking_uri": "",
                           "artifact_dir": "mlartifacts"},
              "cycles": {"registered_model": "alignflow-policy"},
              "rl": {"reward": {"function": "rlhf_core/embedded/reward.py:reward"}}}
    stored = json.loads(json.dumps(commit))
    stored[section][field] = value
    local = review_config(stored, commit, tmp_path, store_is_local=True)
    shared = review_config(stored, commit, tmp_path, store_is_local=False)
    assert len(local.differences) == len(shared.differences) == 1  # always shown
    assert bool(local.relaxed) == relaxed and bool(local.untrusted) != relaxed
    assert shared.untrusted and not shared.relaxed  # another store: --trust, as before
    if relaxed:
        enforce(local, trust=False, worktree=tmp_path)  # no refusal, no --trust needed
    with pytest.raises(SystemExit) as refused:
        enforce(shared, trust=False, worktree=tmp_path)
    assert PROTECTS in str(refused.value) and f"{section}.{field}" in str(refused.value)
    assert "." not in PROTECTS  # one sentence


def test_the_rerun_gets_each_input_as_flag_equals_the_recorded_path(tmp_path):
    """``--flag=path``: a recorded path is passed as recorded (project-relative ones read in the worktree), and
    one starting with '-' can never read as an option."""
    from flows.reproduce import flow_command, rerun_params
    from flows.reproduce_inputs import RecordedInput

    inputs = [RecordedInput("sft_file", "data/sft.jsonl", "a" * 32, "--sft-file"),
              RecordedInput("eval_file", "-odd.jsonl", "b" * 32, "--eval-file"),
              RecordedInput("base_model", "/models/hf", "c" * 32 + ".dir", "--base-model"),
              RecordedInput("prompts", "data/prompts.jsonl", "d" * 32)]  # an iterative flow's: from its params
    cmd = flow_command("align", inputs, None, tmp_path)
    assert cmd[cmd.index("flow"):cmd.index("flow") + 4] == ["flow", "align", "--params", "reproduce_params.yaml"]
    assert cmd[-3:] == ["--sft-file=data/sft.jsonl", "--eval-file=-odd.jsonl", "--base-model=/models/hf"]
    assert flow_command("raft", [], 2, tmp_path)[-2:] == ["--cycles", "2"]
    with pytest.raises(SystemExit, match="inputs.cycles"):
        flow_command("raft", [], "2; rm", tmp_path)
    # a rerun registers nothing, commits nothing, hits no cache; the stored params are not modified
    stored = {"tracking": {"log_model": True}, "cycles": {"version": True}}
    assert rerun_params("iterative_dpo", stored) == {"tracking": {"log_model": False}, "flow": {"use_cache": False},
                                                     "cycles": {"version": False}}
    assert stored["tracking"]["log_model"] is True


def test_the_team_services_folder_is_no_output_of_a_rerun(tmp_path):
    """team.data_dir (``alignflow services up``'s folder, often absolute) is no escape: a rerun starts no service;
    an output folder outside the worktree still is."""
    params = {"team": {"data_dir": "/srv/alignflow/services"}, "sft": {"output_dir": "models/sft"}}
    assert review_config(params, params, tmp_path).escapes == []
    params["sft"]["output_dir"] = "/srv/elsewhere"
    assert [e.split(":")[0] for e in review_config(params, params, tmp_path).escapes] == ["sft.output_dir"]
