"""A run that saved its final model is not trained again: the loop's finished record (``finished.json``).

The loop records the outcome beside the checkpoints once the final model is saved, and leaves clearing
to the stage, after its tracking and registration. A second call with the same config and inputs
before that (a Prefect retry whose first attempt lost the tracking server) hands back the recorded
outcome without a step; a record of another run, a changed output, ``resume=False`` or a cleared folder
trains again. tests/e2e/test_tracking_retry.py runs the same through Prefect and MLflow.
"""

from __future__ import annotations

import json
import logging
import math

import pytest

from rlhf_core.tracking.checkpoint import FINISHED_FILE, Checkpointer, clear_checkpoints, run_fingerprint
from rlhf_core.config import RLConfig, build_config, SFTConfig
from rlhf_core.tracking.lineage import dvc_md5
from rlhf_core.trainers.rl import train_rl
from rlhf_core.trainers.sft import train_sft
from conftest import Recorder


def _sft(micro_model, micro_data, root, **kw) -> SFTConfig:
    return SFTConfig(**{**dict(model_path=str(micro_model), train_file=str(micro_data["sft"]),
                               eval_file=str(micro_data["eval"]), output_dir=str(root / "out"),
                               checkpoint_dir=str(root / "ckpt"), max_steps=6, batch_size=16, lr=3e-3,
                               warmup_steps=1, eval_every=3, eval_items=16, save_every=4, log_every=1, num_threads=1), **kw})


def _rl(micro_model, micro_data, root, **kw) -> RLConfig:
    reward = root / "length_reward.py"
    reward.parent.mkdir(parents=True, exist_ok=True)
    reward.write_text("def reward(prompts, completions, labels):\n    return [len(c) / 10 for c in completions]\n")
    return build_config(RLConfig, "rl", {**{**{"model_path": str(micro_model),
                                               "prompts_file": str(micro_data["prompts"]),
                              "eval_file": str(micro_data["eval"]), "output_dir": str(root / "out"),
                              "checkpoint_dir": str(root / "ckpt"), "reward.function": f"{reward}:reward",
                              "max_steps": 3,
                              "rollout.prompts_per_step": 4, "rollout.group_size": 4, "rollout.max_new_tokens": 6,
                              "batch_size": 64, "algorithm.mini_batch_size": 8,
                              "lr": 3e-3, "warmup_steps": 0, "eval_items": 8, "eval_at_start": True, "save_every": 2,
                              "num_threads": 1}, **kw}})


def _same(a: dict[str, float], b: dict[str, float]) -> bool:
    """Equal metric dicts, NaN equal to NaN (a JSON round trip keeps every other float exactly)."""
    return a.keys() == b.keys() and all(a[k] == b[k] or (math.isnan(a[k]) and math.isnan(b[k])) for k in a)


@pytest.mark.parametrize("stage", ["sft", "rl"])
def test_a_finished_run_is_handed_back_without_training(stage, micro_model, micro_data, tmp_path, caplog):
    """Run, then run again (no clear in between, as in a retried stage): the second call logs no metric,
    warns that it reuses the output, and returns the first call's metrics (the trainer's own
    ``train/loss_final``, ``perf/tokens_per_s``, RL's last iteration and start eval included), eval
    samples and output, untouched."""
    make, train = {"sft": (_sft, train_sft), "rl": (_rl, train_rl)}[stage]
    cfg = make(micro_model, micro_data, tmp_path)
    trained = Recorder()
    first = train(cfg, trained, show_progress=False)
    key = "train/loss_final" if stage == "sft" else "rollout/reward_mean"
    assert trained.steps("train/loss" if stage == "sft" else "rollout/reward_mean")[-1] == cfg.max_steps
    md5 = dvc_md5(cfg.output_dir)
    assert (tmp_path / "ckpt" / FINISHED_FILE).is_file() and list((tmp_path / "ckpt").glob("step-*"))

    sink = Recorder()
    with caplog.at_level(logging.WARNING):
        again = train(cfg, sink, show_progress=False)
    assert sink.rows == [] and sink.tables == [], "nothing trained, nothing logged"
    assert f"{stage}: reusing the finished output of this run, {cfg.output_dir} (saved after step {cfg.max_steps}" \
        in caplog.text
    assert _same(again.metrics, first.metrics), (again.metrics, first.metrics)
    assert math.isfinite(again.metrics[key]) and again.eval_samples == first.eval_samples
    assert dvc_md5(cfg.output_dir) == md5


def test_a_record_that_does_not_match_is_ignored_and_the_run_trains(micro_model, micro_data, tmp_path, caplog):
    """After a finished run the record is *not* used, with a warning saying why, when the config differs
    (the fingerprint), the output changed since (its DVC md5) or the record is torn; nor with
    ``resume=False``; nor once the stage cleared the folder. Each of these trains: from step 1, or from
    the run's last checkpoint (step 4, kept with the record) where the config is the run's own."""
    cfg = _sft(micro_model, micro_data, tmp_path)
    record = tmp_path / "ckpt" / FINISHED_FILE

    def trains(c: SFTConfig, expect: str | None, first_step: int = 1) -> None:
        caplog.clear()
        sink = Recorder()
        with caplog.at_level(logging.WARNING):
            train_sft(c, sink, show_progress=False)
        assert sink.steps("train/loss") == list(range(first_step, 7)), f"trained from step {first_step}"
        assert "reusing the finished output" not in caplog.text
        if expect is not None:
            assert f"ignoring {record}: {expect}" in caplog.text, caplog.text

    trains(cfg, None)
    other = _sft(micro_model, micro_data, tmp_path, lr=1e-3)
    trains(other, "written by a run of another format, config, inputs or code; training again")
    assert json.loads(record.read_text())["fingerprint"] == run_fingerprint(other)  # the new run's record

    (tmp_path / "out" / "config.json").write_text("{}\n")  # someone edited the output after the save
    trains(other, f"its output {tmp_path / 'out'} is missing or changed since", first_step=5)
    record.write_text(record.read_text()[:200])  # a record cut short
    trains(other, "unreadable", first_step=5)
    trains(_sft(micro_model, micro_data, tmp_path, lr=1e-3, resume=False), None)
    clear_checkpoints(other.checkpoint_dir)
    assert not record.exists() and not list((tmp_path / "ckpt").glob("step-*"))
    trains(other, None)


def test_the_record_names_its_run_and_output(tmp_path, caplog):
    """The record alone, no training: read back by a checkpointer of the same fingerprint, refused by
    another (or another format), and gone after :func:`clear_checkpoints` with the checkpoints."""
    out = tmp_path / "out"
    out.mkdir()
    (out / "model.safetensors").write_bytes(b"weights")
    mine = Checkpointer(tmp_path / "ckpt", "fp-1")
    outcome = {"eval_metrics": {"eval/accuracy": 0.5}, "eval_samples": [], "train_seconds": 1.0,
               "total_seconds": 2.0, "resumed_from_step": 0, "result_metrics": {"train/loss_final": float("nan")},
               "reused": False}
    mine.mark_finished(7, out, outcome)
    found = mine.finished()
    assert found is not None and found.step == 7 and found.output_dir == out and found.output_md5 == dvc_md5(out)
    assert found.outcome["eval_metrics"] == {"eval/accuracy": 0.5}
    assert math.isnan(found.outcome["result_metrics"]["train/loss_final"])

    with caplog.at_level(logging.WARNING):
        assert Checkpointer(tmp_path / "ckpt", "fp-2").finished() is None
    assert "another format, config, inputs or code" in caplog.text
    raw = json.loads((tmp_path / "ckpt" / FINISHED_FILE).read_text())
    (tmp_path / "ckpt" / FINISHED_FILE).write_text(json.dumps({**raw, "format": raw["format"] - 1}))
    assert mine.finished() is None

    (tmp_path / "ckpt" / "step-0000004").mkdir()
    mine.mark_finished(7, out, outcome)
    clear_checkpoints(tmp_path / "ckpt")
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == [".lock"]
    assert mine.finished() is None


def test_resume_flag_accepts_a_finished_record(micro_model, micro_data, tmp_path):
    """``alignflow sft --resume`` insists on something to continue: a step checkpoint, or (after the stage
    saved its model and stopped before tracking it) the finished record; with neither it is a config error."""
    from flows.cli import _require_checkpoint
    from rlhf_core.config import ConfigError

    cfg = _sft(micro_model, micro_data, tmp_path, save_every=0)
    with pytest.raises(ConfigError, match="--resume: no checkpoint of this run"):
        _require_checkpoint(cfg, "sft")
    train_sft(cfg, show_progress=False)  # no step checkpoints (save_every=0), a finished record
    assert not list((tmp_path / "ckpt").glob("step-*")) and (tmp_path / "ckpt" / FINISHED_FILE).is_file()
    _require_checkpoint(cfg, "sft")
