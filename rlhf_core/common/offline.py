"""The process environment alignflow sets before any tool it drives is imported: offline switches, the math
libraries' fixed threading, the GPU allocator and progress bars.

Import this module first (``rlhf_core/__init__.py`` does): nothing here may phone home or
reach a model hub, since the machines this runs on have no network beyond package
registries, and a user's nightly run must not depend on one.
"""

from __future__ import annotations

import faulthandler
import os
import sys

OFFLINE_ENV: dict[str, str] = {
    "DO_NOT_TRACK": "true",
    "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
    "MLFLOW_DISABLE_TELEMETRY": "true",
    "DVC_NO_ANALYTICS": "1",
    "GX_ANALYTICS_ENABLED": "false",
    "RAY_USAGE_STATS_ENABLED": "0",
    "VLLM_NO_USAGE_STATS": "1",
    "HF_HUB_OFFLINE": "1",
    "HF_DATASETS_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    # Tokenizers' Rust thread pool and fork()ed workers (Ray, DataLoader) deadlock otherwise.
    "TOKENIZERS_PARALLELISM": "false",
}


# NVLink multicast (NCCL's NVLS, torch symmetric memory) off in every Ray actor unless the user sets these
# (rlhf_core.trainers.ray_launcher.connect; the weight-sync group sets them again before NCCL starts): on shared
# multi-GPU hosts it has taken GPUs out of service, and data parallelism gains little from it.
NO_MULTICAST_ENV: dict[str, str] = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
                                    "NVSHMEM_DISABLE_NVLS": "1"}


# The math libraries' dynamic threading off. On, MKL and OpenMP choose each call's thread count from the
# machine's load, which changes the order a reduction sums in: the real recipe's GRPO model differed in its last
# bits between a run on a quiet machine and one beside other work, and with these set it does not (README, "A real
# model on a real task"). Read when the libraries load, so set before torch is imported;
# Ray workers get them too (rlhf_core.trainers.ray_launcher.worker_env).
DETERMINISM_ENV: dict[str, str] = {"MKL_DYNAMIC": "FALSE", "OMP_DYNAMIC": "FALSE"}


# The CUDA caching allocator with expandable segments: batches of varying length otherwise fragment
# its cache until it frees and re-allocates (a device sync), seen as SFT steps several times
# slower than their neighbours and gone with it (BENCHMARKS.md, the allocator A/B). Read by
# torch at its first CUDA allocation, so it is set here, before any.
GPU_ENV: dict[str, str] = {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}


# The Hub's and transformers' own progress bars ("Loading weights", "Writing model shards"): a bar per model
# load or save, several per stage, between the stage's own bars (tqdm, which this leaves on).
QUIET_ENV: dict[str, str] = {"HF_HUB_DISABLE_PROGRESS_BARS": "1"}


def apply_offline_env() -> None:
    """Set every offline switch (and the threading, GPU allocator and progress-bar settings) that the user has
    not set explicitly."""
    for key, value in {**OFFLINE_ENV, **DETERMINISM_ENV, **GPU_ENV, **QUIET_ENV}.items():
        os.environ.setdefault(key, value)


def child_env() -> dict[str, str]:
    """What a process alignflow starts elsewhere (a Ray worker) must begin with: the offline switches, and the
    math libraries' threading as this process has it (fixed unless the user set otherwise)."""
    return {**OFFLINE_ENV, **{k: os.environ.get(k, v) for k, v in DETERMINISM_ENV.items()}}


# Diagnostics for a run that hangs (a step that never ends on a large model): a trainer config's stack_dump_s=N
# arms these in the stage's process (rlhf_core.stages.wrappers) and in each Ray actor of the run
# (rlhf_core.trainers.ray_launcher), which write every thread's Python stack to stderr every N seconds (Ray forwards
# actors' stderr to the driver's). Off by default, and for hangs only: faulthandler's watchdog reads running
# threads' frames without the GIL, and one dump killed a 7B ZeRO-3 rank mid-update (BENCHMARKS.md, 7B GRPO).
def arm_stack_dumps(every_s: float) -> None:
    """Write every thread's stack to stderr every ``every_s`` seconds from now on (0: none, an earlier stage's
    dumps stopped)."""
    if every_s > 0:
        faulthandler.dump_traceback_later(every_s, repeat=True, file=sys.stderr)
    else:
        faulthandler.cancel_dump_traceback_later()


apply_offline_env()
