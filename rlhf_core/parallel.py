"""Data parallelism for every trainer: one process, torch DDP, or DeepSpeed ZeRO-2/3, behind one interface.

No Ray here. A worker joins a ``torch.distributed`` world first (the Ray launcher,
:mod:`rlhf_core.ray_launcher`, does that; so would ``torchrun``), then a trainer asks
:func:`current_world` for its rank and wraps its model with :func:`build_strategy`. In a plain
process the world is one rank and the strategy is the plain model, so the single-process code
path is the one every other path reduces to.

Global-batch semantics are the same for 1 and N workers: a step's micro-batches hold the same
examples (each rank takes the rows ``rank::N`` of every micro-batch; :class:`EpochSampler`
does the slicing), each rank's summed loss is divided by the unit count of the *whole* step,
all-reduced across ranks, and the gradient is summed. So 2 workers take the step 1 worker
would, up to float summation order (tested to 1e-4 relative in ``tests/model/test_parallel.py``).

Strategies (``TrainerConfig.parallel``):

* ``ddp``: ``torch.nn.parallel.DistributedDataParallel`` (gloo on CPU, NCCL on GPU);
  ``no_sync`` skips the all-reduce on all but the last micro-batch of a step.
* ``zero2`` / ``zero3``: DeepSpeed ZeRO stage 2 (optimizer state and gradients partitioned)
  or 3 (parameters too; Rajbhandari et al. 2020, "ZeRO"), with optional CPU optimizer offload.
"""

from __future__ import annotations

import logging
import math
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from typing import Any, Iterator, Protocol, Sequence

import torch

log = logging.getLogger(__name__)

PARALLEL_CHOICES = ("ddp", "zero2", "zero3")


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
        import torch.distributed as dist

        t = torch.tensor([float(v) for v in values], dtype=torch.float64, device=_collective_device())
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
        return t.cpu().tolist()

    def all_reduce_grads(self, model: torch.nn.Module) -> None:
        """Sum every gradient of ``model`` over ranks (for a model called through its submodules,
        which DDP's forward hook would not see)."""
        if not self.distributed:
            return
        import torch.distributed as dist

        for param in model.parameters():
            if param.grad is not None:
                dist.all_reduce(param.grad, op=dist.ReduceOp.SUM)

    def barrier(self) -> None:
        if self.distributed:
            import torch.distributed as dist

            dist.barrier()


def current_world() -> World:
    """The ``torch.distributed`` world this process joined, or a world of one."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return World(dist.get_rank(), dist.get_world_size())
    return World()


def _collective_device() -> torch.device:
    import torch.distributed as dist

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

    def clip_grad_norm(self, max_norm: float) -> float: ...

    def step(self) -> None: ...

    def zero_grad(self) -> None: ...

    def unwrap(self) -> torch.nn.Module: ...

    def gathered(self) -> Any: ...

    def optimizer_state(self) -> dict[str, Any] | None: ...

    def load_optimizer_state(self, state: dict[str, Any]) -> None: ...


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

    def clip_grad_norm(self, max_norm: float) -> float:
        params = [p for p in self.model.parameters() if p.grad is not None]
        if not params:
            return 0.0
        return float(torch.nn.utils.clip_grad_norm_(params, max_norm if max_norm > 0 else math.inf))

    def step(self) -> None:
        self.optimizer.step()
        if self.scheduler is not None:
            self.scheduler.step()
        self.zero_grad()

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    def unwrap(self) -> torch.nn.Module:
        return self.model

    def gathered(self) -> Any:
        """Every parameter whole on every rank inside the block (already so outside ZeRO-3)."""
        return nullcontext()

    def optimizer_state(self) -> dict[str, Any] | None:
        return self.optimizer.state_dict()

    def load_optimizer_state(self, state: dict[str, Any]) -> None:
        self.optimizer.load_state_dict(state)


class DDPStrategy(LocalStrategy):
    """torch DDP: gradients averaged across ranks in buckets during the last micro-batch's backward."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                 scheduler: torch.optim.lr_scheduler.LRScheduler | None, world: World):
        from torch.nn.parallel import DistributedDataParallel

        super().__init__(model, optimizer, scheduler)
        device_ids = [torch.cuda.current_device()] if next(model.parameters()).is_cuda else None
        self.module = DistributedDataParallel(model, device_ids=device_ids)
        self.grad_scale = float(world.size)  # DDP averages; our losses are already global means

    def accumulating(self, last: bool) -> Any:
        return nullcontext() if last else self.module.no_sync()


class DeepSpeedStrategy:
    """DeepSpeed ZeRO stage 2 or 3; the engine owns the optimizer step, clipping and the schedule."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                 scheduler: torch.optim.lr_scheduler.LRScheduler | None, world: World, *, stage: int,
                 grad_accum: int, max_grad_norm: float, offload_optimizer: bool,
                 autocast_dtype: torch.dtype | None = None):
        import deepspeed

        self.stage, self.model = stage, model
        config = {
            "train_micro_batch_size_per_gpu": 1,  # our batches are dicts of any size; only the ratio matters
            "gradient_accumulation_steps": grad_accum,
            "train_batch_size": grad_accum * world.size,
            "gradient_clipping": max_grad_norm,
            "zero_optimization": {"stage": stage, "overlap_comm": next(model.parameters()).is_cuda,
                                  "contiguous_gradients": True},
            "zero_allow_untested_optimizer": True,
            "steps_per_print": 10**9,
            "wall_clock_breakdown": False,
        }
        if autocast_dtype is not None:
            # fp32 master weights, bf16 compute: the engine disables an outer torch.autocast unless
            # its own torch_autocast section is on (then it also reduces those layers' grads in bf16)
            config["torch_autocast"] = {"enabled": True, "dtype": str(autocast_dtype).removeprefix("torch.")}
        if offload_optimizer:
            config["zero_optimization"]["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
            # Offload needs DeepSpeed's own CPU Adam; same hyper-parameters as build_optimizer.
            group = optimizer.param_groups[0]
            config["optimizer"] = {"type": "AdamW", "params": {"lr": group["lr"], "betas": list(group["betas"]),
                                                                "eps": group["eps"],
                                                                "weight_decay": group["weight_decay"]}}
            optimizer = None
        self.engine, self.optimizer, _, self.scheduler = deepspeed.initialize(
            model=model, optimizer=optimizer, lr_scheduler=scheduler, config=config,
            model_parameters=[p for p in model.parameters() if p.requires_grad] if optimizer is None else None)
        self.module = self.engine
        self.grad_scale = float(world.size * grad_accum)  # the engine averages over ranks and divides by gas

    def accumulating(self, last: bool) -> Any:
        del last  # the engine counts micro-steps itself
        return nullcontext()

    def backward(self, loss: torch.Tensor) -> None:
        self.engine.backward(loss)

    def clip_grad_norm(self, max_norm: float) -> float:
        del max_norm  # clipping is the engine's (config "gradient_clipping"); its norm is known after step()
        return 0.0

    def step(self) -> None:
        self.engine.step()

    def last_grad_norm(self) -> float:
        norm = self.engine.get_global_grad_norm()
        return float(norm) if norm is not None else float("nan")

    def zero_grad(self) -> None:
        self.engine.zero_grad()

    def unwrap(self) -> torch.nn.Module:
        return self.engine.module

    def gathered(self) -> Any:
        if self.stage < 3:
            return nullcontext()
        import deepspeed

        return deepspeed.zero.GatheredParameters(list(self.engine.module.parameters()), modifier_rank=0)

    def optimizer_state(self) -> dict[str, Any] | None:
        return None  # partitioned per rank: mid-run checkpoints under ZeRO keep weights only (see loop)

    def load_optimizer_state(self, state: dict[str, Any]) -> None:
        del state


def build_strategy(kind: str, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                   scheduler: torch.optim.lr_scheduler.LRScheduler | None, world: World | None = None, *,
                   grad_accum: int = 1, max_grad_norm: float = 1.0, offload_optimizer: bool = False,
                   autocast_dtype: torch.dtype | None = None) -> Strategy:
    """The strategy ``kind`` (``ddp``, ``zero2``, ``zero3``) for ``world``; a single rank is always local.

    ``zero2``/``zero3`` need DeepSpeed; on a CPU-only world (gloo) they run on DeepSpeed's CPU
    accelerator, which is how the tests exercise the same code the GPUs run.
    """
    world = world or current_world()
    if kind not in PARALLEL_CHOICES:
        raise ValueError(f"parallel must be one of {', '.join(PARALLEL_CHOICES)}, got {kind!r}")
    if kind.startswith("zero"):
        return DeepSpeedStrategy(model, optimizer, scheduler, world, stage=int(kind[-1]), grad_accum=grad_accum,
                                 max_grad_norm=max_grad_norm, offload_optimizer=offload_optimizer,
                                 autocast_dtype=autocast_dtype)
    if not world.distributed:
        return LocalStrategy(model, optimizer, scheduler)
    return DDPStrategy(model, optimizer, scheduler, world)


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
