"""Harness hygiene, enforced: the minimum steps and rounds a call may publish, the thread, allocator and
attention-backend settings every child runs under (and the record of what was in effect), the spread of a
row's steps (median, min, max; a row whose max/min exceeds :data:`FLAG_SPREAD` is flagged) and the call's
deadline.

A call below the minimums is refused before any child starts, unless ``--waive-hygiene`` (then the result file
says so). Pure functions over plain lists and dicts, so tests/unit/test_bench_hygiene.py runs them on a CPU.
"""

from __future__ import annotations

import os
import statistics
import time

# Warm-up steps every child drops, timed steps a row needs over all its rounds, ABBA rounds a call needs
MIN_WARMUP = 2
MIN_TIMED = {"grpo": 5, "sft": 8, "dpo": 8, "rm": 8}
MIN_ROUNDS = 2
SEARCH_MIN_ROUNDS = 1  # the TRL search ranks configurations; the side-by-side call then times the winner in ABBA
FLAG_SPREAD = 1.5  # max / min of a row's timed steps above this: the row is flagged and profiled

# SDPA backends a child runs with. ``ours``: what alignflow's trainers set on a GPU (cuDNN's SDPA off,
# rlhf_core.models.lm_head.prepare_decoder_kernels); ``torch-default``: torch's own (every backend on).
SDPA = {"ours": {"flash": True, "mem_efficient": True, "math": True, "cudnn": False},
        "torch-default": {"flash": True, "mem_efficient": True, "math": True, "cudnn": True}}


def plan_problems(benches: dict[str, int], warmup: int, rounds: int, search: bool = False) -> list[str]:
    """What a call of ``benches`` (name -> steps per child), ``warmup`` and ``rounds`` lacks against the
    minimums; empty when it may run."""
    problems = []
    if warmup < MIN_WARMUP:
        problems.append(f"--warmup {warmup}: at least {MIN_WARMUP} warm-up steps per child")
    need_rounds = SEARCH_MIN_ROUNDS if search else MIN_ROUNDS
    if rounds < need_rounds:
        problems.append(f"--rounds {rounds}: at least {need_rounds} ABBA rounds")
    for name, steps in benches.items():
        timed = max(steps - warmup, 0) * rounds
        if timed < MIN_TIMED[name]:
            problems.append(f"{name}: {timed} timed steps a row ({rounds} rounds x ({steps} steps - {warmup} "
                            f"warm-up)); at least {MIN_TIMED[name]}")
    return problems


def enforce(problems: list[str], waive: bool) -> dict:
    """Refuse a call with ``problems`` (SystemExit) unless ``waive``; the record the result file keeps."""
    if problems and not waive:
        raise SystemExit("refused by the harness's hygiene minimums (--waive-hygiene to run anyway, recorded):\n  "
                         + "\n  ".join(problems))
    return {"minimums": {"warmup": MIN_WARMUP, "timed_steps": MIN_TIMED, "rounds": MIN_ROUNDS,
                         "flag_max_over_min": FLAG_SPREAD},
            "problems": problems, "waived": bool(problems and waive)}


def spread(times: list[float]) -> dict:
    """Median, min, max and max/min of a row's timed steps; ``flagged`` when max/min > :data:`FLAG_SPREAD`."""
    if not times:
        return {}
    lo, hi = min(times), max(times)
    ratio = hi / lo if lo > 0 else float("inf")
    return {"median_step_s": round(statistics.median(times), 4), "min_step_s": round(lo, 4),
            "max_step_s": round(hi, 4), "max_over_min": round(ratio, 3), "flagged": ratio > FLAG_SPREAD}


def extreme_steps(times: list[float], warmup: int) -> dict:
    """Indices (into ``times``) of the slowest and fastest timed step, past ``warmup``."""
    timed = list(enumerate(times))[warmup:]
    if not timed:
        return {}
    return {"slowest": max(timed, key=lambda x: x[1])[0], "fastest": min(timed, key=lambda x: x[1])[0]}


def child_env(threads: int, alloc_conf: str) -> dict[str, str]:
    """The environment every child gets: one thread count and one allocator setting for the whole call."""
    return {"OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads), "PYTORCH_CUDA_ALLOC_CONF": alloc_conf}


def apply_backend(threads: int, sdpa: str) -> None:
    """In a child, before its model is built: torch's intra-op threads and the SDPA backends of ``sdpa``
    (a key of :data:`SDPA`). Ours' trainers set cuDNN off again themselves; the state in effect at the end of
    the run is what :func:`backend_state` records."""
    import torch

    torch.set_num_threads(threads)
    flags = SDPA[sdpa]
    torch.backends.cuda.enable_flash_sdp(flags["flash"])
    torch.backends.cuda.enable_mem_efficient_sdp(flags["mem_efficient"])
    torch.backends.cuda.enable_math_sdp(flags["math"])
    torch.backends.cuda.enable_cudnn_sdp(flags["cudnn"])


def backend_state() -> dict:
    """The settings in effect in this process now (a child records it after its run)."""
    import torch

    b = torch.backends.cuda
    return {"intra_op_threads": torch.get_num_threads(), "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS"),
            "PYTORCH_CUDA_ALLOC_CONF": os.environ.get("PYTORCH_CUDA_ALLOC_CONF"),
            "sdpa": {"flash": b.flash_sdp_enabled(), "mem_efficient": b.mem_efficient_sdp_enabled(),
                     "math": b.math_sdp_enabled(), "cudnn": b.cudnn_sdp_enabled()}}


def compare_rows(states: dict[str, dict]) -> dict:
    """Across the rows of one benchmark (row -> :func:`backend_state` of its children): whether threads and
    allocator were one setting everywhere, and each row's SDPA backends."""
    seen = {k: {row: s.get(k) for row, s in states.items() if s}
            for k in ("intra_op_threads", "OMP_NUM_THREADS", "PYTORCH_CUDA_ALLOC_CONF")}
    same = {k: len({str(v) for v in vals.values()}) <= 1 for k, vals in seen.items()}
    problems = [f"{k} differs between rows: {seen[k]}" for k, ok in same.items() if not ok]
    return {"same": same, "problems": problems,
            "sdpa": {row: s.get("sdpa") for row, s in states.items() if s}}


def same_backend(a: dict | None, b: dict | None) -> bool | None:
    """Whether two rows ran the same SDPA backends (None when either did not record them)."""
    if not a or not b or not a.get("sdpa") or not b.get("sdpa"):
        return None
    return a["sdpa"] == b["sdpa"]


class Deadline:
    """``--deadline-s``: stop launching children once the next would end past it, leaving time to write."""

    def __init__(self, seconds: float, started: float | None = None) -> None:
        self.seconds, self.started = seconds, time.perf_counter() if started is None else started
        self.skipped: list[str] = []

    def left(self) -> float:
        return float("inf") if not self.seconds else self.seconds - (time.perf_counter() - self.started)

    def allows(self, estimate_s: float, what: str) -> bool:
        """Whether a child estimated at ``estimate_s`` ends before the deadline; if not it is recorded skipped."""
        if self.left() > estimate_s:
            return True
        self.skipped.append(what)
        return False

    def record(self) -> dict:
        return {"deadline_s": self.seconds, "skipped": self.skipped, "stopped_early": bool(self.skipped)}
