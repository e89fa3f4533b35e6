"""A profile of every timed step of one child, one torch.profiler window a step, of which the slowest and the
fastest are kept: what a flagged row (max/min step > hygiene.FLAG_SPREAD) spends its slow steps on. The harness
runs one more child of a flagged row with it on (its step times carry the profiler's overhead: not figures).
"""

from __future__ import annotations


class StepProfiles:
    """``begin()`` before a step, ``end(step_s)`` after it (device synchronised); ``extremes()`` at the end."""

    def __init__(self, top: int = 12) -> None:
        self.top = top
        self.steps: list[dict] = []
        self.prof = None

    def begin(self) -> None:
        from torch.profiler import ProfilerActivity, profile

        import torch

        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
        self.prof = profile(activities=acts)
        self.prof.__enter__()

    def end(self, step_s: float) -> None:
        if self.prof is None:
            return
        self.prof.__exit__(None, None, None)
        try:
            summary = self._summary(self.prof)
        except Exception as exc:  # noqa: BLE001 -- a profile that cannot be read must not cost the row
            summary = {"error": f"{type(exc).__name__}: {exc}"}
        self.steps.append({"index": len(self.steps), "step_s": round(step_s, 4), **summary})
        self.prof = None

    def stop(self) -> None:
        """The window opened after the last step (never ended by a step) is closed unread."""
        if self.prof is not None:
            self.prof.__exit__(None, None, None)
            self.prof = None

    def _summary(self, prof) -> dict:
        from torch.autograd import DeviceType

        events = prof.key_averages()
        kernels = [e for e in events if e.device_type == DeviceType.CUDA]
        device_us = sum(e.self_device_time_total for e in kernels)
        by_device = sorted(kernels, key=lambda e: -e.self_device_time_total)[:self.top]
        by_host = sorted(events, key=lambda e: -e.self_cpu_time_total)[:self.top]
        return {"device_busy_s": round(device_us / 1e6, 4),
                "top_device_ops": [{"op": e.key[:90], "calls": e.count,
                                    "device_ms": round(e.self_device_time_total / 1e3, 3)} for e in by_device],
                "top_host_ops": [{"op": e.key[:90], "calls": e.count,
                                  "host_ms": round(e.self_cpu_time_total / 1e3, 3)} for e in by_host]}

    def extremes(self, warmup: int = 0) -> dict:
        """The slowest and the fastest profiled step past ``warmup``, and every step's time."""
        timed = self.steps[warmup:] or self.steps
        if not timed:
            return {}
        return {"step_s": [s["step_s"] for s in self.steps], "warmup": warmup,
                "slowest": max(timed, key=lambda s: s["step_s"]), "fastest": min(timed, key=lambda s: s["step_s"])}


def step_profiling_sink():
    """Ours' sink with :class:`StepProfiles` on: a logged step (``perf/elapsed_s``) ends one window, opens the next."""
    from .profiling import Sink

    class StepProfilingSink(Sink):
        def __init__(self) -> None:
            super().__init__()
            self.profiles = StepProfiles()
            self.last = 0.0
            self.profiles.begin()

        def log_metrics(self, metrics: dict, step: int) -> None:
            super().log_metrics(metrics, step)
            if "perf/elapsed_s" in metrics:
                self.profiles.end(metrics["perf/elapsed_s"] - self.last)
                self.last = metrics["perf/elapsed_s"]
                self.profiles.begin()

        def close(self) -> None:
            self.profiles.stop()

    return StepProfilingSink()
