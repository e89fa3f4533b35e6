"""Who hands the CUDA allocator's cache back between RL phases: processes that may share their GPU (Ray's
actors, which the launcher starts with ``release_memory``), not one process holding every role."""

from __future__ import annotations

import pytest
import torch

from rlhf_core.trainers import rl_forward
from rlhf_core.trainers.ray_launcher import Launcher, _Worker, worker_env


@pytest.fixture
def cuda_calls(monkeypatch):
    """torch.cuda as a process with an initialised device would see it; the hand-backs it was asked for."""
    calls = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: calls.append("empty_cache"))
    return calls


@pytest.mark.parametrize("setting,released", [(False, False), (True, True)])
def test_release_memory_hands_back_only_where_asked(setting, released, cuda_calls, monkeypatch):
    monkeypatch.setattr(rl_forward, "RELEASE_MEMORY", setting)
    rl_forward.release_memory()
    assert cuda_calls == (["empty_cache"] if released else [])


def test_one_process_keeps_its_cache_and_ray_actors_hand_it_back(cuda_calls, monkeypatch, tmp_path):
    """The default is off (one process); an actor started as the launcher starts it turns it on, and a launcher
    told otherwise (a bench A/B) starts actors that keep it. (A missing folder: the actor stays where it is.)"""
    monkeypatch.setattr(rl_forward, "RELEASE_MEMORY", rl_forward.RELEASE_MEMORY)
    assert rl_forward.RELEASE_MEMORY is False and Launcher.release_memory is True
    monkeypatch.setattr(torch, "set_num_threads", lambda n: None)
    _Worker(str(tmp_path / "absent"), 1, 0.0, Launcher.release_memory)
    assert rl_forward.RELEASE_MEMORY is True
    _Worker(str(tmp_path / "absent"), 1, 0.0, False)
    assert rl_forward.RELEASE_MEMORY is False
    env = worker_env()
    assert env["NCCL_NVLS_ENABLE"] == "0" and env["HF_HUB_OFFLINE"] == "1" and env["MKL_DYNAMIC"] == "FALSE"
    assert not any(name.startswith("ALIGNFLOW_") for name in env)
