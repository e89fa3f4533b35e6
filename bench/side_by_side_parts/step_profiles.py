"""A profile of every step of one child, in one torch.profiler run (``ProfilerStep#i`` ranges mark the steps),
split by step afterwards, of which the slowest and the fastest timed step are kept: what a flagged row (max/min
step > hygiene.FLAG_SPREAD) spends its slow steps on. The harness runs one more child of a flagged row with it
on (its step times carry the profiler's overhead: not figures). One profiler for the whole run: stopping and
starting one between steps, inside the trainers' ``record_function`` ranges, crashed the process. Each step is a
``bench#step`` range of its own (torch names its ``ProfilerStep`` ranges alike in ``events()``).
"""

from __future__ import annotations

STEP = "bench#step"


class StepProfiles:
    """``start()`` before the first step, ``mark(step_s)`` after each (device synchronised), ``stop()`` at the
    end; then ``extremes(warmup)``."""

    def __init__(self, top: int = 12) -> None:
        self.top = top
        self.walls: list[float] = []
        self.steps: list[dict] = []
        self.prof = None
        self.range = None

    def _next_range(self) -> None:
        from torch.profiler import record_function

        if self.range is not None:
            self.range.__exit__(None, None, None)
        self.range = record_function(STEP)
        self.range.__enter__()

    def start(self) -> None:
        import torch
        from torch.profiler import ProfilerActivity, profile

        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
        self.prof = profile(activities=acts)
        self.prof.start()
        self._next_range()

    def mark(self, step_s: float) -> None:
        if self.prof is not None:
            self.walls.append(step_s)
            self._next_range()

    def stop(self) -> None:
        if self.prof is None:
            return
        self.range.__exit__(None, None, None)
        self.prof.stop()
        try:
            self.steps = self._split(self.prof.events())
        except Exception as exc:  # noqa: BLE001 -- a profile that cannot be read must not cost the row
            self.steps = [{"error": f"{type(exc).__name__}: {exc}"}]
        self.prof = None

    def _split(self, events) -> list[dict]:
        """Per step: device busy seconds and the top kernels (each kernel in the step whose device-side range,
        kineto's ``gpu_user_annotation`` of the same name, holds its start; the host-side range where there is
        none) and the top host ops (by the host-side ranges)."""
        from torch.autograd import DeviceType

        def spans(on_device: bool) -> list[tuple[float, float]]:
            return sorted((e.time_range.start, e.time_range.end) for e in events
                          if e.name == STEP and (e.device_type == DeviceType.CUDA) == on_device)

        n = len(self.walls)
        host_spans = spans(False)[:n]
        device_spans = spans(True)[:n] or host_spans
        device: list[dict[str, list[float]]] = [{} for _ in host_spans]
        host: list[dict[str, list[float]]] = [{} for _ in host_spans]
        for e in events:
            if e.name == STEP:
                continue
            cuda = e.device_type == DeviceType.CUDA
            at = next((i for i, (a, b) in enumerate(device_spans if cuda else host_spans)
                       if a <= e.time_range.start < b), None)
            if at is None or at >= len(host_spans):
                continue
            table, us = (device, e.time_range.elapsed_us()) if cuda else (host, e.self_cpu_time_total)
            slot = table[at].setdefault(e.name[:90], [0, 0.0])
            slot[0] += 1
            slot[1] += us
        return [{"index": i, "step_s": round(self.walls[i], 4),
                 "device_busy_s": round(sum(v[1] for v in device[i].values()) / 1e6, 4),
                 "top_device_ops": self._top(device[i], "device_ms"), "top_host_ops": self._top(host[i], "host_ms")}
                for i in range(len(host_spans))]

    def _top(self, table: dict[str, list[float]], unit: str) -> list[dict]:
        ranked = sorted(table.items(), key=lambda kv: -kv[1][1])[:self.top]
        return [{"op": k, "calls": int(v[0]), unit: round(v[1] / 1e3, 3)} for k, v in ranked]

    def extremes(self, warmup: int = 0) -> dict:
        """The slowest and the fastest profiled step past ``warmup``, and every step's time."""
        ok = [s for s in self.steps if "step_s" in s]
        timed = ok[warmup:] or ok
        if not timed:
            return {"error": self.steps[0]["error"]} if self.steps else {}
        return {"step_s": [s["step_s"] for s in ok], "warmup": warmup,
                "slowest": max(timed, key=lambda s: s["step_s"]), "fastest": min(timed, key=lambda s: s["step_s"])}


def step_profiling_sink():
    """Ours' sink with :class:`StepProfiles` on: each logged step (``perf/elapsed_s``) marks the end of one."""
    from .profiling import Sink

    class StepProfilingSink(Sink):
        def __init__(self) -> None:
            super().__init__()
            self.profiles = StepProfiles()
            self.last = 0.0
            self.profiles.start()

        def log_metrics(self, metrics: dict, step: int) -> None:
            super().log_metrics(metrics, step)
            if "perf/elapsed_s" in metrics:
                self.profiles.mark(metrics["perf/elapsed_s"] - self.last)
                self.last = metrics["perf/elapsed_s"]

        def close(self) -> None:
            self.profiles.stop()

    return StepProfilingSink()
