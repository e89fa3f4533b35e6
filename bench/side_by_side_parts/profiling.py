"""The ours rows' metric sinks and ``--profile`` / ``--sync-census``: torch.profiler over training steps or over one
call of an RL phase, summarised as device busy time, top ops and the idle gaps between kernels.
"""

from __future__ import annotations

import functools
import json
import math
import time


class Sink:
    def __init__(self) -> None:
        self.rows: list[tuple[int, dict]] = []

    def log_metrics(self, metrics: dict, step: int) -> None:
        self.rows.append((step, dict(metrics)))
        if "perf/step_s" in metrics:  # as it happens: a child cut off at its limit keeps its steps (run_child)
            print(json.dumps({"partial_step": {k: v for k, v in metrics.items() if k.startswith("perf/")}}),
                  flush=True)


    def close(self) -> None:
        pass


class ProfilingSink(Sink):
    """``--profile``: torch.profiler over ``active`` training steps after ``skip`` (a step ends when the loop
    logs it, so ``prof.step()`` runs there). The summary: wall seconds per profiled step, the device's busy
    seconds in them (sum of kernel and copy times, one stream at a time here) and the top ops by device and
    by host time. A profiled row's step times carry the profiler's overhead: not for the figures."""

    def __init__(self, spec: dict) -> None:
        from torch.profiler import ProfilerActivity, profile, schedule

        super().__init__()
        self.active = int(spec.get("active", 3))
        self.prof = profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA],
                            schedule=schedule(wait=int(spec.get("skip", 2)), warmup=1, active=self.active),
                            on_trace_ready=self._ready)
        self.summary: dict = {}
        self.marks: list[float] = []
        self.prof.start()

    def log_metrics(self, metrics: dict, step: int) -> None:
        super().log_metrics(metrics, step)
        self._mark(metrics)

    def _mark(self, metrics: dict) -> None:
        """A logged step ends the profiler's step (and its wall time is kept for the summary)."""
        if "perf/elapsed_s" in metrics:
            self.marks.append(metrics["perf/elapsed_s"])
            self.prof.step()

    def _ready(self, prof) -> None:
        try:
            self._summarize(prof)
        except Exception as exc:  # noqa: BLE001 -- a profile that cannot be read must not cost the row
            self.summary = {"error": f"{type(exc).__name__}: {exc}"}

    def _summarize(self, prof) -> None:
        events = prof.key_averages()
        # steps actually profiled (fewer than ``active`` when the run ends first: a short --small run)
        n = next((e.count for e in events if e.key.startswith("ProfilerStep")), self.active) or self.active
        walls = [b - a for a, b in zip(self.marks, self.marks[1:])][-n:]
        self.summary = {"active_steps": n, **profile_summary(prof, walls, n)}

    def close(self) -> None:
        self.prof.stop()


class ForwardingProfiler(ProfilingSink):
    """:class:`ProfilingSink` on rank 0 of Ray ranks: the metrics also go on to the rank's own sink (the queue
    to the driver), and the partial-step lines are not printed (an actor's stdout is not the child's)."""

    def __init__(self, spec: dict, inner) -> None:
        super().__init__(spec)
        self.inner = inner

    def log_metrics(self, metrics: dict, step: int) -> None:
        self.inner.log_metrics(metrics, step)
        self._mark(metrics)


def profile_summary(prof, walls: list[float], n: int) -> dict:
    """A profile of ``n`` steps of wall seconds ``walls``: the device's busy seconds a step (kernels and
    copies, annotations left out), the top ops by device and by host time, and the idle gaps."""
    from torch.autograd import DeviceType

    events = prof.key_averages()
    # kernels (and copies); ops' own device time repeats these, annotations span them
    kernels = [e for e in events if e.device_type == DeviceType.CUDA and not _annotation(e.key)]
    device_us = sum(e.self_device_time_total for e in kernels)
    by_device = sorted(kernels, key=lambda e: -e.self_device_time_total)[:25]
    by_host = sorted(events, key=lambda e: -e.self_cpu_time_total)[:15]
    return {"step_wall_s": [round(w, 4) for w in walls],
            "device_busy_s_per_step": round(device_us / 1e6 / n, 4),
            "device_busy_share": round(device_us / 1e6 / max(sum(walls), 1e-9), 3),
            "top_device_ops": [{"op": e.key[:90], "calls": e.count // n,
                                "device_ms_per_step": round(e.self_device_time_total / 1e3 / n, 3)}
                               for e in by_device],
            "top_host_ops": [{"op": e.key[:90], "calls": e.count // n,
                              "host_ms_per_step": round(e.self_cpu_time_total / 1e3 / n, 3)}
                             for e in by_host],
            "device_ms_per_step_by_category": by_category(((e.key, e.self_device_time_total) for e in kernels), n),
            "device_idle": _idle_gaps(prof.events(), n)}


# Kernel categories by name, the first pattern that matches (attention before matmul: cuDNN's attention kernels
# carry "wgmma" too; log-softmax before the inductor-fused catch-all: a fused log-softmax is named after it).
# "cache writes" are index_copy kernels: the decode step's K/V columns, and the sampler's two record columns.
CATEGORIES: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("attention", ("flash", "fmha", "attention", "sdpa")),
    ("matmul", ("nvjet", "gemm", "gemv", "cutlass", "xmma", "splitk")),
    ("log-softmax, loss, sampling", ("softmax", "cross_entropy", "logsumexp", "scan", "searchsorted", "cumsum",
                                     "gather", "sort", "topk")),
    ("optimizer", ("adam", "multi_tensor", "foreach", "lerp", "_amp_")),
    ("cache writes (index_copy)", ("index_copy",)),
    ("copies, fills", ("memcpy", "memset", "direct_copy", "copy_kernel", "catarraybatchedcopy", "fill_kernel",
                       "fillfunctor")),
    ("norms, rotary, activations, other elementwise", ("triton_", "elementwise", "norm", "reduce", "silu",
                                                          "cat", "index")),
)


def category(name: str) -> str:
    """A kernel's category (:data:`CATEGORIES`), ``other`` where no pattern matches."""
    low = name.lower()
    return next((c for c, pats in CATEGORIES if any(p in low for p in pats)), "other")


def by_category(kernels, n: int) -> dict[str, float]:
    """Device milliseconds a step by :func:`category`, from ``(kernel name, device microseconds)`` pairs over
    ``n`` steps; largest first."""
    out: dict[str, float] = {}
    for name, us in kernels:
        out[category(name)] = out.get(category(name), 0.0) + us / 1e3 / n
    return {k: round(v, 3) for k, v in sorted(out.items(), key=lambda kv: -kv[1])}


# The RL phases a watch can wrap (``--profile-phase``): the module, class and method that runs each one in this
# process (the rollout: the static engine's generate, what rl's rollout phase times on a GPU).
WATCHED = {"update": ("rlhf_core.trainers.rl_roles", "PolicyLearner", "update"),
           "reference": ("rlhf_core.trainers.rl_roles", "ReferenceScorer", "logprobs"),
           "rollout": ("rlhf_core.rollout.static", "StaticCacheEngine", "generate")}


class _UpdateWatch:
    """Something run around one call of an RL phase of this process (``spec["phase"]``: the policy update by
    default, or the reference pass; the ``skip + 1``-th call, past compiles and warm-up): :meth:`around` gets the
    call as ``run`` and leaves its findings in ``summary`` under ``key``."""

    key = ""

    def __init__(self, spec: dict) -> None:
        self.at = int(spec.get("skip", 2)) + 1
        self.phase = spec.get("phase", "update")
        self.summary: dict = {}

    def install(self) -> None:
        import importlib

        module, cls, method = WATCHED[self.phase]
        owner = getattr(importlib.import_module(module), cls)
        original, calls, around = getattr(owner, method), [0], self.around

        def watched(role, *args, **kwargs):
            calls[0] += 1
            run = functools.partial(original, role, *args, **kwargs)
            return around(run) if calls[0] == self.at else run()

        setattr(owner, method, watched)

    def around(self, run):
        raise NotImplementedError


class UpdateProfile(_UpdateWatch):
    """``--profile`` on the grpo bench: torch.profiler over one call of an RL phase (``--profile-phase``: the update
    by default), summarised as the offline rows' steps are, under ``<phase>_profile``. One process (no Ray ranks).
    The profiled step's times carry the profiler's overhead: not for the figures."""

    def __init__(self, spec: dict) -> None:
        super().__init__(spec)
        self.key = f"{self.phase}_profile"  # update_profile, reference_profile, rollout_profile

    def around(self, run):
        import torch
        from torch.profiler import ProfilerActivity, profile

        cuda = torch.cuda.is_available()
        sync = torch.cuda.synchronize if cuda else (lambda: None)
        sync()
        start = time.perf_counter()
        with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])) as prof:
            out = run()
            sync()
        wall = time.perf_counter() - start
        try:
            self.summary = {"phase": self.phase, "update_call": self.at, **profile_summary(prof, [wall], 1)}
            # the rollout engine's switches after the call: a capture that failed under the profiler decodes eagerly
            owner = run.args[0] if run.args else None
            flags = {a: getattr(owner, a) for a in ("cuda_graphs", "compile_layers", "triton_attention")
                     if hasattr(owner, a)}
            if flags:
                self.summary["engine_after"] = flags
        except Exception as exc:  # noqa: BLE001 -- a profile that cannot be read must not cost the row
            self.summary = {"error": f"{type(exc).__name__}: {exc}"}
        return out


class UpdateSyncCensus(_UpdateWatch):
    """``--sync-census`` on the grpo bench: every wait of the host for the device during one update call, counted
    by where it was made. Runs the call under ``torch.cuda.set_sync_debug_mode("warn")`` (a host read of a device
    value, a blocking copy, a ``nonzero`` warns) and keeps, for each warning, the innermost frames outside torch's
    own files (no transformers frame shows in the lent image's census: its files seem to sit under a ``/torch/``
    path there, so a wait inside transformers is named by the caller of the model). One process, GPU only (a CPU never waits); the row's times then carry the warnings' cost: not
    for the figures."""

    key = "update_sync_census"

    def around(self, run):
        import collections
        import traceback
        import warnings

        import torch

        if not torch.cuda.is_available():
            self.summary = {"error": "no CUDA device: a CPU run has no waits to count"}
            return run()
        where: collections.Counter = collections.Counter()

        def record(message, category, filename, lineno, file=None, line=None):
            if "synchroniz" not in str(message):
                return
            frames = [f for f in traceback.extract_stack()[:-1]
                      if "/torch/" not in f.filename and "/warnings.py" not in f.filename]
            where[" < ".join(f"{f.filename.split('/')[-1]}:{f.lineno}" for f in frames[-3:][::-1])] += 1

        torch.cuda.synchronize()
        with warnings.catch_warnings():
            warnings.simplefilter("always")
            warnings.showwarning = record
            torch.cuda.set_sync_debug_mode("warn")
            try:
                out = run()
            finally:
                torch.cuda.set_sync_debug_mode("default")
        self.summary = {"update_call": self.at, "waits": sum(where.values()),
                        "where": dict(where.most_common())}
        return out


def _annotation(name: str) -> bool:
    """A profiler range drawn on the device timeline (``ProfilerStep#``, ``Optimizer.step#...``), not a kernel."""
    return name.startswith("ProfilerStep") or "#" in name


def _idle_gaps(events, steps: int, top: int = 12) -> dict:
    """Where the device waited: gaps between consecutive kernels (their union) over the profiled steps, with
    the host ops running during each of the largest (what the host was doing while the device sat idle)."""
    from torch.autograd import DeviceType

    kern = sorted((e.time_range.start, e.time_range.end, e.name) for e in events
                  if e.device_type == DeviceType.CUDA and not _annotation(e.name))
    if not kern:
        return {}
    host = [(e.time_range.start, e.time_range.end, e.name) for e in events
            if e.device_type == DeviceType.CPU and not e.name.startswith("ProfilerStep")]
    gaps, end, before = [], kern[0][1], kern[0][2]
    for start, stop, name in kern[1:]:
        if start > end:
            gaps.append((start - end, end, start, before, name))
        if stop > end:
            end, before = stop, name
    span = kern[-1][1] - kern[0][0]
    idle = sum(g[0] for g in gaps)

    def during(a: float, b: float) -> list[str]:
        overlap: dict[str, float] = {}
        for s0, s1, name in host:
            o = min(b, s1) - max(a, s0)
            if o > 0.5 * (b - a):  # ran through most of the gap
                overlap[name] = min(overlap.get(name, math.inf), s1 - s0)
        return [k[:60] for k, _ in sorted(overlap.items(), key=lambda kv: kv[1])[:4]]  # innermost first

    sizes = {"under_10us": (0, 10), "10_100us": (10, 100), "100us_1ms": (100, 1000), "over_1ms": (1000, math.inf)}
    return {"span_ms_per_step": round(span / 1e3 / steps, 2), "idle_ms_per_step": round(idle / 1e3 / steps, 2),
            # launch latency between a graph's kernels sits in the smallest gaps; the host's own work in the largest
            "idle_ms_per_step_by_gap": {k: round(sum(g[0] for g in gaps if a <= g[0] < b) / 1e3 / steps, 3)
                                        for k, (a, b) in sizes.items()},
            "gaps_per_step": round(len(gaps) / steps, 1),
            "gaps_over_100us_per_step": round(sum(g[0] > 100 for g in gaps) / steps, 1),
            "idle_in_gaps_over_1ms_per_step": round(sum(g[0] for g in gaps if g[0] > 1000) / 1e3 / steps, 2),
            "largest": [{"ms": round(g[0] / 1e3, 2), "after": g[3][:60], "before": g[4][:60],
                         "host_during": during(g[1], g[2])} for g in sorted(gaps, reverse=True)[:top]]}
