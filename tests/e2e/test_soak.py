"""Soak: ``alignflow flow iterative_dpo`` (3 cycles) survives a seeded schedule of SIGKILLs of its
training processes and ends exactly where an undisturbed run ends.

Two copies of one micro git + DVC project run the real CLI against a real Prefect server. The
first runs undisturbed. In the second, a watcher thread SIGKILLs the training child of a stage
(``tasks.worker``, one per training task with ``flow.isolation: process``) at the moments a
``random.Random(SEED)`` schedule names: a cycle and stage (reward-model retraining or DPO), and
either a delay after the child starts (mid-import, mid-load, mid-step) or the N-th checkpoint
that child writes (plus a few ms: mid-step or mid-save). One stage is killed twice, so a resumed
retry dies too. A kill whose child finishes first moves to the next child; the flow process
itself is never touched. ``flow.retries`` equals the number of kills, so even the worst
placement cannot exhaust a task's retries.

Then every cycle's evaluation (the DPO and reward runs' ``eval/*``, the cycle run's metrics),
every cycle's model md5 and the registry's ``champion`` (its version and model md5) must equal
the undisturbed run's, and Prefect must show one retry per kill.

4 to 8 minutes on 2 shared cores (measured 4 min 12 s quiet, 7 min 46 s busy: set-up 0.5-2 min,
undisturbed flow 1.5-3 min, disturbed flow with its six restarts 2-3.5 min); run with
``make test-slow``.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import yaml

from helpers import cli_env, seed_versioned_project, write_micro_params
from rlhf_core.tracking.lineage import dvc_md5

pytestmark = pytest.mark.slow

SEED = 16
CYCLES = 3
N_KILLS = 6
SLOTS = [(cycle, stage) for cycle in range(1, CYCLES + 1) for stage in ("reward", "dpo")]
"""The training children of one undisturbed run, in the order the flow starts them."""

SOAK_PARAMS = {
    "cycles": {"cycles": CYCLES, "scorer": "reward_model", "max_prompts": 24, "n_samples": 4,
               "retrain_reward": True},
    "rejection": {"num_threads": 1},
    # small steps, a checkpoint every 2: each child writes 5-6 checkpoints a kill can follow
    "dpo": {"max_steps": 12, "batch_size": 8, "warmup_steps": 1, "eval_items": 30, "save_every": 2,
            "num_threads": 1},
    "reward": {"max_steps": 10, "batch_size": 8, "warmup_steps": 1, "save_every": 2, "num_threads": 1},
    "flow": {"isolation": "process", "retries": N_KILLS, "retry_delay_s": 0.5},
}


@dataclass
class Kill:
    """One scheduled SIGKILL: the child of (cycle, stage), ``after`` s after it starts or
    ``after`` s after its ``checkpoint``-th checkpoint (``checkpoint`` 0: time from its start)."""

    cycle: int
    stage: str
    checkpoint: int
    after: float

    @property
    def slot(self) -> int:
        return SLOTS.index((self.cycle, self.stage))

    def __str__(self) -> str:
        when = f"{self.after:.2f} s after its checkpoint #{self.checkpoint}" if self.checkpoint else \
            f"{self.after:.2f} s after it starts"
        return f"cycle {self.cycle} {self.stage:<6} child, {when}"


def kill_schedule(seed: int) -> list[Kill]:
    """``N_KILLS`` kills over five of the six training children (every cycle, both stages), one
    of them twice (its retry is killed too), each at a moment drawn from ``seed``."""
    rng = random.Random(seed)
    slots = rng.sample(range(len(SLOTS)), N_KILLS - 1)
    slots.append(rng.choice(slots))
    kills = []
    for slot in sorted(slots):
        cycle, stage = SLOTS[slot]
        if rng.random() < 0.5:
            kills.append(Kill(cycle, stage, 0, round(rng.uniform(0.5, 4.0), 2)))
        else:
            kills.append(Kill(cycle, stage, rng.randint(1, 2), round(rng.uniform(0.0, 0.2), 3)))
    return kills


@dataclass
class Child:
    """A training child the watcher has seen: what it trains, and the checkpoints it wrote."""

    pid: int
    cycle: int
    stage: str
    checkpoint_dir: Path
    seen_at: float
    before: set[str]
    written: list[str] = field(default_factory=list)
    written_at: list[float] = field(default_factory=list)
    done: bool = False  # killed, or gone before its kill: no kill is aimed at it any more

    @property
    def slot(self) -> int:
        return SLOTS.index((self.cycle, self.stage))


def _alive(pid: int) -> bool:
    try:  # a zombie (dead, not yet reaped by the flow) counts as dead
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False


class Killer(threading.Thread):
    """Follows ``.alignflow/workers/<stage>.pid`` and SIGKILLs children as the schedule says."""

    def __init__(self, project: Path, schedule: list[Kill]):
        super().__init__(daemon=True)
        self.project, self.pending = project, list(schedule)
        self.children: dict[int, Child] = {}
        self.landed: list[str] = []
        self.pids: list[int] = []
        self.stop = threading.Event()

    def _identify(self, stage: str, pid: int) -> Child | None:
        """The child's cycle and checkpoint folder, from the request file its command line names."""
        try:
            request = Path((Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0"))[-3].decode())
            params = json.loads(request.read_text())["params"]
        except (OSError, IndexError, ValueError, KeyError):
            return None  # gone already, or its request not yet readable: seen on a later poll
        if stage == "dpo":  # output_dir is models/cycles/iterative_dpo/cycle_<k>
            cycle = int(Path(params["output_dir"]).name.split("_")[1])
        else:  # reward of cycle k starts once cycle k-1's policy is in place
            done = self.project / "models" / "cycles" / "iterative_dpo"
            cycle = 1 + sum((done / f"cycle_{k}" / "model.safetensors").exists() for k in range(1, CYCLES + 1))
        ckpt = self.project / params["checkpoint_dir"]
        return Child(pid, cycle, stage, ckpt, time.time(), {p.name for p in ckpt.glob("step-*")})

    def _poll(self) -> list[Child]:
        """Live children (new ones identified); each one's newly written checkpoints recorded."""
        for stage in ("reward", "dpo"):
            try:
                pid = int((self.project / ".alignflow" / "workers" / f"{stage}.pid").read_text())
            except (OSError, ValueError):
                continue
            if pid not in self.children and _alive(pid):
                child = self._identify(stage, pid)
                if child is not None:
                    self.children[pid] = child
        live = [c for c in self.children.values() if not c.done and _alive(c.pid)]
        for c in live:
            for name in sorted({p.name for p in c.checkpoint_dir.glob("step-*")} - c.before - set(c.written)):
                c.written.append(name)
                c.written_at.append(time.time())
        return live

    def _due(self, kill: Kill, child: Child) -> bool:
        if kill.checkpoint == 0:
            return time.time() >= child.seen_at + kill.after
        return len(child.written) >= kill.checkpoint and time.time() >= child.written_at[kill.checkpoint - 1] + kill.after

    def run(self) -> None:
        while self.pending and not self.stop.is_set():
            kill = self.pending[0]
            # the scheduled child, or the next one if it finished before its moment came
            child = next((c for c in sorted(self._poll(), key=lambda c: c.seen_at) if c.slot >= kill.slot), None)
            if child is not None and self._due(kill, child):
                try:
                    os.kill(child.pid, signal.SIGKILL)
                except ProcessLookupError:  # it exited this very moment: the kill moves to the next child
                    child.done = True
                    continue
                child.done = True
                self.pids.append(child.pid)
                self.pending.pop(0)
                self.landed.append(f"{kill}: killed pid {child.pid} (cycle {child.cycle} {child.stage}) "
                                   f"{time.time() - child.seen_at:.2f} s after it started, checkpoints it wrote: "
                                   f"{child.written or 'none'}")
            time.sleep(0.01)


def _seed_project(root: Path, remote: Path) -> None:
    """A git + DVC project (local remote) with micro data, an SFT model and a reward model."""
    params_file = write_micro_params(root)
    params = yaml.safe_load(params_file.read_text())
    for section, values in SOAK_PARAMS.items():
        params[section].update(values)
    params_file.write_text(yaml.safe_dump(params, sort_keys=False))
    seed_versioned_project(root, remote)


def _start_flow(project: Path, api: str) -> subprocess.Popen:
    env = {**cli_env(project), "PREFECT_API_URL": api, "OMP_WAIT_POLICY": "PASSIVE",
           "PREFECT_HOME": str(project / ".prefect-client")}
    return subprocess.Popen([sys.executable, "-m", "flows.cli", "flow", "iterative_dpo", "--cycles", str(CYCLES)],
                            cwd=project, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _finish(proc: subprocess.Popen) -> str:
    log = proc.communicate(timeout=1500)[0]
    assert proc.returncode == 0, log[-6000:]
    return log


def _outcome(project: Path) -> dict:
    """What must not depend on kills: per cycle the stage runs' ``eval/*``, the cycle run's metrics and
    the summary's model md5 and accuracy; the champion's version and model md5."""
    from mlflow.tracking import MlflowClient

    summary = json.loads((project / "metrics" / "iterative_dpo_summary.json").read_text())
    client = MlflowClient(tracking_uri=f"sqlite:///{project / 'mlflow.db'}")
    runs = client.search_runs([client.get_experiment_by_name("alignflow-test").experiment_id], max_results=1000)
    cycle_runs = {r.info.run_id: r for r in runs if r.info.run_name.startswith("cycle-")}
    out: dict = {"cycles": {}}
    for run_id, run in cycle_runs.items():
        stages = [r for r in runs if r.data.tags.get("mlflow.parentRunId") == run_id and r.info.run_name in ("dpo", "reward")]
        assert sorted(r.info.run_name for r in stages) == ["dpo", "reward"], [r.info.run_name for r in stages]
        assert all(r.info.status == "FINISHED" for r in stages)  # a retry continues the killed attempt's run
        out["cycles"][run.data.tags["alignflow.cycle"]] = {
            "cycle_metrics": run.data.metrics,
            **{r.info.run_name: {k: v for k, v in r.data.metrics.items() if k.startswith("eval/")} for r in stages}}
    for h in summary["cycles"]:
        out["cycles"][str(h["cycle"])]["summary"] = {k: h[k] for k in ("model_md5", "accuracy", "accuracy_stderr",
                                                                       "data_md5")}
        assert dvc_md5(project / h["model"]) == h["model_md5"]
    champion = client.get_model_version_by_alias("alignflow-policy", "champion")
    out["champion"] = {"version": champion.version,
                       "md5": client.get_run(champion.run_id).data.tags["dvc.md5.output_model"]}
    out["flow_run_id"] = next(r for r in runs if r.info.run_name == "iterative_dpo").data.tags["prefect.flow_run_id"]
    return out


def _resumed_steps(project: Path) -> dict[str, list[int]]:
    """Per cycle and stage, the checkpoint steps its retries resumed from (MLflow's
    ``checkpoint/resumed_from_step``): a retry that started over logs none."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{project / 'mlflow.db'}")
    runs = client.search_runs([client.get_experiment_by_name("alignflow-test").experiment_id], max_results=1000)
    cycle_of = {r.info.run_id: r.data.tags["alignflow.cycle"] for r in runs if r.info.run_name.startswith("cycle-")}
    return {f"cycle {cycle_of[r.data.tags['mlflow.parentRunId']]} {r.info.run_name}":
            [int(m.value) for m in client.get_metric_history(r.info.run_id, "checkpoint/resumed_from_step")]
            for r in runs if r.info.run_name in ("dpo", "reward") and r.data.tags.get("mlflow.parentRunId") in cycle_of}


def _training_attempts(api: str, flow_run_id: str) -> dict[str, tuple[int, list[str]]]:
    """Per training task run of the flow run: how many times it ran, and its states' names."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId
    from prefect.settings import PREFECT_API_URL, temporary_settings

    async def fetch():
        async with get_client() as client:
            runs = await client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id])))
            return {r.name: (r.run_count, [s.name for s in await client.read_task_run_states(r.id)])
                    for r in runs if r.name.startswith(("train-dpo", "train-reward-model"))}

    with temporary_settings({PREFECT_API_URL: api}):
        return asyncio.run(fetch())


def test_iterative_dpo_survives_seeded_sigkills(tmp_path, prefect_api):
    started = time.time()
    seed = tmp_path / "seed"
    seed.mkdir()
    _seed_project(seed, tmp_path / "dvc-remote")
    skip = shutil.ignore_patterns("mlflow.db", "mlartifacts", ".alignflow", ".prefect*")
    calm, stormy = tmp_path / "undisturbed", tmp_path / "disturbed"
    shutil.copytree(seed, calm, symlinks=True, ignore=skip)
    shutil.copytree(seed, stormy, symlinks=True, ignore=skip)
    set_up = time.time()

    _finish(_start_flow(calm, prefect_api))
    expected = _outcome(calm)
    calm_done = time.time()

    schedule = kill_schedule(SEED)
    print(f"\nkill schedule (seed {SEED}, flow.retries {N_KILLS}):\n  " + "\n  ".join(map(str, schedule)))
    killer = Killer(stormy, schedule)
    proc = _start_flow(stormy, prefect_api)
    killer.start()
    try:
        log = _finish(proc)
    finally:
        killer.stop.set()
        killer.join(timeout=10)
    print("kills that landed:\n  " + "\n  ".join(killer.landed))
    assert not killer.pending, f"the flow ended before kills {killer.pending} could land"
    assert len(killer.landed) == N_KILLS >= 5

    got = _outcome(stormy)
    assert got["champion"] == expected["champion"]
    assert got["cycles"] == expected["cycles"]
    attempts = _training_attempts(prefect_api, got["flow_run_id"])
    assert len(attempts) == 2 * CYCLES, sorted(attempts)
    assert sum(n - 1 for n, _ in attempts.values()) == N_KILLS, attempts  # one Prefect retry per kill
    assert sum(names.count("AwaitingRetry") for _, names in attempts.values()) == N_KILLS, attempts
    for pid in killer.pids:  # each retry was for one of our kills, as the task's error said
        assert f"training process {pid} killed by SIGKILL" in log, log[-6000:]
    resumed = {stage: steps for stage, steps in _resumed_steps(stormy).items() if steps}
    assert any(step > 0 for steps in resumed.values() for step in steps), resumed  # not only restarts from step 0
    print(f"retries resumed from checkpoints: {resumed}")
    print(f"champion v{got['champion']['version']} md5 {got['champion']['md5']}; every cycle's eval equal. "
          f"set-up {set_up - started:.0f} s, undisturbed flow {calm_done - set_up:.0f} s, "
          f"disturbed flow {time.time() - calm_done:.0f} s")
