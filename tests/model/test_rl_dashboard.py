"""A tiny real GRPO run leaves its run dashboard: one record per step in the checkpoint folder, and one
self-contained HTML page whose data agree with what the run logged (rlhf_core/trainers/rl_dashboard.py,
rlhf_core/tracking/run_dashboard.py). Also asynchronous (staleness) and resumed runs."""

from __future__ import annotations

import json
import re

import pytest

from rlhf_core.config import RLConfig, build_config
from rlhf_core.tracking.run_dashboard import read_records
from rlhf_core.trainers.rl import train_rl
from conftest import TOOL_OBSERVATION, Recorder, stop_after

PAGE_LIMIT = 5 * 2**20


def _cfg(micro_model, micro_data, tmp_path, reward, **overrides) -> RLConfig:
    values = {"model_path": str(micro_model), "prompts_file": str(micro_data["prompts"]),
              "eval_file": str(micro_data["eval"]), "output_dir": str(tmp_path / "rl"),
              "checkpoint_dir": str(tmp_path / "ckpt"), "reward.function": reward, "max_steps": 3,
              "rollout.prompts_per_step": 4, "rollout.group_size": 4, "rollout.max_new_tokens": 6, "batch_size": 64,
              "algorithm.mini_batch_size": 16, "lr": 3e-3, "warmup_steps": 0, "eval_items": 8,
              "eval_at_start": False, "num_threads": 1}
    values.update(overrides)
    return build_config(RLConfig, "rl", values)


def _page_data(html: str) -> dict:
    return json.loads(re.search(r'<script type="application/json" id="run-data">(.*?)</script>', html, re.S).group(1))


def test_grpo_run_writes_records_and_a_bounded_offline_page(micro_model, micro_data, tmp_path, length_reward):
    """Two mini-batches a batch (pi_old recomputed before the update): every step has a record whose metrics are
    the logged ones, spans for rollout, reward, log-probs and update, per-sample distributions of the batch's
    size, and the highest- and lowest-reward samples with the engine's and the trainer's log-prob of each token;
    the page embeds them, fetches nothing, and stays small."""
    rec = Recorder()
    cfg = _cfg(micro_model, micro_data, tmp_path, length_reward, **{"algorithm.mini_batch_size": 8})
    result = train_rl(cfg, rec, show_progress=False)
    records = read_records(tmp_path / "ckpt" / "dashboard" / "records.jsonl")
    assert [r["step"] for r in records] == [1, 2, 3]
    logged = {(step, name): value for step, metrics in rec.rows for name, value in metrics.items()}
    for r in records:
        for name in ("rollout/reward_mean", "train/kl", "train/entropy", "rollout/logprob_mismatch"):
            assert r["metrics"][name] == pytest.approx(logged[(r["step"], name)], rel=0, abs=0)
        phases = {s[1] for s in r["spans"]}
        assert {"rollout", "reward", "log-probs", "update"} <= phases
        assert all(s[3] >= s[2] for s in r["spans"])
        assert len(r["samples"]["reward"]) == 16 and len(r["samples"]["entropy"]) == 16
        assert sum(r["samples"]["reward"]) / 16 == pytest.approx(r["metrics"]["rollout/reward_mean"], abs=1e-5)
        assert r["staleness"] == [0] * 16
        assert len(r["drill"]) == 2
        hi, lo = r["drill"]
        assert hi["reward"] == max(r["samples"]["reward"]) and lo["reward"] == min(r["samples"]["reward"])
        for sample in r["drill"]:
            assert len(sample["tokens"]) == len(sample["engine_logp"]) == len(sample["trainer_logp"]) > 0
            # the trainer's recomputation agrees with the engine (the HF engine holds the policy) to rounding
            assert max(abs(a - b) for a, b in zip(sample["engine_logp"], sample["trainer_logp"])) < 1e-3
            assert sample["trainer_source"] == "pi_old"
        assert r["mismatch_kl"] is not None and 0 <= r["mismatch_kl"] < 1e-5 and r["mismatch_rows"] == 16
    page = result.dashboard
    assert page == tmp_path / "ckpt" / "dashboard.html" and page.exists()
    html = page.read_text(encoding="utf-8")
    assert len(html.encode()) < PAGE_LIMIT
    assert not re.search(r"""(src|href)\s*=\s*["']?(https?:)?//""", html), "the page must fetch nothing"
    data = _page_data(html)
    assert [s["step"] for s in data["steps"]] == [1, 2, 3]
    assert data["steps"][0]["metrics"]["rollout/reward_mean"] == records[0]["metrics"]["rollout/reward_mean"]
    assert data["steps"][-1]["samples"][0]["prompt"] == records[-1]["drill"][0]["prompt"]


@pytest.mark.parametrize("engine", ["static", "hf"])
def test_with_parity_the_mismatch_kl_is_exactly_zero(micro_model, micro_data, tmp_path, length_reward, engine):
    """rl.rollout.parity: the dashboard's mismatch KL, computed from the engine's and the trainer's log-probs of
    every token, reads exactly 0.0 at every step, and each drilled sample's two log-prob lists are equal."""
    cfg = _cfg(micro_model, micro_data, tmp_path, length_reward,
               **{"algorithm.mini_batch_size": 8, "rollout.engine": engine, "rollout.parity": True})
    train_rl(cfg, Recorder(), show_progress=False)
    records = read_records(tmp_path / "ckpt" / "dashboard" / "records.jsonl")
    assert [r["mismatch_kl"] for r in records] == [0.0, 0.0, 0.0] and all(r["mismatch_rows"] == 16 for r in records)
    for r in records:
        assert r["metrics"]["rollout/logprob_mismatch"] == 0.0
        for sample in r["drill"]:
            assert sample["engine_logp"] == sample["trainer_logp"]

def test_fused_pi_old_adds_no_forward_and_records_the_engine_log_probs(micro_model, micro_data, tmp_path,
                                                                       length_reward):
    """One update per batch (pi_old fused into the update): the drill-down has the engine's log-probs and no
    trainer's, the mismatch KL is absent (the logged rollout/logprob_mismatch stays), and the page says why."""
    result = train_rl(_cfg(micro_model, micro_data, tmp_path, length_reward), Recorder(), show_progress=False)
    records = read_records(tmp_path / "ckpt" / "dashboard" / "records.jsonl")
    for r in records:
        assert r["mismatch_kl"] is None and r["mismatch_rows"] == 0
        assert "rollout/logprob_mismatch" in r["metrics"]
        for sample in r["drill"]:
            assert sample["trainer_logp"] is None and sample["trainer_source"] is None
            assert all(lp is not None and lp < 0 for lp in sample["engine_logp"])
    assert "not recorded (pi_old is the update" in result.dashboard.read_text()


def test_asynchronous_run_records_staleness_and_the_rollout_thread(micro_model, micro_data, tmp_path,
                                                                   length_reward):
    """max_staleness 1: from step 2 on, each batch came from the policy one update back; the rollout thread's
    phases are a lane of their own, and pi_old is recomputed for every row (the mismatch KL covers them all)."""
    cfg = _cfg(micro_model, micro_data, tmp_path, length_reward, **{"off_policy.max_staleness": 1})
    train_rl(cfg, Recorder(), show_progress=False)
    records = read_records(tmp_path / "ckpt" / "dashboard" / "records.jsonl")
    assert [r["staleness"][0] for r in records] == [0, 1, 1]
    assert all(r["staleness"] == [r["staleness"][0]] * 16 for r in records)
    assert records[-1]["metrics"]["async/staleness"] == 1.0
    lanes = {s[0] for r in records for s in r["spans"]}
    assert any(lane.endswith("rollout thread") for lane in lanes) and any(lane.endswith("trainer") for lane in lanes)
    assert all(r["mismatch_rows"] == 16 for r in records)
    assert all(s["trainer_source"] == "pi_old" for r in records for s in r["drill"])


def test_resumed_run_keeps_the_steps_before_its_checkpoint(micro_model, micro_data, tmp_path, length_reward,
                                                           monkeypatch):
    """Stopped after step 2's checkpoint and resumed: the records are steps 1-3 once each, and the page has them."""
    cfg = _cfg(micro_model, micro_data, tmp_path, length_reward, save_every=2)
    stop_after("rl:2", lambda c, show_progress: train_rl(c, Recorder(), show_progress=show_progress), cfg,
               monkeypatch)
    before = read_records(tmp_path / "ckpt" / "dashboard" / "records.jsonl")
    assert [r["step"] for r in before] == [1, 2]
    resumed = train_rl(_cfg(micro_model, micro_data, tmp_path, length_reward, save_every=2, resume=True), Recorder(),
                       show_progress=False)
    after = read_records(tmp_path / "ckpt" / "dashboard" / "records.jsonl")
    assert [r["step"] for r in after] == [1, 2, 3]
    assert after[:2] == before
    assert [s["step"] for s in _page_data(resumed.dashboard.read_text())["steps"]] == [1, 2, 3]




def test_tool_trajectories_show_calls_results_and_no_log_prob_for_results(tool_model, micro_data, scripted_env,
                                                                          tmp_path, length_reward):
    """Multi-turn GRPO with a tool (the micro tool model calls it first at low temperature): each drill-down
    sample's completion alternates the policy's text and the tool's results, its tool-call count is its number
    of results, and the tokens of a result carry no engine or trainer log-prob (they are not the policy's)."""
    cfg = build_config(RLConfig, "rl", {
        "model_path": str(tool_model), "prompts_file": str(micro_data["prompts"]),
        "eval_file": str(micro_data["eval"]), "output_dir": str(tmp_path / "rl"),
        "checkpoint_dir": str(tmp_path / "ckpt"), "reward.function": length_reward,
        "environment.spec": scripted_env, "environment.max_turns": 3, "environment.max_trajectory_tokens": 20,
        "rollout.max_new_tokens": 6, "rollout.temperature": 0.2, "max_steps": 2, "rollout.prompts_per_step": 4,
        "rollout.group_size": 4, "batch_size": 64, "algorithm.mini_batch_size": 8, "lr": 3e-3, "warmup_steps": 0,
        "eval_items": 8, "eval_at_start": False, "num_threads": 1, "rollout.engine": "hf"})
    train_rl(cfg, Recorder(), show_progress=False)
    records = read_records(tmp_path / "ckpt" / "dashboard" / "records.jsonl")
    samples = [s for r in records for s in r["drill"]]
    assert samples and any(s["tool_calls"] > 0 for s in samples)
    for s in samples:
        results = [seg["text"] for seg in s["segments"] if seg["source"] == "observation"]
        assert all(TOOL_OBSERVATION in text for text in results) and s["tool_calls"] == len(results)
        nulls = [i for i, lp in enumerate(s["engine_logp"]) if lp is None]
        assert nulls == [i for i, lp in enumerate(s["trainer_logp"]) if lp is None]
        assert "".join(s["tokens"][i] for i in nulls) == "".join(results)

