"""Children in fresh processes: a child's entry (:func:`child_main`), the parent's launcher (:func:`run_child`,
nvidia-smi sampled beside it) and TRL's gradient-checkpointing choice for a row.
"""

from __future__ import annotations

import functools
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from .settings import NO_MULTICAST, REPO, ROWS, SETTINGS
from .hygiene import child_env
from .inputs import build_model
from .measure import child_logging, measure_ceiling, peak_writer, read_peaks
from .ours import ours
from .trl_side import trl_side

SCRIPT = REPO / "bench" / "side_by_side.py"  # what every child runs (with --child)


def child_main(kind: str, task: dict) -> None:
    child_logging()
    flush = peak_writer(os.environ.get("BENCH_PEAK_DIR"))
    fn = {"alignflow": ours, "trl": trl_side, "ceiling": measure_ceiling, "build": build_model}[kind]
    result = fn(task if kind in ("alignflow", "trl") else task["inputs"])
    if kind in ("alignflow", "trl"):
        import torch

        result["device"] = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
    flush()
    if int(os.environ.get("RANK", "0")) == 0:
        print(json.dumps({"result": result}), flush=True)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("", 0))
        return sock.getsockname()[1]


def trl_launch_command(inputs: dict) -> list[str]:
    """The TRL side's launcher on several GPUs: accelerate with the script's ZeRO-3 file."""
    return [sys.executable, "-m", "accelerate.commands.launch", "--num_processes", str(inputs["gpus"]),
            "--num_machines", "1", "--use_deepspeed", "--deepspeed_config_file", inputs["deepspeed_config"],
            "--zero3_init_flag", "true", "--main_process_port", str(_free_port())]


def run_child(kind: str, task: dict, timeout_s: float) -> dict:
    """One fresh child process; its result line, the gradient-checkpointing lines it logged, peak memory
    of every process it started (per GPU) and nvidia-smi's peak per GPU."""
    inputs = task["inputs"]
    peak_dir = Path(tempfile.mkdtemp(prefix="bench-peaks-"))
    launcher = [sys.executable]
    if kind == "trl" and inputs["gpus"] > 1 and not inputs["small"]:
        launcher = trl_launch_command(inputs)
    cmd = launcher + [str(SCRIPT), "--child", kind, "--task", json.dumps(task)]
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "BENCH_PEAK_DIR": str(peak_dir), **NO_MULTICAST}
    if "alloc_conf" in inputs:  # one thread count and allocator for every child of the call (hygiene)
        env.update(child_env(SETTINGS[inputs["variant"]]["threads"], inputs["alloc_conf"]))
    scratch = None
    if kind in ("alignflow", "trl"):
        # A training child's outputs and checkpoints go to its own temporary folder, removed when it ends: left
        # behind, a 1.5B run's (6 GB model, 21 GB mixed-precision checkpoint) filled the disk by the fifth row.
        scratch = Path(tempfile.mkdtemp(prefix="bench-child-"))
        env["TMPDIR"] = str(scratch)
    smi = None
    smi_log = peak_dir / "nvidia-smi.csv"  # a file, not a pipe: a full pipe would stall the sampler
    if kind in ("alignflow", "trl") and has_nvidia_smi():
        with smi_log.open("w") as fh:
            smi = subprocess.Popen(["nvidia-smi", "--query-gpu=index,memory.used", "--format=csv,noheader,nounits",
                                    "-lms", "200"], stdout=fh, text=True)
    started = time.perf_counter()
    try:
        proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, env=env, timeout=timeout_s)
        stdout, stderr, rc = proc.stdout, proc.stderr, proc.returncode
    except subprocess.TimeoutExpired as exc:
        stdout, stderr, rc = _text(exc.stdout), _text(exc.stderr) + f"\n[bench] timed out after {timeout_s} s", -9
    wall = time.perf_counter() - started
    if scratch is not None:
        shutil.rmtree(scratch, ignore_errors=True)
    used: dict[str, float] = {}
    if smi is not None:
        smi.terminate()
        smi.wait()
        for line in smi_log.read_text().splitlines():
            try:
                idx, mib = (x.strip() for x in line.split(","))
                used[idx] = max(used.get(idx, 0.0), float(mib) / 1024)
            except ValueError:  # a line cut short when the sampler was stopped
                continue
    lines = [ln for ln in stdout.splitlines() if ln.startswith("{\"result\"")]
    if os.environ.get("BENCH_CHILD_LOG_DIR"):  # whole stderr of every child (the result keeps its last 4,000 chars)
        log_dir = Path(os.environ["BENCH_CHILD_LOG_DIR"])
        log_dir.mkdir(parents=True, exist_ok=True)
        label = "-".join(str(x) for x in (kind, task.get("bench", ""), task.get("row", ""), task.get("round", "")) if x)
        (log_dir / f"{label}-{int(started)}.log").write_text(stderr)
    if rc != 0 or not lines:
        # the steps it printed before it failed or was cut off (never summarised as a row: the bench's own
        # figures need a finished child; these are for reading what happened)
        partial = [json.loads(ln)["partial_step"] for ln in stdout.splitlines() if ln.startswith("{\"partial_step\"")]
        return {"error": f"exit {rc}: {stderr[-4000:]}", "wall_s": round(wall, 1),
                **({"partial_steps": partial} if partial else {})}
    result = json.loads(lines[-1])["result"]
    result["wall_s"] = round(wall, 1)
    if kind in ("alignflow", "trl"):
        by_device, concurrent = read_peaks(peak_dir)
        gpus = {k: v for k, v in by_device.items() if not k.startswith("host:")}
        by_device = gpus or by_device  # a Ray driver's host memory is no GPU's
        result["peak_memory_gb_by_device"] = {k: round(v, 3) for k, v in by_device.items()}
        result["peak_memory_gb"] = max([result["peak_memory_gb"], *by_device.values()])
        if concurrent:
            result["peak_memory_gb_concurrent_by_device"] = {k: round(v, 3) for k, v in concurrent.items()}
            result["peak_memory_gb_concurrent"] = max(concurrent.values())
        if used:
            result["nvidia_smi_peak_used_gb_by_gpu"] = {k: round(v, 2) for k, v in sorted(used.items())}
        found = re.findall(r"gradient_checkpointing(?: auto)?: (on|off)[^\n]*", stdout + "\n" + stderr)
        logged = re.search(r"gradient_checkpointing(?: auto)?: (?:on|off)[^\n]*", stdout + "\n" + stderr)
        if kind == "alignflow":
            result["gradient_checkpointing"] = ({"on": found[0] == "on", "log": logged.group(0), "ranks_logged": len(found)}
                                                if found else {"on": None, "log": "no gradient_checkpointing line logged"})
    return result


def _text(x) -> str:
    return x.decode(errors="replace") if isinstance(x, bytes) else (x or "")


@functools.cache
def has_nvidia_smi() -> bool:
    try:
        return subprocess.run(["nvidia-smi", "-L"], capture_output=True, timeout=30).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def trl_checkpointing(row: str, decided: dict[str, bool], mode: str) -> dict:
    """TRL's gradient_checkpointing for ``row``: ours' logged choice in the same regime (else any ours
    row's) once known (``match``), else TRL's default (on); or forced on/off."""
    if mode in ("on", "off"):
        return {"on": mode == "on", "source": f"--trl-grad-ckpt {mode}"}
    regime = ROWS[row]["regime"]
    same = [r for r in decided if ROWS[r]["regime"] == regime]
    if same:
        return {"on": decided[same[0]], "source": f"matches {same[0]}'s logged choice"}
    if decided:
        first = next(iter(decided))
        return {"on": decided[first], "source": f"matches {first}'s logged choice (no ours row of this regime yet)"}
    return {"on": True, "source": "TRL default (no ours row had run yet)"}
