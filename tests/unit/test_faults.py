"""The fault-injection test hook (rlhf_core/common/faults.py): it fires only where ALIGNFLOW_FAULT names the stage
and point (and rank), once with a marker file; PAUSE stops the process and lets it go on, without raising, once
continued; STOP continued raises."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from rlhf_core.common.faults import InjectedFault, fires, inject_fault


def test_nothing_fires_unless_the_spec_names_stage_and_point(monkeypatch):
    monkeypatch.delenv("ALIGNFLOW_FAULT", raising=False)
    assert fires("sft", 3) is None
    monkeypatch.setenv("ALIGNFLOW_FAULT", "sft:3")
    assert fires("sft", 2) is None and fires("dpo", 3) is None and fires("sft", "tracking") is None
    with pytest.raises(InjectedFault, match="sft: fault injected after step 3"):
        inject_fault("sft", 3)


def test_a_marker_file_fires_once_and_a_rank_fires_only_its_own(monkeypatch, tmp_path):
    marker = tmp_path / "m" / "fired"
    monkeypatch.setenv("ALIGNFLOW_FAULT", f"register:alias:{marker}")
    assert fires("register", "alias") == f"register:alias:{marker}"
    assert marker.read_text() == "register:alias\n"
    assert fires("register", "alias") is None
    monkeypatch.setenv("ALIGNFLOW_FAULT", "rl-learner:1")
    monkeypatch.setenv("ALIGNFLOW_FAULT_RANK", "1")
    assert fires("rl-learner", 1, rank=lambda: 0) is None
    assert fires("rl-learner", 1, rank=lambda: 1) == "rl-learner:1"
    assert fires("rl-learner", 1) == "rl-learner:1", "a caller with no rank fires whatever the rank"


CHILD = "from rlhf_core.common.faults import inject_fault; inject_fault('sft', 'tracking'); print('went on')"


def _stopped(pid: int) -> bool:
    return Path(f"/proc/{pid}/stat").read_text().rsplit(") ", 1)[1].startswith("T")


@pytest.mark.parametrize("how, code, out", [("PAUSE", 0, "went on"), ("STOP", 1, "")])
def test_a_paused_process_goes_on_once_continued_and_a_stopped_one_fails(how, code, out):
    env = {**os.environ, "ALIGNFLOW_FAULT": "sft:tracking", "ALIGNFLOW_FAULT_SIGNAL": how}
    child = subprocess.Popen([sys.executable, "-c", CHILD], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True)
    try:
        deadline = time.monotonic() + 60
        while not _stopped(child.pid):
            assert child.poll() is None and time.monotonic() < deadline, child.communicate()
            time.sleep(0.05)
        os.kill(child.pid, signal.SIGCONT)
        stdout, stderr = child.communicate(timeout=60)
    finally:
        if child.poll() is None:
            child.kill()
    assert child.returncode == code, stderr[-2000:]
    assert stdout.strip() == out
    assert ("InjectedFault" in stderr) == (how == "STOP")
