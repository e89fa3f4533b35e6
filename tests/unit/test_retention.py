"""gc's rules on hand-made runs (flows/retention.py): roots, lineage through run-id tags, and the precedence of
protected over count over age. The end-to-end run against real MLflow, git and DVC is tests/e2e/test_gc.py."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from flows.retention import (DAY_MS, RunInfo, is_kept_tag, kept_roots, lineage_roots, protected_roots, root_of,
                             stale_checkpoints)
from rlhf_core.config import ConfigError, RetentionConfig, build_config

NOW = 100 * DAY_MS


def _flow(runs: dict, night: int, **tags: str) -> str:
    """A flow run of night ``night`` (``NOW - (30 - night)`` days) with an sft and a dpo stage run."""
    root = f"root{night}"
    start = NOW - (30 - night) * DAY_MS
    runs[root] = RunInfo(root, "align", start, "", dict(tags), "1")
    for i, stage in enumerate(("sft", "dpo")):
        runs[f"{stage}{night}"] = RunInfo(f"{stage}{night}", stage, start + i + 1, root, {}, "1")
    return root


def _month() -> dict:
    runs: dict = {}
    for night in range(1, 31):
        _flow(runs, night)
    return runs


def test_a_stage_runs_root_is_its_flow_run_and_a_root_is_its_own():
    runs = _month()
    assert root_of("dpo7", runs) == "root7" and root_of("root7", runs) == "root7"
    runs["orphan"] = RunInfo("orphan", "x", 0, "gone", {}, "1")  # a parent deleted by hand: the run is a root
    assert root_of("orphan", runs) == "orphan"


def test_lineage_follows_run_id_tags_into_older_flows():
    runs = _month()
    runs["dpo5"].tags["alignflow.sft_run_id"] = "sft4"
    runs["sft4"].tags["alignflow.parent_cycle_run_id"] = "root2"
    assert lineage_roots(["dpo5"], runs) == {"root5", "root4", "root2"}


def test_count_then_age_keep_the_newest_flows():
    """keep_runs 10 keeps nights 21-30; keep_days 12 also keeps nights 18-20 (30 - n <= 12)."""
    runs = _month()
    kept = kept_roots(runs, RetentionConfig(keep_runs=10, keep_days=12), NOW, {})
    assert set(kept) == {f"root{n}" for n in range(18, 31)}
    assert "keep_runs" in kept["root25"] and "keep_days" in kept["root19"]


def test_protected_wins_over_every_rule():
    runs = _month()
    runs["sft2"].tags["alignflow.keep"] = "true"
    runs["sft3"].tags["alignflow.keep"] = "false"
    versions = [SimpleNamespace(name="policy", version="5", run_id="dpo5", tags={}),
                SimpleNamespace(name="policy", version="6", run_id="dpo6", tags={"alignflow.registration": "pending"}),
                SimpleNamespace(name="policy", version="7", run_id="dpo7", tags={})]
    protected = protected_roots(runs, versions, {("policy", "5")})
    assert set(protected) == {"root2", "root5", "root6"}
    kept = kept_roots(runs, RetentionConfig(keep_runs=1, keep_days=0), NOW, protected)
    assert set(kept) == {"root2", "root5", "root6", "root30"} and "aliased" in kept["root5"]


@pytest.mark.parametrize("value, kept", [("true", True), ("1", True), ("yes", True), ("false", False),
                                         ("0", False), ("", False), (None, False)])
def test_the_keep_tag_reads_as_a_yes_or_no(value, kept):
    assert is_kept_tag(value) is kept


def test_a_checkpoint_folder_is_stale_once_its_newest_step_is(tmp_path):
    import os

    old, fresh = tmp_path / "sft", tmp_path / "dpo"
    for root, ages in ((old, (9, 8)), (fresh, (9, 1))):
        for i, age in enumerate(ages):
            step = root / f"step-{i:07d}"
            step.mkdir(parents=True)
            os.utime(step, (1000 * 86_400 - age * 86_400,) * 2)
    stale = stale_checkpoints([old, fresh], RetentionConfig(keep_days=7), now_s=1000 * 86_400)
    assert stale == sorted(old.glob("step-*"))


def test_bad_retention_values_name_section_and_field():
    with pytest.raises(ConfigError, match=r"retention.keep_runs: must be >= 1"):
        build_config(RetentionConfig, "retention", {"keep_runs": 0})
    with pytest.raises(ConfigError, match=r"retention.keep_days: must be >= 0"):
        build_config(RetentionConfig, "retention", {"keep_days": -1})
