"""Mid-run checkpoints of data-parallel runs on real Ray (CPU, gloo): exact resume, and resume on fewer workers.

Two Ray ranks under DDP or DeepSpeed ZeRO-2 (DeepSpeed's CPU accelerator) write checkpoints whose
optimizer state is whole tensors by parameter name (:meth:`rlhf_core.distributed.parallel.Strategy.optimizer_state`).
A fault after a step leaves that run's checkpoints on disk (a failed run keeps them), so:

* run A stops after step 4; run B stops after step 2, resumes, stops after step 4. B's step-4
  checkpoint must equal A's bit for bit (weights and AdamW moments): the moments were restored,
  not reset (reset moments give other weights after two more steps).
* A's step-4 checkpoint resumed on ONE worker finishes with the final loss of an uninterrupted
  two-worker run within 1e-4 relative (only the order of float sums differs).
"""

from __future__ import annotations


import pytest
import torch
from safetensors.torch import load_file

from conftest import Recorder
from rlhf_core.config import SFTConfig
from rlhf_core.common.faults import InjectedFault
from rlhf_core.trainers.sft import train_sft


def _cfg(micro_model, micro_data, folder, **kw) -> SFTConfig:
    base = dict(model_path=str(micro_model), train_file=str(micro_data["sft"]), eval_file=str(micro_data["eval"]),
                output_dir=str(folder / "out"), checkpoint_dir=str(folder / "ckpt"), max_steps=8, batch_size=8,
                grad_accum=2, lr=3e-3, warmup_steps=1, eval_items=4, num_threads=1, precision="fp32", log_every=1,
                save_every=2, keep_checkpoints=10, num_workers=2)
    return SFTConfig(**{**base, **kw})


def _run(cfg: SFTConfig, sink: Recorder | None = None):
    from rlhf_core.trainers.ray_launcher import train_data_parallel

    if cfg.num_workers == 1:
        return train_sft(cfg, sink, show_progress=False)
    return train_data_parallel(train_sft, cfg, sink, show_progress=False)


def _run_until_fault(cfg: SFTConfig, step: int, monkeypatch) -> None:
    monkeypatch.setenv("ALIGNFLOW_FAULT", f"sft:{step}")
    with pytest.raises(Exception, match="fault injected after step"):
        _run(cfg)
    monkeypatch.delenv("ALIGNFLOW_FAULT")


def _state(ckpt) -> tuple[dict, dict]:
    weights = load_file(str(ckpt / "model.safetensors"))
    return weights, torch.load(ckpt / "trainer_state.pt", weights_only=True)["optimizer"]


# Slow tier, all three (30 s or more each): the default tier's two-rank exact resumes are
# test_precision_tiny's (DDP and ZeRO-2 under mixed precision) and test_rank_failure's (a killed rank's retry).
@pytest.mark.parametrize("parallel", [pytest.param("ddp", marks=pytest.mark.slow),
                                      pytest.param("zero2", marks=pytest.mark.slow),
                                      pytest.param("zero3", marks=pytest.mark.slow)])
def test_two_rank_checkpoint_resumes_exactly_and_on_one_rank(ray_local, micro_model, micro_data, tmp_path,
                                                             monkeypatch, parallel):
    a, b = (_cfg(micro_model, micro_data, tmp_path / name, parallel=parallel) for name in ("a", "b"))
    _run_until_fault(a, 4, monkeypatch)
    _run_until_fault(b, 2, monkeypatch)
    _run_until_fault(b, 4, monkeypatch)  # resumes at 2, writes its own step 4, stops
    wa, oa = _state(tmp_path / "a" / "ckpt" / "step-0000004")
    wb, ob = _state(tmp_path / "b" / "ckpt" / "step-0000004")
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
    assert oa["exp_avg"] and oa["exp_avg"].keys() == ob["exp_avg"].keys()
    for key in ("exp_avg", "exp_avg_sq", "step"):
        assert all(torch.equal(oa[key][n], ob[key][n]) for n in oa[key]), key
    assert oa["lr"] == ob["lr"] and float(next(iter(oa["step"].values()))) == 4.0

    # the uninterrupted two-rank run, and A's step-4 checkpoint finished on one rank
    whole, single = Recorder(), Recorder()
    _run(_cfg(micro_model, micro_data, tmp_path / "whole", parallel=parallel), whole)
    _run(_cfg(micro_model, micro_data, tmp_path / "a", num_workers=1), single)
    assert single.series("checkpoint/resumed_from_step") == [4.0]
    lw, ls = whole.series("train/loss"), single.series("train/loss")
    print(f"{parallel}: final loss, 2 ranks uninterrupted {lw[-1]:.8f}; resumed on 1 rank {ls[-1]:.8f}; "
          f"relative gap {abs(lw[-1] - ls[-1]) / abs(lw[-1]):.2e}")
    assert len(ls) == 4 and abs(lw[-1] - ls[-1]) <= 1e-4 * abs(lw[-1])


def test_injected_fault_is_an_error_not_a_hang(ray_local, micro_model, micro_data, tmp_path, monkeypatch):
    """A rank that raises fails the whole group's call at once with that rank's own exception type."""
    monkeypatch.setenv("ALIGNFLOW_FAULT", "sft:1")
    monkeypatch.setenv("ALIGNFLOW_FAULT_RANK", "1")
    with pytest.raises(InjectedFault):
        _run(_cfg(micro_model, micro_data, tmp_path, save_every=0))


def test_a_hung_rank_fails_the_group_after_the_collective_timeout(ray_local, micro_model, micro_data, tmp_path,
                                                                  monkeypatch):
    """Rank 1 freezes (SIGSTOP: alive, silent) after step 1; rank 0 waits in the next step's all-reduce
    until ``collective_timeout_s`` (5 s here) and raises; the launcher kills both and the call
    fails well within a minute instead of gloo's default 30."""
    import time

    monkeypatch.setenv("ALIGNFLOW_FAULT", f"sft:1:{tmp_path / 'frozen'}")
    monkeypatch.setenv("ALIGNFLOW_FAULT_RANK", "1")
    monkeypatch.setenv("ALIGNFLOW_FAULT_SIGNAL", "STOP")
    with pytest.raises(Exception) as failure:
        _run(_cfg(micro_model, micro_data, tmp_path, save_every=0, collective_timeout_s=5.0))
    took = time.time() - (tmp_path / "frozen").stat().st_mtime
    print(f"hung rank: the call failed {took:.1f} s after rank 1 froze: {type(failure.value).__name__}: "
          f"{str(failure.value).splitlines()[-1][:200]}")
    assert 5 <= took < 60, took
