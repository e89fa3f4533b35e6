"""``stack_dump_s``: the periodic stack dumps of a run that hangs, armed from the trainer config in the stage's
process and in each Ray actor the launcher starts (:func:`rlhf_core.common.offline.arm_stack_dumps`)."""

from __future__ import annotations

import time

import torch

from rlhf_core.common.offline import arm_stack_dumps
from rlhf_core.trainers import rl_forward
from rlhf_core.trainers.ray_launcher import _Worker


def test_dumps_every_period_until_a_stage_without_them(capfd):
    arm_stack_dumps(0.05)
    time.sleep(0.3)
    arm_stack_dumps(0)  # the next stage's config says 0: the earlier stage's dumps stop
    assert "test_dumps_every_period_until_a_stage_without_them" in capfd.readouterr().err
    time.sleep(0.2)
    assert capfd.readouterr().err == ""


def test_an_actor_arms_what_its_launcher_passes(capfd, monkeypatch, tmp_path):
    monkeypatch.setattr(torch, "set_num_threads", lambda n: None)
    monkeypatch.setattr(rl_forward, "RELEASE_MEMORY", rl_forward.RELEASE_MEMORY)
    try:
        _Worker(str(tmp_path / "absent"), 1, 0.05, False)
        time.sleep(0.3)
    finally:
        arm_stack_dumps(0)
    assert "test_an_actor_arms_what_its_launcher_passes" in capfd.readouterr().err
