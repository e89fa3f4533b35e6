"""The strategies that need DeepSpeed: ZeRO stage 2 or 3 for a trained model (:class:`DeepSpeedStrategy`), ZeRO-3
partitions for a frozen one (:func:`shard_frozen`), and :func:`build_strategy`, which picks a run's strategy among
these and :mod:`rlhf_core.distributed.parallel`'s local and DDP ones.

:mod:`rlhf_core.distributed.parallel` holds the world, the strategy protocol, the by-name optimizer-state format
every strategy shares and the strategies torch alone provides; DeepSpeed is imported only when a ZeRO strategy is built.
"""

from __future__ import annotations

import logging
from contextlib import nullcontext
from typing import Any, Sequence

import torch

from rlhf_core.distributed.parallel import (ADAM_MOMENTS, PARALLEL_CHOICES, DDPStrategy, LocalStrategy, Strategy, World,
                                            assign_weights, current_world, group_lr, join_world_of_one,
                                            named_trainable, set_lr)
from rlhf_core.models.precision import Precision, cast_parameters

log = logging.getLogger(__name__)


class DeepSpeedStrategy:
    """DeepSpeed ZeRO stage 2 or 3; the engine owns the optimizer step, clipping and the schedule.

    ``precision`` mixed or bf16 is DeepSpeed's bf16 mode: the engine casts the model's parameters to
    bf16 (buffers stay fp32) and its ZeRO optimizer steps partitioned fp32 masters, writing the bf16
    weights after each step; mixed also accumulates gradients in fp32 (``data_types.grad_accum_dtype``),
    bf16 in bf16. The masters start as the model's fp32 weights when it arrives in fp32 (DeepSpeed
    would take them from the bf16 cast).
    """

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                 scheduler: torch.optim.lr_scheduler.LRScheduler | None, world: World, *, stage: int,
                 grad_accum: int, max_grad_norm: float, offload_optimizer: bool,
                 precision: Precision = Precision.FP32):
        import deepspeed  # lazy: deepspeed (ZeRO only; optional on CPU)

        join_world_of_one()
        self.stage, self.model, self.bf16 = stage, model, precision is not Precision.FP32
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
        initial: dict[str, torch.Tensor] = {}
        if self.bf16:
            config["bf16"] = {"enabled": True}
            if precision is Precision.MIXED:
                config["data_types"] = {"grad_accum_dtype": "fp32"}
            initial = {n: p.detach().to("cpu", copy=True) for n, p in named_trainable(model).items()
                       if p.dtype == torch.float32}
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
        if initial:
            self._set_masters(initial, "the model's fp32 weights")

    def accumulating(self, last: bool) -> Any:
        # The caller says where the step ends: with a token budget (micro_batch_tokens) a step's
        # micro-batch count varies, so the engine's own count (micro_steps % gradient_accumulation_steps)
        # would put the boundary in the wrong place. Its loss division by gradient_accumulation_steps
        # stays a constant (grad_accum), which grad_scale undoes, so the count never enters the gradient.
        self.engine.set_gradient_accumulation_boundary(last)
        return nullcontext()

    def backward(self, loss: torch.Tensor) -> None:
        self.engine.backward(loss)

    def clip_grad_norm(self, max_norm: float) -> torch.Tensor:
        del max_norm  # clipping is the engine's (config "gradient_clipping"); its norm is known after step()
        return torch.zeros((), dtype=torch.float32)

    def step(self, skip: torch.Tensor | None = None) -> None:
        del skip  # the engine steps inside its accumulation count; the loop checks its norm after (last_grad_norm)
        self.engine.step()

    def last_grad_norm(self) -> float:
        norm = self.engine.get_global_grad_norm()
        return float(norm) if norm is not None else float("nan")

    def zero_grad(self) -> None:
        self.engine.zero_grad()

    def unwrap(self) -> torch.nn.Module:
        return self.engine.module

    def gathered(self, params: Sequence[torch.nn.Parameter] | None = None) -> Any:
        """Every parameter (or only ``params``, read-only) whole on every rank inside the block."""
        if self.stage < 3:
            return nullcontext()
        import deepspeed  # lazy: deepspeed (ZeRO only; optional on CPU)

        # Parameters the ZeRO-3 prefetcher fetched for a forward that did not run (the last eval pass's
        # look-ahead) are still in flight; gathering them and partitioning again on exit fails with
        # "Cannot partition a param in flight" (a 7B DPO run's final save on 4 GPUs). Release them first,
        # through the ZeRO optimizer's own call: the engine's ``empty_partition_cache`` adds a full
        # ``gc.collect()`` and ``torch.cuda.empty_cache()``, and a bucketed weight sync gathers 15 times a step.
        self.engine.optimizer.empty_partition_cache()
        if params is not None:  # read-only: nothing is broadcast back on exit
            return deepspeed.zero.GatheredParameters(list(params), modifier_rank=None)
        return deepspeed.zero.GatheredParameters(list(self.engine.module.parameters()), modifier_rank=0)

    # ---- checkpoints: whole tensors by name, whatever the partitioning ---------------------------

    def _flat_partitions(self) -> list[torch.Tensor]:
        """The fp32 master partitions this rank's base optimizer steps (its state is keyed by them)."""
        zero = self.engine.optimizer
        return list(zero.fp32_partitioned_groups_flat if self.stage == 3 else zero.single_partition_of_fp32_groups)

    def _base_state(self) -> dict[Any, dict[str, Any]]:
        return self.engine.optimizer.optimizer.state

    def _link_states(self) -> None:
        """Point each parameter's fragment at the optimizer state (ZeRO-1/2; ZeRO-3 looks it up on access).

        DeepSpeed 0.19 links them once, right after the *first group's* first step, so the fragments
        of the other groups (our no-decay group) stay empty and ``safe_get_full_optimizer_state``
        fails for them; relinking once every group has state is what the first step should have done.
        (A private call: there is no public one.)
        """
        zero = self.engine.optimizer
        if hasattr(zero, "_lazy_init_hp_params_optimizer_state"):
            zero._hp_optimizer_states_linked = False
            zero._lazy_init_hp_params_optimizer_state()

    def optimizer_state(self) -> dict[str, Any]:
        """AdamW's state by parameter name, each tensor whole, on rank 0 (a collective: every rank calls
        it; the others get the learning rate and step only, not a CPU copy of everything)."""
        from deepspeed.utils import safe_get_full_optimizer_state  # lazy: deepspeed (ZeRO only; optional on CPU)

        from deepspeed.utils import safe_get_full_fp32_param  # lazy: deepspeed (ZeRO only; optional on CPU)

        base, flats = self._base_state(), self._flat_partitions()
        out: dict[str, Any] = {"lr": group_lr(self.engine.optimizer.param_groups), "step": {},
                               **{key: {} for key in ADAM_MOMENTS}}
        keep = torch.distributed.get_rank() == 0
        if self.bf16:  # the fp32 masters are the trained weights; the module holds their bf16 cast
            out["master"] = {}
            for name, param in named_trainable(self.engine.module).items():
                whole = safe_get_full_fp32_param(param)  # a collective, like the moments' gather
                if keep:
                    out["master"][name] = whole.detach().cpu()
        if not all(flat in base for flat in flats):
            return out  # before the first step: no state yet (the same on every rank)
        self._link_states()
        step = torch.tensor(float(base[flats[0]]["step"]), dtype=torch.float32)
        for name, param in named_trainable(self.engine.module).items():
            out["step"][name] = step
            for key in ADAM_MOMENTS:
                whole = safe_get_full_optimizer_state(param, key)  # every rank takes part in the gather
                if keep:
                    out[key][name] = whole.detach().cpu()
        return out

    def load_optimizer_state(self, state: dict[str, Any]) -> None:
        """Scatter a by-name state into this world's partitions (any world size wrote it)."""
        from deepspeed.utils import safe_set_full_optimizer_state  # lazy: deepspeed (ZeRO only; optional on CPU)

        set_lr(self.engine.optimizer.param_groups, state["lr"])
        if "master" in state and self.bf16:
            self._set_masters(state["master"], "the checkpoint's master weights")
        if not state["step"]:
            return
        step = float(next(iter(state["step"].values())))
        base = self._base_state()
        for flat in self._flat_partitions():
            # AdamW creates its state at the first step; make it now so the fragments can be filled
            entry = base.setdefault(flat, {key: torch.zeros_like(flat) for key in ADAM_MOMENTS})
            entry["step"] = torch.tensor(step, dtype=torch.float32)  # torch AdamW's type for it
        self._link_states()
        for name, param in named_trainable(self.engine.module).items():
            if name in state["step"]:
                for key in ADAM_MOMENTS:
                    safe_set_full_optimizer_state(param, state[key][name].to(torch.float32), key)

    def load_weights(self, weights: dict[str, torch.Tensor], where: str) -> None:
        """Weights into the module (gathered under ZeRO-3) and into the fp32 master partitions the
        optimizer steps (which DeepSpeed copied from the module when it started). Every rank reads
        the same ``weights``."""
        with self.gathered():
            if self.stage < 3 or torch.distributed.get_rank() == 0:
                assign_weights(self.engine.module, weights, where)
        self._set_masters(weights, where)

    def _set_masters(self, weights: dict[str, torch.Tensor], where: str) -> None:
        """``weights`` (whole tensors by name, the same on every rank) into the fp32 partitions the
        optimizer steps; a tied parameter saved once is found under its other name (ZeRO-1/2)."""
        from deepspeed.utils import safe_set_full_fp32_param  # lazy: deepspeed (ZeRO only; optional on CPU)

        tied = {p.data_ptr(): n for n, p in self.engine.module.state_dict(keep_vars=True).items()
                if n in weights} if self.stage < 3 else {}
        for name, param in named_trainable(self.engine.module).items():
            value = weights.get(name)
            if value is None and self.stage < 3:
                value = weights.get(tied.get(param.data_ptr(), ""))
            if value is None:
                raise ValueError(f"{where}: no weights for {name}")
            safe_set_full_fp32_param(param, value.to(torch.float32))

    def masters_into_model(self) -> None:
        """End of training (bf16 mode, ZeRO-1/2): the module's parameters become fp32 holding the gathered
        masters, so the final save is full precision (a collective). Under ZeRO-3 the module's
        parameters are partitions whose dtype the gather for saving fixes: the bf16 weights are saved."""
        if not self.bf16:
            return
        if self.stage == 3:
            log.info("zero3 with bf16: the final model is saved as the bf16 working weights, not the fp32 masters")
            return
        from deepspeed.utils import safe_get_full_fp32_param  # lazy: deepspeed (ZeRO only; optional on CPU)

        params = named_trainable(self.engine.module)
        whole = {name: safe_get_full_fp32_param(param) for name, param in params.items()}
        cast_parameters(self.engine.module, torch.float32)
        with torch.no_grad():
            for name, param in params.items():
                param.copy_(whole[name])


def build_strategy(kind: str, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                   scheduler: torch.optim.lr_scheduler.LRScheduler | None, world: World | None = None, *,
                   grad_accum: int = 1, max_grad_norm: float = 1.0, offload_optimizer: bool = False,
                   precision: Precision = Precision.FP32) -> Strategy:
    """The strategy ``kind`` (``ddp``, ``zero2``, ``zero3``) for ``world``; a single rank is always local.

    ``precision`` matters to DeepSpeed only (its bf16 mode); under Local and DDP the optimizer
    (:func:`rlhf_core.trainers.step.build_optimizer`) carries the regime.

    ``zero2``/``zero3`` need DeepSpeed; on a CPU-only world (gloo) they run on DeepSpeed's CPU
    accelerator, which is how the tests exercise the same code the GPUs run.
    """
    world = world or current_world()
    if kind not in PARALLEL_CHOICES:
        raise ValueError(f"parallel must be one of {', '.join(PARALLEL_CHOICES)}, got {kind!r}")
    if kind.startswith("zero"):
        return DeepSpeedStrategy(model, optimizer, scheduler, world, stage=int(kind[-1]), grad_accum=grad_accum,
                                 max_grad_norm=max_grad_norm, offload_optimizer=offload_optimizer,
                                 precision=precision)
    if not world.distributed:
        return LocalStrategy(model, optimizer, scheduler)
    return DDPStrategy(model, optimizer, scheduler, world)


def shard_frozen(model: torch.nn.Module, kind: str, world: World | None = None) -> torch.nn.Module:
    """A frozen model (the RL reference, the distillation teacher) partitioned as ``kind`` partitions the trained
    one: under ``zero3`` on more than one rank a DeepSpeed ZeRO-3 engine without an optimizer (ZeRO stage 3
    used for inference, Rajbhandari et al. 2020 Sec. 5; the engine builds its ``DeepSpeedZeRoOffload``), so each
    rank holds 1/N of the weights and gathers a layer's for its forward, as TRL's and OpenRLHF's references do
    under ZeRO-3. Otherwise the model itself, whole on every rank.

    A 7B reference held whole beside a ZeRO-3 policy was 15.2 GB of the 106.6 GB a GPU of our 7B GRPO step on
    four GPUs (BENCHMARKS.md); partitioned it is 3.8 GB plus the layers in flight. Every rank must then run the
    same number of forwards: the no-grad chunking agrees on it (:class:`rlhf_core.trainers.rl_forward.Sharded`).
    Call it after the model's kernels are prepared (liger patches modules in place). The parameters must
    have one dtype: bf16 (DeepSpeed's bf16 mode) or fp32.
    """
    world = world or current_world()
    if kind != "zero3" or not world.distributed:
        return model
    import deepspeed  # lazy: deepspeed (ZeRO only; optional on CPU)

    dtypes = {p.dtype for p in model.parameters()}
    if dtypes - {torch.bfloat16, torch.float32} or len(dtypes) != 1:
        raise ValueError(f"shard_frozen: a frozen model for ZeRO-3 needs one dtype, bf16 or fp32; got {sorted(map(str, dtypes))}")
    config = {
        "train_micro_batch_size_per_gpu": 1,  # unused without an optimizer, but DeepSpeed asks for a batch size
        "zero_optimization": {"stage": 3, "overlap_comm": next(model.parameters()).is_cuda},
        "bf16": {"enabled": torch.bfloat16 in dtypes},
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }
    engine, *_ = deepspeed.initialize(model=model, config=config)
    engine.eval()  # DeepSpeedEngine.train returns None, not the module
    return engine
