"""Data parallelism for every trainer: one process, torch DDP, or DeepSpeed ZeRO-2/3, behind one interface.

No Ray here. A worker joins a ``torch.distributed`` world first (the Ray launcher,
:mod:`rlhf_core.trainers.ray_launcher`, does that; so would ``torchrun``), then a trainer asks
:func:`current_world` for its rank and wraps its model with
:func:`rlhf_core.distributed.strategies.build_strategy`. In a plain
process the world is one rank and the strategy is the plain model, so the single-process code
path is the one every other path reduces to.

Global-batch semantics are the same for 1 and N workers: a step's micro-batches hold the same
examples (each rank takes the rows ``rank::N`` of every micro-batch; :class:`EpochSampler`
does the slicing), each rank's summed loss is divided by the unit count of the *whole* step,
all-reduced across ranks, and the gradient is summed. So 2 workers take the step 1 worker
would, up to float summation order (tested to 1e-4 relative in ``tests/model/test_parallel.py``).
With a token budget (``micro_batch_tokens``) each rank regroups its own rows of the step, so the
ranks' micro-batch counts may differ: they agree on the largest (:meth:`World.all_reduce_max`) and
a rank with fewer runs empty micro-batches (``rlhf_core.trainers.batches.EmptyMicroBatch``), because
every backward of DDP's last micro-batch and of every ZeRO micro-batch is a collective.

Strategies (``TrainerConfig.parallel``):

* ``ddp``: ``torch.nn.parallel.DistributedDataParallel`` (gloo on CPU, NCCL on GPU);
  ``no_sync`` skips the all-reduce on all but the last micro-batch of a step.
* ``zero2`` / ``zero3``: DeepSpeed ZeRO stage 2 (optimizer state and gradients partitioned)
  or 3 (parameters too; Rajbhandari et al. 2020, "ZeRO"), with optional CPU optimizer offload.

Precision (``TrainerConfig.precision``, :mod:`rlhf_core.models.precision`): under Local and DDP the
optimizer carries the regime (:class:`rlhf_core.models.precision.MasterWeightAdamW` for mixed and bf16);
under ZeRO mixed and bf16 are DeepSpeed's bf16 mode
(:class:`rlhf_core.distributed.strategies.DeepSpeedStrategy`).

Checkpoints (every strategy, every world size): :meth:`Strategy.optimizer_state` hands back the
AdamW state *by parameter name* — whole tensors, gathered from ZeRO's partitions with DeepSpeed's
tensor-fragment API (``safe_get_full_optimizer_state``) — and :meth:`Strategy.load_optimizer_state`
scatters it back into whatever layout this world uses. One format, so a run checkpointed on two
ZeRO-2 ranks resumes exactly on two, and continues on one (``tests/model/test_parallel.py``). We
chose a consolidated format over DeepSpeed's ``save_checkpoint`` (one file per rank, loadable only
by the same world size without an offline ``ds_to_universal`` conversion) because a nightly job
that lost a node must be able to finish on the nodes it has; the price is a gather of the
optimizer state (2 x the fp32 parameters, 3 x with the fp32 masters of bf16 mode) on rank 0 at
each checkpoint. Both calls, and
:meth:`Strategy.load_weights`, are collectives: every rank makes them.
"""

from __future__ import annotations

import datetime
import logging
import math
import os
import socket
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from typing import Any, Iterator, Protocol, Sequence

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from rlhf_core.models.precision import MasterWeightAdamW, Precision, state_key

log = logging.getLogger(__name__)

PARALLEL_CHOICES = ("ddp", "zero2", "zero3")
ADAM_MOMENTS = ("exp_avg", "exp_avg_sq")


# --------------------------------------------------------------------------------------
# The world: who am I, how many are we
# --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class World:
    """This process's place in a data-parallel world (rank 0 of 1 in a plain process)."""

    rank: int = 0
    size: int = 1

    @property
    def is_main(self) -> bool:
        """Rank 0 logs, evaluates into the tracker, writes checkpoints and the final model."""
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.size > 1

    def rows(self, n: int) -> slice:
        """This rank's rows of a micro-batch of ``n``: ``rank::size`` (interleaved, so shards differ by <= 1)."""
        return slice(self.rank, n, self.size)

    def all_reduce_sum(self, values: Sequence[float]) -> list[float]:
        """Element-wise sum of ``values`` over ranks (float64 on the CPU group; a no-op for one rank)."""
        if not self.distributed:
            return [float(v) for v in values]

        t = torch.tensor([float(v) for v in values], dtype=torch.float64, device=_collective_device())
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
        return t.cpu().tolist()

    def all_reduce_max(self, values: Sequence[float]) -> list[float]:
        """Element-wise maximum of ``values`` over ranks (e.g. the micro-batch count every rank must run)."""
        if not self.distributed:
            return [float(v) for v in values]

        t = torch.tensor([float(v) for v in values], dtype=torch.float64, device=_collective_device())
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return t.cpu().tolist()

    def max_over_ranks_(self, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor`` (on the collective's device: CUDA under NCCL, the CPU under gloo) replaced in place by its
        element-wise maximum over ranks, queued on the device without the host waiting; returned."""
        if self.distributed:
            dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
        return tensor

    def all_reduce_grads(self, model: torch.nn.Module) -> None:
        """Sum every gradient of ``model`` over ranks (for a model called through its submodules,
        which DDP's forward hook would not see)."""
        if not self.distributed:
            return

        for param in model.parameters():
            if param.grad is not None:
                dist.all_reduce(param.grad, op=dist.ReduceOp.SUM)

    def gather_to_main(self, obj: Any) -> list[Any] | None:
        """Every rank's ``obj`` (picklable) in rank order on rank 0, None on the others; ``[obj]`` alone."""
        if not self.distributed:
            return [obj]

        out: list[Any] | None = [None] * self.size if self.is_main else None
        dist.gather_object(obj, out, dst=0)
        return out

    def barrier(self) -> None:
        if self.distributed:
            dist.barrier()


def current_world() -> World:
    """The ``torch.distributed`` world this process joined, or a world of one."""
    if dist.is_available() and dist.is_initialized():
        return World(dist.get_rank(), dist.get_world_size())
    return World()


def _collective_device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")


# --------------------------------------------------------------------------------------
# Strategies: how gradients are reduced and the optimizer steps
# --------------------------------------------------------------------------------------


class Strategy(Protocol):
    """What a trainer's update needs from a (possibly data-parallel) model."""

    module: torch.nn.Module
    """Call this for forward passes (DDP / DeepSpeed wrapper, or the model itself)."""
    scheduler: Any
    """The learning-rate schedule stepped with the optimizer (None where the caller steps its own)."""
    grad_scale: float
    """Multiply a loss normalised by the global unit count by this before ``backward``
    (the world size where the wrapper *averages* gradients over ranks, 1 where it sums)."""

    def accumulating(self, last: bool) -> Any: ...

    def backward(self, loss: torch.Tensor) -> None: ...

    def clip_grad_norm(self, max_norm: float) -> torch.Tensor: ...

    def step(self, skip: torch.Tensor | None = None) -> None: ...

    def zero_grad(self) -> None: ...

    def unwrap(self) -> torch.nn.Module: ...

    def gathered(self, params: Sequence[torch.nn.Parameter] | None = None) -> Any: ...

    def optimizer_state(self) -> dict[str, Any]: ...

    def load_optimizer_state(self, state: dict[str, Any]) -> None: ...

    def load_weights(self, weights: dict[str, torch.Tensor], where: str) -> None: ...

    def masters_into_model(self) -> None: ...


# --------------------------------------------------------------------------------------
# Optimizer state by parameter name: one checkpoint format for every strategy and world size
# --------------------------------------------------------------------------------------
#
# {"lr": float, "step": {name: 0-d tensor}, "exp_avg": {name: tensor}, "exp_avg_sq": {name: tensor}}
# (torch AdamW's per-parameter state, keyed by ``named_parameters()`` names instead of positions;
# parameters that have no state yet, before the first step, are absent), plus "master": {name: fp32
# tensor} where fp32 master weights persist (rlhf_core.models.precision: mixed precision, or bf16 under ZeRO):
# the checkpoint's safetensors hold the bf16 working weights, the masters are the trained weights,
# and a resume that restored only the bf16 copy would not continue the run exactly. Every parameter
# group of :func:`rlhf_core.trainers.step.build_optimizer` shares one learning rate.


def named_trainable(model: torch.nn.Module) -> dict[str, torch.nn.Parameter]:
    return {name: p for name, p in model.named_parameters() if p.requires_grad}


def group_lr(param_groups: Sequence[dict[str, Any]]) -> float:
    return float(param_groups[0]["lr"]) if param_groups else 0.0


def set_lr(param_groups: Sequence[dict[str, Any]], lr: float) -> None:
    # The schedule's value for the next step; a fresh optimizer would otherwise take its first
    # step after resume at the initial learning rate.
    for group in param_groups:
        group["lr"] = lr


def assign_weights(model: torch.nn.Module, weights: dict[str, torch.Tensor], where: str) -> None:
    """Copy ``weights`` (an HF checkpoint's tensors) into ``model`` in place.

    ``save_pretrained`` stores a tied parameter once (e.g. the LM head shares the embedding), so a
    missing key is accepted only when it shares storage with a loaded one. ``where`` names the
    checkpoint in the error.
    """
    missing, unexpected = model.load_state_dict(weights, strict=False)
    params = model.state_dict(keep_vars=True)
    loaded_ptrs = {params[k].data_ptr() for k in weights if k in params}
    untied = [k for k in missing if params[k].data_ptr() not in loaded_ptrs]
    if untied or unexpected:
        raise ValueError(f"{where}: checkpoint does not match the model (missing {untied[:5]}, "
                         f"unexpected {list(unexpected)[:5]})")


def plan_buckets(numels: Sequence[int], max_numel: int) -> list[list[int]]:
    """Split tensors, in order, into consecutive buckets of at most ``max_numel`` elements each (a tensor larger
    than that gets a bucket of its own); returns each bucket's tensor indices.

    For moving a ZeRO-3 model's weights a bucket at a time: only one bucket is ever whole on a rank.
    """
    buckets: list[list[int]] = []
    size = 0
    for i, n in enumerate(numels):
        if not buckets or size + n > max_numel:
            buckets.append([])
            size = 0
        buckets[-1].append(i)
        size += n
    return buckets


class LocalStrategy:
    """One process (or a rank whose gradients someone else reduces): plain backward and step."""

    grad_scale = 1.0

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                 scheduler: torch.optim.lr_scheduler.LRScheduler | None):
        self.module, self.model, self.optimizer, self.scheduler = model, model, optimizer, scheduler

    def accumulating(self, last: bool) -> Any:
        del last
        return nullcontext()

    def backward(self, loss: torch.Tensor) -> None:
        loss.backward()

    def clip_grad_norm(self, max_norm: float) -> torch.Tensor:
        """Clip this step's gradients to global norm ``max_norm`` (0: measure only); returns the norm before
        clipping, a 0-dim fp32 tensor on the gradients' device, unread: reading it waits for the device."""
        if isinstance(self.optimizer, MasterWeightAdamW):  # its gradients may sit on the fp32 masters
            return self.optimizer.clip_grad_norm_(max_norm)
        params = [p for p in self.model.parameters() if p.grad is not None]
        if not params:
            return torch.zeros((), dtype=torch.float32)
        return torch.nn.utils.clip_grad_norm_(params, max_norm if max_norm > 0 else math.inf).float()

    def step(self, skip: torch.Tensor | None = None) -> None:
        """The optimizer's step (left out on the device where ``skip`` is nonzero: :func:`optimizer_step`), the
        schedule's, and the gradients cleared."""
        optimizer_step(self.optimizer, skip)
        if self.scheduler is not None:
            self.scheduler.step()
        self.zero_grad()

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    def unwrap(self) -> torch.nn.Module:
        return self.model

    def gathered(self, params: Sequence[torch.nn.Parameter] | None = None) -> Any:
        """Every parameter whole on every rank inside the block (already so outside ZeRO-3)."""
        del params
        return nullcontext()

    def optimizer_state(self) -> dict[str, Any]:
        """AdamW's state by parameter name (every DDP rank holds all of it; rank 0's is saved)."""
        out: dict[str, Any] = {"lr": group_lr(self.optimizer.param_groups), "step": {},
                               **{key: {} for key in ADAM_MOMENTS}}
        masters = isinstance(self.optimizer, MasterWeightAdamW) and self.optimizer.precision is Precision.MIXED
        if masters:
            out["master"] = {}
        for name, param in named_trainable(self.model).items():
            state = self.optimizer.state.get(state_key(self.optimizer, param))
            if state:
                for key in ("step", *ADAM_MOMENTS):
                    out[key][name] = state[key].detach()
            if masters:
                out["master"][name] = self.optimizer.masters[param].detach()
        return out

    def load_optimizer_state(self, state: dict[str, Any]) -> None:
        """The inverse of :meth:`optimizer_state` (moments cast to the device and dtype of the tensor the
        optimizer steps, as ``torch.optim.Optimizer.load_state_dict`` does; masters, where saved, into
        the optimizer and the model)."""
        fused = bool(self.optimizer.defaults.get("fused") or self.optimizer.defaults.get("capturable"))
        for name, param in named_trainable(self.model).items():
            if name in state["step"]:
                key = state_key(self.optimizer, param)
                step = state["step"][name].detach().clone().float()  # fused kernels want it on the device
                self.optimizer.state[key] = {
                    "step": step.to(key.device) if fused else step.cpu(),
                    **{k: state[k][name].to(key.device, key.dtype, copy=True) for k in ADAM_MOMENTS}}
        if "master" in state and isinstance(self.optimizer, MasterWeightAdamW):
            params = named_trainable(self.model)
            self.optimizer.set_masters({params[n]: v for n, v in state["master"].items() if n in params})
        set_lr(self.optimizer.param_groups, state["lr"])

    def load_weights(self, weights: dict[str, torch.Tensor], where: str) -> None:
        """``weights`` into the model, and into the fp32 masters where the optimizer holds them (exactly
        when ``weights`` are fp32; a checkpoint's bf16 weights are followed by its saved masters)."""
        assign_weights(self.model, weights, where)
        if isinstance(self.optimizer, MasterWeightAdamW):
            self.optimizer.set_masters({p: weights.get(n, p) for n, p in named_trainable(self.model).items()})

    def masters_into_model(self) -> None:
        """End of training: the model holds the fp32 masters (mixed precision), so it is saved in full
        precision; a no-op without masters."""
        if isinstance(self.optimizer, MasterWeightAdamW):
            self.optimizer.masters_into_model(self.model)


def optimizer_step(optimizer: torch.optim.Optimizer, skip: torch.Tensor | None = None) -> None:
    """``optimizer.step()``, unless ``skip`` (a 0-dim tensor: nonzero where this step's loss or gradient norm is
    not finite) says otherwise, decided without the host waiting for the device where the optimizer allows.

    torch's fused Adam/AdamW kernels take such a flag (``found_inf``, set on the optimizer as
    ``torch.amp.GradScaler`` sets it; their ``_step_supports_amp_scaling`` says so): a nonzero flag leaves the
    weights, the moments and the step count as they were, on the device. So the loop launches the step right
    after the backward and reads the losses and the norm once, after it (each read before the step left the
    device idle while the host launched the optimizer). Other optimizers read the flag first.
    """
    if skip is None:
        optimizer.step()
    elif getattr(optimizer, "_step_supports_amp_scaling", False):
        optimizer.found_inf = skip.to(torch.float32)  # type: ignore[attr-defined]
        try:
            optimizer.step()
        finally:
            del optimizer.found_inf  # type: ignore[attr-defined]
    elif not bool(skip):
        optimizer.step()


class DDPStrategy(LocalStrategy):
    """torch DDP: gradients averaged across ranks in buckets during the last micro-batch's backward.

    Under mixed precision the bf16 gradients accumulate in ``.grad`` across micro-batches (``no_sync``)
    and are reduced in bf16; the optimizer casts them into its fp32 masters at the step. (Its fp32
    accumulation hooks are off here: they would move each micro-batch's gradient out of ``.grad``
    before DDP reduced it, and the all-reduce would see only the last micro-batch.)"""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                 scheduler: torch.optim.lr_scheduler.LRScheduler | None, world: World):
        super().__init__(model, optimizer, scheduler)
        device_ids = [torch.cuda.current_device()] if next(model.parameters()).is_cuda else None
        self.module = DistributedDataParallel(model, device_ids=device_ids)
        self.grad_scale = float(world.size)  # DDP averages; our losses are already global means

    def accumulating(self, last: bool) -> Any:
        return nullcontext() if last else self.module.no_sync()


def join_world(addr: str, port: int, rank: int, size: int, timeout_s: float | None = None) -> None:
    """``torch.distributed.init_process_group`` as ``rank`` of ``size`` (rank 0 hosts the store at ``addr:port``):
    NCCL on a GPU, gloo on a CPU; a collective waits at most ``timeout_s`` for its peers (``None``: torch's default).

    Sets what torchrun would (DeepSpeed reads them). The local device is always 0: Ray shows each actor only its
    own GPU(s) (``CUDA_VISIBLE_DEVICES``), and a world of one takes the first."""
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    os.environ.update(MASTER_ADDR=addr, MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(size), LOCAL_RANK="0")
    if backend == "nccl":
        torch.cuda.set_device(0)
    timeout = {} if timeout_s is None else {"timeout": datetime.timedelta(seconds=timeout_s)}
    dist.init_process_group(backend, init_method=f"tcp://{addr}:{port}", rank=rank, world_size=size, **timeout)


def join_world_of_one() -> None:
    """A ``torch.distributed`` group of this process alone, unless it is in one already.

    DeepSpeed needs a process group, also for one rank (ZeRO in one process: ``offload_optimizer`` on one GPU, or a
    one-GPU Ray policy, which forms no group of its own); without one it looks for MPI and fails where ``mpi4py``
    is missing. What torchrun gives a single process: rank 0 of 1 on the loopback (:func:`join_world`).
    A world of one stays a world of one (:attr:`World.distributed` is False)."""
    if dist.is_initialized():
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    join_world("127.0.0.1", port, 0, 1)


def resident_weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of ``model``'s parameters this process holds: a ZeRO-3 parameter counts its own partition
    (``ds_tensor``), a released one (:meth:`rlhf_core.trainers.rollout_replica.RolloutReplica.release_weights`) nothing.
    Tied parameters count once."""
    seen, total = set(), 0
    for p in getattr(model, "module", model).parameters():
        if id(p) in seen:
            continue
        seen.add(id(p))
        held = getattr(p, "ds_tensor", None)
        t = held if held is not None else p.data
        total += t.numel() * t.element_size()
    return total


@contextmanager
def train_mode(model: torch.nn.Module) -> Iterator[None]:
    """``model.train()`` inside the block (gradient checkpointing only runs in train mode), restored after.

    Callers that must score tokens exactly as the sampler did disable dropout once with
    :func:`disable_dropout`, so train mode changes nothing but checkpointing.
    """
    was_training = model.training
    model.train()
    try:
        yield
    finally:
        model.train(was_training)


def disable_dropout(model: torch.nn.Module) -> None:
    """Set every dropout probability to 0 (RL scores tokens with the function that sampled them)."""
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
    config = getattr(model, "config", None)
    if config is not None and hasattr(config, "attention_dropout"):
        config.attention_dropout = 0.0
