"""Precision regimes of a trained model: where weights, gradients, AdamW moments and master weights live.

``TrainerConfig.precision`` names one (``auto`` resolves to ``mixed`` on a bf16-capable CUDA GPU,
``fp32`` elsewhere, so the CPU pipeline's outputs do not move):

================  =============  =======================  ==============  =====================
regime            model weights  gradients (accumulated)  AdamW moments   fp32 master weights
================  =============  =======================  ==============  =====================
``fp32``          fp32           fp32                     fp32            none (weights are)
``mixed``         bf16           fp32 (bf16 under DDP)    fp32            yes, in the optimizer
``bf16``          bf16           bf16                     fp32            transient, per step
================  =============  =======================  ==============  =====================

``mixed`` is Micikevicius et al. 2018 ("Mixed Precision Training", Sec. 3.1) with bf16 instead of
fp16 (bf16 has fp32's exponent range, so no loss scaling is needed; Kalamkar et al. 2019): the
forward and backward run on a bf16 copy of the weights, with no autocast and so no fp32 -> bf16
cast of every weight in every micro-batch's forward (and again in checkpointed recomputation);
the optimizer holds the fp32 masters and writes the bf16 copy once per optimizer step. Updates
smaller than bf16's resolution (2^-8 relative) accumulate in the masters instead of being
rounded away. ``bf16`` is TRL's default (bf16 weights) with AdamW's moments kept in fp32: each
step makes an fp32 copy of the weights, steps it, and rounds it back, a chunk of parameters at a
time, so only moments persist beyond the weights and gradients.

Under DeepSpeed ZeRO (``rlhf_core.distributed.strategies.DeepSpeedStrategy``) both ``mixed`` and ``bf16`` are
DeepSpeed's own bf16 mode, whose ZeRO optimizer always keeps partitioned fp32 masters; ``mixed``
adds fp32 gradient accumulation (``data_types.grad_accum_dtype``). The optimizer here is then a
plain AdamW, which DeepSpeed wraps.

Pure torch: no DeepSpeed, Ray or transformers import. Tests: ``tests/unit/test_precision.py``
(hand-made tensors against torch's AdamW), ``tests/model/test_precision_tiny.py`` (tiny models).
"""

from __future__ import annotations

import enum
import functools
from typing import Any, Iterable, Sequence

import torch

# Elements per chunk of the bf16 regime's transient fp32 step: bounds its extra memory (an fp32
# copy of the chunk's weights and gradients, 8 bytes per element: 1 GiB) whatever the model size. Each
# chunk is one AdamW call, whose host work walks every parameter: at 2**25 a 0.5B model took 12 calls
# a step with ~1 ms of device idle between them (a profile, BENCHMARKS.md); at 2**27, 3. A chunk
# grows past this floor into memory the CUDA allocator already holds free (:func:`transient_chunk`).
BF16_STEP_CHUNK = 2**27


def transient_chunk(free_cached_bytes: int) -> int:
    """Elements per chunk of the bf16 regime's transient step: :data:`BF16_STEP_CHUNK`, or more when the
    allocator holds more than twice the chunk's 8 bytes an element free (reserved, not allocated: at the
    optimizer step, what the backward's activations used), so the copies fit in memory it already has
    and the card's reserved memory does not grow. Half, not all, of it: the free memory is split over
    cached blocks, and an allocation that fits no block reserves a new one."""
    return max(BF16_STEP_CHUNK, int(free_cached_bytes) // 16)


def free_cached_bytes(device: torch.device) -> int:
    """Bytes the CUDA caching allocator holds on ``device`` without handing them out (0 off CUDA). Host
    counters: no device synchronisation."""
    if device.type != "cuda":
        return 0
    return torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)


class Precision(enum.Enum):
    """A resolved precision regime (``auto`` is resolved by :meth:`resolve`)."""

    FP32 = "fp32"
    MIXED = "mixed"
    BF16 = "bf16"

    @classmethod
    def resolve(cls, setting: str, device: torch.device) -> Precision:
        """The regime ``setting`` (auto, fp32, mixed, bf16) names on ``device``.

        ``auto`` is ``mixed`` only on a GPU with bf16: CPUs without AMX run bf16 slower than fp32, and
        the tiny default model gains nothing from it. The one place a setting is resolved.
        """
        if setting != "auto":
            return cls(setting)
        return cls.MIXED if device.type == "cuda" and torch.cuda.is_bf16_supported() else cls.FP32

    @property
    def compute_dtype(self) -> torch.dtype | None:
        """The dtype the trained model computes in while it trains and samples (what a rollout engine
        samples in), ``None`` for fp32: nothing to cast."""
        return None if self is Precision.FP32 else torch.bfloat16

    @property
    def weight_dtype(self) -> torch.dtype:
        """The dtype of the model's parameters while it trains, and of frozen models (reference,
        teacher) beside it: they compute in the trained model's dtype."""
        return torch.float32 if self is Precision.FP32 else torch.bfloat16

    @property
    def load_dtype(self) -> torch.dtype:
        """The dtype to load the *trained* model in: fp32 under ``mixed``, so the masters start as the
        checkpoint's exact fp32 values (bf16 is cast from them afterwards); bf16 under ``bf16``."""
        return torch.bfloat16 if self is Precision.BF16 else torch.float32

    def keeps_masters(self, parallel: str) -> bool:
        """Whether fp32 master weights persist (and are checkpointed): always under ``mixed``; under
        ``bf16`` only with ZeRO, whose bf16 mode keeps them whatever we ask."""
        if self is Precision.FP32:
            return False
        return self is Precision.MIXED or parallel.startswith("zero")


def cast_parameters(model: torch.nn.Module, dtype: torch.dtype) -> None:
    """Every floating-point parameter of ``model`` to ``dtype``, in place (the Parameter objects stay,
    so optimizers and hooks that hold them still do). Buffers keep their dtype: RoPE's ``inv_freq``
    rounded to bf16 would shift every position's angle (transformers and DeepSpeed keep it fp32 too)."""
    for param in model.parameters():
        if param.is_floating_point() and param.dtype != dtype:
            param.data = param.data.to(dtype)


def clip_grad_norm_fp32(grads: Sequence[torch.Tensor], max_norm: float) -> torch.Tensor:
    """Scale ``grads`` in place so their global L2 norm is at most ``max_norm`` (0: no clipping); returns
    the norm before clipping, a 0-dim fp32 tensor on the first gradient's device (unread: no sync here).

    ``torch.nn.utils.clip_grad_norm_``'s rule (``coef = min(1, max_norm / (norm + 1e-6))``), with the
    norm accumulated in fp32 whatever the gradients' dtype: a bf16 norm is only good to ~3 digits.
    """
    if not grads:
        return torch.zeros((), dtype=torch.float32)
    # one multi-tensor kernel per device for the norms and one for the scaling (a 0.5B model has ~290
    # gradient tensors: per-tensor calls were ~600 kernel launches a step)
    by_device: dict[torch.device, list[torch.Tensor]] = {}
    for g in grads:
        by_device.setdefault(g.device, []).append(g)
    norms = [n.to(grads[0].device) for group in by_device.values()
             for n in torch._foreach_norm(group, 2, dtype=torch.float32)]
    total = torch.linalg.vector_norm(torch.stack(norms))
    if max_norm > 0:
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        for device, group in by_device.items():
            torch._foreach_mul_(group, coef.to(device))
    return total


def _accumulate_into(master: torch.Tensor, param: torch.Tensor) -> None:
    """Post-accumulate-grad hook of ``param``: add its bf16 gradient of this backward into ``master.grad``
    (fp32) and free it, so micro-batches accumulate in fp32 and at most one parameter's bf16
    gradient is alive at a time."""
    if master.grad is None:
        master.grad = param.grad.float()
    else:
        master.grad.add_(param.grad)
    param.grad = None


class MasterWeightAdamW(torch.optim.AdamW):
    """torch's AdamW stepping fp32 tensors on behalf of a bf16 model (the ``mixed`` and ``bf16`` regimes).

    A subclass, not a wrapper, because the schedule (``LambdaLR``) and the checkpoint code treat it as
    the AdamW it is; its ``param_groups`` and ``state`` are keyed by the fp32 tensors
    (:attr:`masters` maps each model parameter to its own), and :meth:`step` moves values between
    the two worlds:

    * ``mixed``: persistent fp32 masters, initialised from the parameters' values when built (build
      it before casting the model to bf16, and the masters are the loaded fp32 weights exactly).
      With ``grad_hooks`` (one process) each backward's bf16 gradient is added to the master's fp32
      ``.grad`` as soon as autograd accumulated it (:func:`_accumulate_into`, via
      ``Tensor.register_post_accumulate_grad_hook``); without (DDP, or gradients all-reduced by hand
      after backward: the hook would move a gradient before it is reduced), the bf16 gradients
      accumulate in ``param.grad`` and are cast at :meth:`clip_grad_norm_` / :meth:`step`.
      After AdamW's step: ``param <- bf16(master)``.
    * ``bf16``: the masters are empty placeholders (the keys of the persistent fp32 moments). A step
      fills them from the bf16 parameters and gradients, :func:`transient_chunk` elements at a time,
      steps, rounds back into the parameters and empties them again.

    With all tensors on CUDA, torch's fused AdamW kernel runs the update.
    """

    def __init__(self, groups: Sequence[dict[str, Any]], precision: Precision, *, lr: float,
                 betas: tuple[float, float], eps: float, grad_hooks: bool = False):
        if precision is Precision.FP32:
            raise ValueError("MasterWeightAdamW is for the mixed and bf16 regimes; fp32 uses torch.optim.AdamW")
        self.precision = precision
        self.masters: dict[torch.nn.Parameter, torch.Tensor] = {}
        master_groups = []
        for group in groups:
            for param in group["params"]:
                self.masters[param] = (param.detach().to(torch.float32, copy=True) if precision is Precision.MIXED
                                       else param.new_empty(0, dtype=torch.float32))
            master_groups.append({**group, "params": [self.masters[p] for p in group["params"]]})
        on_cuda = bool(self.masters) and all(m.is_cuda for m in self.masters.values())
        super().__init__(master_groups, lr=lr, betas=betas, eps=eps, fused=True if on_cuda else None)
        self.grad_hooks = grad_hooks and precision is Precision.MIXED
        if self.grad_hooks:
            for param, master in self.masters.items():
                param.register_post_accumulate_grad_hook(functools.partial(_accumulate_into, master))

    # ---- gradients ------------------------------------------------------------------------------

    def _collect_grads(self) -> None:
        """``mixed`` without hooks: cast the accumulated bf16 gradients into the masters' fp32 ``.grad``."""
        for param, master in self.masters.items():
            if param.grad is not None:
                grad = param.grad.float()
                master.grad = grad if master.grad is None else master.grad.add_(grad)
                param.grad = None

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """Clip this step's gradients wherever they are (fp32 masters under ``mixed``, bf16 parameters
        under ``bf16``) to global norm ``max_norm`` (0: measure only); returns the norm before clipping
        (:func:`clip_grad_norm_fp32`: a 0-dim tensor)."""
        if self.precision is Precision.MIXED:
            self._collect_grads()
            grads = [m.grad for m in self.masters.values() if m.grad is not None]
        else:
            grads = [p.grad for p in self.masters if p.grad is not None]
        return clip_grad_norm_fp32(grads, max_norm)

    def zero_grad(self, set_to_none: bool = True) -> None:
        super().zero_grad(set_to_none)
        for param in self.masters:
            param.grad = None

    # ---- the step -------------------------------------------------------------------------------

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:
        """One AdamW step of every parameter that has a gradient, then ``param <- bf16(fp32 result)``."""
        if closure is not None:
            raise ValueError("MasterWeightAdamW.step takes no closure")
        if self.precision is Precision.MIXED:
            self._collect_grads()
            stepped = [(p, m) for p, m in self.masters.items() if m.grad is not None]
            super().step()
            if stepped:
                params, masters = zip(*stepped)
                torch._foreach_copy_(list(params), list(masters))  # bf16 <- fp32, rounded as copy_ does
            return
        chunk: list[tuple[torch.nn.Parameter, torch.Tensor]] = []
        size = 0
        # one chunk (one AdamW call) for a 0.5B model on a GPU, whose backward freed ~14 GB: each call's
        # host work left the device idle a few ms (a profile of the SFT step, BENCHMARKS.md)
        limit = transient_chunk(free_cached_bytes(next(iter(self.masters)).device)) if self.masters else 0
        for param, master in self.masters.items():
            if param.grad is None:
                continue
            chunk.append((param, master))
            size += param.numel()
            if size >= limit:
                self._step_transient(chunk)
                chunk, size = [], 0
        if chunk:
            self._step_transient(chunk)

    def _step_transient(self, chunk: Iterable[tuple[torch.nn.Parameter, torch.Tensor]]) -> None:
        """``bf16``: fp32 copies of ``chunk``'s weights and gradients, one AdamW step (torch's skips every
        tensor without a gradient, i.e. the other chunks), rounded back; the copies are freed.

        The copies are views of two flat fp32 buffers, filled and rounded back by multi-tensor copies (one
        launch each way instead of one per tensor: ~870 launches a 0.5B step, each of a few microseconds'
        device work, had the device waiting on the host). Values are those of per-tensor ``float()`` and
        ``copy_``: bf16 -> fp32 is exact, fp32 -> bf16 rounds as ``copy_`` does."""
        chunk = list(chunk)
        params = [param for param, _ in chunk]
        grads = [param.grad for param in params]
        total = sum(param.numel() for param in params)
        weights = torch.empty(total, dtype=torch.float32, device=params[0].device)
        grad_buf = torch.empty_like(weights)
        # every shaped view in one C++ call each (DDP's bucket unflattening), not a slice and a view per tensor
        # from Python: the views were half of this step's host time (CPU, 290 tensors; bench/opt_host.py)
        weight_views = torch._utils._unflatten_dense_tensors(weights, params)
        grad_views = torch._utils._unflatten_dense_tensors(grad_buf, params)
        masters = [master for _, master in chunk]
        for master, weight, grad in zip(masters, weight_views, grad_views):
            master.data, master.grad = weight, grad
        torch._foreach_copy_(masters, params)  # under step's no_grad, as the mixed regime's copy back
        torch._foreach_copy_(list(grad_views), grads)
        for param in params:
            param.grad = None
        super().step()
        torch._foreach_copy_(params, masters)
        empty = weights.new_empty(0)
        for master in masters:
            master.grad = None
            master.data = empty

    # ---- masters in and out (checkpoints, final save) --------------------------------------------

    def set_masters(self, values: dict[torch.nn.Parameter, torch.Tensor]) -> None:
        """Load master values (fp32 from a checkpoint, or the model's own) and write them into the
        bf16 parameters; under ``bf16`` only the parameters are written (there are no masters)."""
        with torch.no_grad():
            for param, value in values.items():
                if self.precision is Precision.MIXED:
                    self.masters[param].copy_(value)
                    param.copy_(self.masters[param])
                else:
                    param.copy_(value)

    def masters_into_model(self, model: torch.nn.Module) -> None:
        """End of training (``mixed``): ``model``'s parameters become fp32 and the trained ones hold their
        masters, so a save writes full-precision weights. Under ``bf16`` the model stays as it is."""
        if self.precision is not Precision.MIXED:
            return
        cast_parameters(model, torch.float32)
        with torch.no_grad():
            for param, master in self.masters.items():
                param.copy_(master)

    def state_dict(self) -> dict[str, Any]:
        """torch's optimizer state (moments by position), plus the fp32 masters under ``mixed``."""
        out = super().state_dict()
        if self.precision is Precision.MIXED:
            out["masters"] = [m.detach().clone() for m in self.masters.values()]
        return out

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        state_dict = dict(state_dict)
        masters = state_dict.pop("masters", None)
        super().load_state_dict(state_dict)
        if masters is not None:
            self.set_masters(dict(zip(self.masters, masters)))


def state_key(optimizer: torch.optim.Optimizer, param: torch.nn.Parameter) -> torch.Tensor:
    """The tensor ``optimizer.state`` keys ``param``'s AdamW state by (its master, or ``param`` itself)."""
    if isinstance(optimizer, MasterWeightAdamW):
        return optimizer.masters[param]
    return param
