"""Who hands the CUDA allocator's cache back between RL phases: processes that may share their GPU (Ray's
workers, through the environment ray_launcher gives them), not one process holding every role."""

from __future__ import annotations

import pytest
import torch

from rlhf_core.trainers.ray_launcher import worker_env
from rlhf_core.trainers import rl_forward


@pytest.fixture
def cuda_calls(monkeypatch):
    """torch.cuda as a process with an initialised device would see it; the hand-backs it was asked for."""
    calls = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: calls.append("empty_cache"))
    return calls


@pytest.mark.parametrize("setting,released", [(None, False), ("0", False), ("1", True)])
def test_release_memory_hands_back_only_where_asked(setting, released, cuda_calls, monkeypatch):
    if setting is None:
        monkeypatch.delenv("ALIGNFLOW_RELEASE_MEMORY", raising=False)
    else:
        monkeypatch.setenv("ALIGNFLOW_RELEASE_MEMORY", setting)
    rl_forward.release_memory()
    assert cuda_calls == (["empty_cache"] if released else [])


def test_ray_workers_release_unless_the_driver_says_otherwise(monkeypatch):
    monkeypatch.delenv("ALIGNFLOW_RELEASE_MEMORY", raising=False)
    env = worker_env()
    assert env["ALIGNFLOW_RELEASE_MEMORY"] == "1"
    assert env["NCCL_NVLS_ENABLE"] == "0" and env["HF_HUB_OFFLINE"] == "1"
    monkeypatch.setenv("ALIGNFLOW_RELEASE_MEMORY", "0")
    assert worker_env()["ALIGNFLOW_RELEASE_MEMORY"] == "0"
