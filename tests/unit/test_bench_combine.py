"""``bench/side_by_side.py --combine``: one result file from the rows of consecutive calls (the 7B AB round).

Run on two committed result files of a 4 x H200 run (ours in one call, TRL in the next on the same warm
machine): the combined summary's ratio must be TRL's median over ours', each recomputed here from the raw
per-step times with the first step left out, and the ceiling the larger of the two calls'.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
RESULTS = REPO / "bench" / "results" / "h200x4" / "2026-11-29"
OURS, TRL = RESULTS / "side_by_side_h200x4_7b_grpo_ours_c2.json", RESULTS / "side_by_side_h200x4_7b_grpo_trl_c3.json"


def _timed_median(path: Path, row: str) -> float:
    run = json.loads(path.read_text())["results"]["grpo"]["runs"][row][0]
    return statistics.median(run["step_s"][1:])  # the bench's default --warmup 1


def test_combined_ratio_is_trls_median_over_ours_from_the_raw_steps(bench, tmp_path):
    out = tmp_path / "combined.json"
    doc = bench.results.combine([OURS, TRL], out, warmup=1)
    pair = doc["results"]["grpo"]["summary"]["pairs"]["ours-bf16 / trl-default"]
    expected = _timed_median(TRL, "trl-default") / _timed_median(OURS, "ours-bf16")
    assert pair["speedup_ours_over_trl"] == pytest.approx(expected, abs=1e-3)
    ceilings = [json.loads(p.read_text())["ceiling"]["matmul_flops"] for p in (OURS, TRL)]
    assert doc["ceiling"]["matmul_flops"] == max(ceilings)
    assert [c["file"] for c in doc["combined_from"]] == [OURS.name, TRL.name]
    runs = doc["results"]["grpo"]["runs"]
    assert runs["ours-bf16"][0]["call"] == OURS.name and runs["trl-default"][0]["call"] == TRL.name
    assert json.loads(out.read_text())["summary"] == json.loads(json.dumps(doc["summary"]))


def test_a_row_in_two_files_is_refused(bench, tmp_path):
    with pytest.raises(SystemExit, match="ours-bf16 of grpo is in more than one file"):
        bench.results.combine([OURS, OURS], tmp_path / "twice.json", warmup=1)


def _one_round(path: Path, dest: Path, rows: list[str]) -> Path:
    """``path`` as a call of one round that ran ``rows`` in that order (the settings a --rounds 1 call records)."""
    doc = json.loads(path.read_text())
    doc["settings"] = {**doc["settings"], "rounds": 1, "rows": {r: doc["settings"]["rows"][r] for r in rows}}
    dest.write_text(json.dumps(doc))
    return dest


def test_combine_rounds_numbers_each_files_runs_as_the_next_round(bench, tmp_path):
    """Two one-round calls of the same row: its two runs, rounds 0 and 1, its timed steps pooled (the first
    step of each left out: 2 x (len - 1)), and the combined file says it ran 2 rounds."""
    a = _one_round(OURS, tmp_path / "r1.json", ["ours-bf16"])
    b = _one_round(OURS, tmp_path / "r2.json", ["ours-bf16"])
    doc = bench.results.combine([a, b], tmp_path / "both.json", warmup=1, as_rounds=True)
    runs = doc["results"]["grpo"]["runs"]["ours-bf16"]
    assert [r["round"] for r in runs] == [0, 1] and [r["call"] for r in runs] == ["r1.json", "r2.json"]
    steps = json.loads(OURS.read_text())["results"]["grpo"]["runs"]["ours-bf16"][0]["step_s"]
    assert doc["results"]["grpo"]["summary"]["rows"]["ours-bf16"]["timed_steps"] == 2 * (len(steps) - 1)
    assert doc["settings"]["rounds"] == 2 and doc["settings"]["combined_rounds"] == ["r1.json", "r2.json"]


def test_combine_rounds_refuses_a_second_round_not_in_reverse_order(bench, tmp_path):
    both = json.loads(TRL.read_text())
    merged = json.loads(OURS.read_text())
    merged["results"]["grpo"]["runs"].update(both["results"]["grpo"]["runs"])
    merged["settings"]["rows"] = {**merged["settings"]["rows"], **both["settings"]["rows"]}
    src = tmp_path / "src.json"
    src.write_text(json.dumps(merged))
    rows = list(merged["settings"]["rows"])
    a, b = _one_round(src, tmp_path / "r1.json", rows), _one_round(src, tmp_path / "r2.json", rows)
    with pytest.raises(SystemExit, match="ABBA wants"):
        bench.results.combine([a, b], tmp_path / "both.json", warmup=1, as_rounds=True)


def test_combine_rounds_refuses_a_row_whose_checkpointing_differs_between_calls(bench, tmp_path):
    """The 2026-12-06 H100 GRPO calls: round 2's TRL rows ran before ours, took TRL's default (checkpointing on)
    while round 1's matched ours (off); pooled, their median would mix two regimes."""
    h100 = REPO / "bench" / "results" / "h100" / "2026-12-06"
    r1, r2 = (h100 / f"side_by_side_h100_0p5b_grpo_hygiene_r{i}.json" for i in (1, 2))
    with pytest.raises(SystemExit, match="trl-default of grpo ran with gradient checkpointing"):
        bench.results.combine([r1, r2], tmp_path / "both.json", warmup=2, as_rounds=True)


def test_the_grpo_targets_are_the_issues_and_read_ours_best_row_and_the_floor(bench, tmp_path):
    """Two committed one-round calls of the 0.5B GRPO (rows reversed in the second): the combined file's GRPO
    targets are issue 52's (step, fraction of floor, rollout, update against its floor), each read from ours-best's
    pooled row and the floor, and say the card they were written for beside the card that ran."""
    day = REPO / "bench" / "results" / "h100" / "2026-12-07"
    calls = [day / f"side_by_side_h100_0p5b_grpo_hygiene_final_r{i}.json" for i in (1, 2)]
    doc = bench.results.combine(calls, tmp_path / "grpo.json", warmup=2, as_rounds=True)
    summary = doc["results"]["grpo"]["summary"]
    ours, fl = summary["rows"]["ours-best"], summary["floor"]
    got = {t["target"]: t for t in doc["summary"]["targets"] if t.get("written_for")}
    assert list(got) == ["grpo step <= 1.3 s", "grpo fraction of floor >= 50%", "grpo rollout <= 0.45 s",
                         "grpo update <= 1.6x its floor"]
    assert got["grpo step <= 1.3 s"]["value"] == ours["median_step_s"]
    assert got["grpo rollout <= 0.45 s"]["value"] == ours["phase_s"]["rollout_s"]
    assert got["grpo update <= 1.6x its floor"]["value"] == pytest.approx(ours["phase_s"]["update_s"] / fl["update_s"],
                                                                         abs=1e-3)
    assert {t["status"] for t in got.values()} == {"not met"}  # 1.90 s a step on an H100 against 1.3 s
    assert {t["device"] for t in got.values()} == {"NVIDIA H100 80GB HBM3"}
