"""In every child, rank and Ray actor: log capture, thread counts, device sync, peak device memory (in half-second
windows, so processes sharing a GPU can be summed at one moment), and the ``ceiling`` child (matmul peak, copy
bandwidth).
"""

from __future__ import annotations

import json
import os
import resource
import sys
import threading
import time
from pathlib import Path

from .settings import SETTINGS


def child_logging() -> None:
    """rlhf_core's INFO lines (``gradient_checkpointing auto: on/off ...``) to stderr, where the parent reads them."""
    import logging

    logger = logging.getLogger("rlhf_core")
    if not any(getattr(h, "_bench", False) for h in logger.handlers):
        handler = logging.StreamHandler(sys.stderr)
        handler._bench = True  # type: ignore[attr-defined]
        handler.setFormatter(logging.Formatter("%(name)s: %(message)s"))
        logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    logging.getLogger("rlhf_core.trainers.rl").setLevel(logging.DEBUG)  # each RL phase's start and end


def peak_writer(peak_dir: str | None):
    """Write this process's peak device memory to ``peak_dir/<pid>.json`` every half second (Ray actors are
    killed at the end: the last write stands); returns a function that writes once more now."""
    if not peak_dir:
        return lambda: None
    path = Path(peak_dir) / f"{os.getpid()}.json"
    lock = threading.Lock()  # the thread and a final flush share the temporary file

    def write() -> None:
        with lock:
            _write_peak(path)

    def loop() -> None:
        while True:
            try:
                write()
            except Exception:  # noqa: BLE001 - best effort; a torn-down CUDA context at exit
                pass
            time.sleep(0.5)

    threading.Thread(target=loop, daemon=True).start()
    return write


# This process's device memory, per GPU uuid: the all-time peak (GB) and half-second windows
# ``[start, end, peak GB]``. Each write reads the allocator's peak since the last one, then resets it, so the
# windows of processes sharing a GPU can be summed at each moment (:func:`concurrent_peak_gb`): the sum of
# their whole-run peaks counts a colocated replica's rollout memory and the learner's update memory as if both
# were held at once, and would hide a replica that frees its weights between the two (rl.rollout.sleep).
_PEAKS: dict[str, float] = {}
_WINDOWS: dict[str, list[list[float]]] = {}
_WINDOW_START = [time.time()]


def _write_peak(path: Path) -> None:
    import torch

    now = time.time()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        for i in range(torch.cuda.device_count()):  # a rank's own GPU: the one its allocator used
            peak = torch.cuda.memory_stats(i).get("allocated_bytes.all.peak", 0)
            # the next window starts from what is allocated now (an allocation that rises and falls in the
            # microseconds between the read and the reset is missed)
            torch.cuda.reset_peak_memory_stats(i)
            if peak:
                dev = str(torch.cuda.get_device_properties(i).uuid)
                _PEAKS[dev] = max(_PEAKS.get(dev, 0.0), peak / 2**30)
                _WINDOWS.setdefault(dev, []).append([round(_WINDOW_START[0], 3), round(now, 3), peak / 2**30])
    else:
        _PEAKS[f"host:{os.getpid()}"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    _WINDOW_START[0] = now
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"pid": os.getpid(), "peak_gb": _PEAKS, "windows_gb": _WINDOWS}))
    tmp.replace(path)


def concurrent_peak_gb(processes: list[list[list[float]]]) -> float:
    """The most memory the processes sharing one device held at one moment, from each one's windows
    ``[start, end, peak GB]`` (back to back, in time order): the max over window starts t of the sum, over
    processes, of the peak of the window holding t. An upper bound of the true concurrent peak (a window's peak
    may come at another moment of it), and never above the sum of the processes' whole-run peaks."""
    best = 0.0
    for t in sorted({w[0] for windows in processes for w in windows}):
        best = max(best, sum(next((w[2] for w in windows if w[0] <= t < w[1]), 0.0) for windows in processes))
    return best


def read_peaks(peak_dir: Path) -> tuple[dict[str, float], dict[str, float]]:
    """Peak GB per device, processes sharing a GPU (colocated roles) summed: the sum of their whole-run peaks,
    and their peak at one moment (:func:`concurrent_peak_gb`; GPUs only)."""
    by_device: dict[str, float] = {}
    windows: dict[str, list[list[list[float]]]] = {}
    for f in peak_dir.glob("*.json"):
        try:
            record = json.loads(f.read_text())
            for dev, gb in record["peak_gb"].items():
                by_device[dev] = by_device.get(dev, 0.0) + gb
            for dev, series in record.get("windows_gb", {}).items():
                windows.setdefault(dev, []).append(series)
        except (OSError, ValueError, KeyError):
            continue
    return by_device, {dev: concurrent_peak_gb(series) for dev, series in windows.items()}


def thread_counts() -> dict:
    import torch

    return {"intra_op": torch.get_num_threads(), "inter_op": torch.get_num_interop_threads(),
            "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS")}


def process_peak_memory_gb() -> float:
    import torch

    if torch.cuda.is_available():  # the peak writer resets the allocator's peak each window and keeps the max
        return max([torch.cuda.max_memory_allocated() / 2**30, *(v for k, v in _PEAKS.items() if not k.startswith("host:"))])
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # kB on Linux


def device_sync() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def measure_ceiling(inputs: dict, reps: int = 3) -> dict:
    """Child ``ceiling``: ``reps`` measurements of the matmul peak (bf16 8192^3 on a GPU, fp32 1024^3 on the
    CPU at the benchmark's thread count) and of device copy bandwidth; the parent keeps them all."""
    import torch

    s = SETTINGS[inputs["variant"]]
    if torch.cuda.is_available() and inputs["variant"] != "cpu":
        dev, dtype, n, device = torch.device("cuda"), torch.bfloat16, 8192, torch.cuda.get_device_name(0)
    else:
        torch.set_num_threads(s["threads"])
        dev, dtype, n, device = torch.device("cpu"), torch.float32, 1024, "cpu"
    a, b = torch.randn(n, n, device=dev, dtype=dtype), torch.randn(n, n, device=dev, dtype=dtype)
    for _ in range(3):
        a @ b
    flops, bws = [], []
    x = torch.empty(2**28, dtype=torch.uint8, device=dev)
    y = torch.empty_like(x)
    y.copy_(x)
    for _ in range(reps):
        device_sync()
        t = time.perf_counter()
        for _ in range(10):
            a @ b
        device_sync()
        flops.append(2 * n**3 / ((time.perf_counter() - t) / 10))
        t = time.perf_counter()
        for _ in range(5):
            y.copy_(x)
        device_sync()
        bws.append(2 * x.numel() / ((time.perf_counter() - t) / 5))
    return {"matmul_flops": flops, "copy_bytes_per_s": bws, "device": device, "matmul": f"{dtype} {n}^3",
            "threads": thread_counts()}
