"""The run dashboard's pure parts: quantiles, lanes and idle time, staleness counts, which steps keep their
samples, the mismatch KL, the page's safety and size bound (rlhf_core/tracking/run_dashboard.py,
rlhf_core/trainers/rl_dashboard.py), and the model card's link."""

from __future__ import annotations

import json
import math
import re

import pytest
import torch

from rlhf_core.tracking.model_card import render_model_card
from rlhf_core.tracking.run_dashboard import (DASHBOARD_TAG, MAX_DRILL_STEPS, drill_steps, lanes, page_data,
                                              quantiles, render_dashboard, staleness_counts, write_dashboard)
from rlhf_core.trainers.rl_dashboard import drill_rows, mismatch_kl, policy_segments

PAGE_LIMIT = 5 * 2**20


def test_quantiles_interpolate_between_order_statistics():
    """[1, 2, 3, 4, 5]: p10 sits at position 0.4 -> 1.4, p25 at 1.0 -> 2, median 3, p75 4, p90 at 3.6 -> 4.6;
    mean 3. NaN and None are left out; nothing finite gives None."""
    out = quantiles([5, 1, float("nan"), 3, None, 2, 4])
    assert out["q"] == pytest.approx([1, 1.4, 2, 3, 4, 4.6, 5])
    assert out["mean"] == 3 and out["n"] == 5
    assert quantiles([float("nan")]) is None and quantiles([]) is None
    assert quantiles([7.0])["q"] == [7.0] * 7


def test_lanes_count_idle_gaps_between_phases_once():
    """Lane A: rollout 0-1, reward 1.5-2, update 3-4: idle 0.5 + 1 = 1.5, busy 1 + 0.5 + 1 = 2.5.
    Lane B: two overlapping spans 0-2 and 1-3: busy 3 (the overlap once), idle 0."""
    spans = [["A", "update", 3, 4], ["A", "rollout", 0, 1], ["A", "reward", 1.5, 2],
             ["B", "rollout", 0, 2], ["B", "reward", 1, 3]]
    out = lanes(spans)
    assert out["A"]["idle"] == pytest.approx(1.5) and out["A"]["busy"] == pytest.approx(2.5)
    assert [s[0] for s in out["A"]["spans"]] == ["rollout", "reward", "update"]
    assert out["B"]["idle"] == 0 and out["B"]["busy"] == pytest.approx(3.0)


def test_staleness_counts_and_drill_steps():
    assert staleness_counts([1, 0, 1, 2, 1]) == {"0": 1, "1": 3, "2": 1}
    assert drill_steps([3, 1, 2]) == {1, 2, 3}
    kept = drill_steps(list(range(1, 1001)), 200)
    assert len(kept) == 200 and {1, 1000} <= kept
    assert drill_steps(list(range(1, 10)), 1) == {9}


def test_drill_rows_and_segments():
    """Highest then lowest reward (first of ties); one row when all are equal. Segments: runs of 1s and 0s."""
    assert drill_rows(torch.tensor([0.5, 2.0, -1.0, 2.0, -1.0])) == [1, 2]
    assert drill_rows(torch.tensor([1.0, 1.0])) == [0]
    assert drill_rows(torch.tensor([])) == []
    assert policy_segments([1, 1, 0, 0, 0, 1]) == [("policy", 0, 2), ("observation", 2, 5), ("policy", 5, 6)]
    assert policy_segments([]) == []


def test_mismatch_kl_is_the_k3_estimate_over_masked_tokens():
    """Engine log-probs e = [log .5, log .25], trainer t = [log .25, log .25], second row masked out.
    Per token k3 = exp(t - e) - (t - e) - 1: token 1: 0.5 - log 0.5 - 1 = log 2 - 0.5 = 0.19315; token 2: 0.
    Mean over the 2 unmasked tokens: 0.096574. Equal log-probs: exactly 0."""
    e = torch.tensor([[math.log(0.5), math.log(0.25)], [0.0, 0.0]])
    t = torch.tensor([[math.log(0.25), math.log(0.25)], [-3.0, -3.0]])
    mask = torch.tensor([[1.0, 1.0], [0.0, 0.0]])
    assert mismatch_kl(e, t, mask) == pytest.approx((math.log(2) - 0.5) / 2, rel=1e-6)
    assert mismatch_kl(e, e, mask) == 0.0
    assert mismatch_kl(e, t, torch.zeros_like(mask)) is None


def _record(step: int, *, tokens: int = 4, text: str = "2+2=", samples: int = 16) -> dict:
    return {"step": step, "metrics": {"rollout/reward_mean": 0.1 * step, "train/kl": 0.01, "perf/step_s": 1.0},
            "spans": [["pid 1 · trainer", "rollout", 100.0 + step, 101.0 + step],
                      ["pid 1 · trainer", "update", 101.5 + step, 102.0 + step]],
            "staleness": [0] * samples,
            "samples": {"reward": [0.0, 1.0] * (samples // 2), "length": [3] * samples, "kl": [0.01] * samples,
                        "entropy": [2.0] * samples},
            "mismatch_kl": 0.0, "mismatch_rows": 2,
            "drill": [{"index": i, "prompt": text, "segments": [{"source": "policy", "text": text}], "tool_calls": 0,
                       "reward": 1.0 - i, "n_tokens": tokens, "tokens": ["x"] * tokens,
                       "engine_logp": [-1.2345] * tokens, "trainer_logp": [-1.2346] * tokens,
                       "trainer_source": "learner forward", "staleness": 0} for i in range(2)]}


def test_page_holds_its_data_and_fetches_nothing(tmp_path):
    """The payload keeps the table's metrics (no perf/), per-step quantiles and samples; the page embeds it in a
    JSON block that text cannot close (``</script>`` in a prompt stays inside), and names no URL to fetch."""
    records = [_record(1), _record(2, text="</script><script>alert(1)</script> http://x.invalid/a.js")]
    data = page_data(records, "rl: t")
    assert data["columns"] == ["rollout/reward_mean", "train/kl"]
    assert data["steps"][0]["dist"]["reward"]["q"][3] == 0.5
    assert data["steps"][1]["lanes"]["pid 1 · trainer"]["idle"] == pytest.approx(0.5)
    html = render_dashboard(records, "rl: t")
    assert html.count("</script>") == 2  # the data block's and the script's own
    block = re.search(r'id="run-data">(.*?)</script>', html, re.S).group(1)
    assert json.loads(block)["steps"][1]["samples"][0]["prompt"].startswith("</script>")
    assert not re.search(r"""(src|href)\s*=\s*["']?(https?:)?//""", html)
    (tmp_path / "records.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records[::-1]))
    out = write_dashboard(tmp_path / "records.jsonl", tmp_path / "d.html")
    assert out.read_text() == render_dashboard(records, "RL run")
    assert write_dashboard(tmp_path / "none.jsonl", tmp_path / "e.html") is None


def _worst_case(steps: int) -> list[dict]:
    """Records at every cap: 64 samples a step, drill-down prompts and completions at their character caps in
    two-byte characters, 256 tokens of 16 two-byte characters each."""
    from rlhf_core.trainers.rl_dashboard import MAX_COMPLETION_CHARS, MAX_PROMPT_CHARS, MAX_TOKENS

    records = [_record(s, tokens=MAX_TOKENS, samples=64) for s in range(1, steps + 1)]
    for r in records:
        for sample in r["drill"]:
            sample.update(prompt="é" * MAX_PROMPT_CHARS,
                          segments=[{"source": "policy", "text": "é" * MAX_COMPLETION_CHARS}],
                          tokens=["é" * 16] * MAX_TOKENS)
    return records


@pytest.mark.parametrize("steps", [200, 1000])
def test_worst_case_page_stays_under_5_mb(steps):
    """At every cap, a 200-step and a 1,000-step run: the drill-down keeps what fits its budget (evenly spread,
    first and last step among them) and the page stays below 5 MB."""
    records = _worst_case(steps)
    html = render_dashboard(records)
    kept = [s["step"] for s in page_data(records, "t")["steps"] if s["samples"]]
    assert 0 < len(kept) <= MAX_DRILL_STEPS and kept[0] == 1 and kept[-1] == steps
    assert len(html.encode()) < PAGE_LIMIT


def test_model_card_links_the_dashboard():
    tags = {"alignflow.stage": "rl", DASHBOARD_TAG: "dashboard.html"}
    card = render_model_card("policy", "3", "abc123", tags, {}, {}, {"promoted": True}, None)
    assert "runs:/abc123/dashboard.html" in card
    assert "Run dashboard" not in render_model_card("policy", "3", "abc123", {}, {}, {}, {}, None)
