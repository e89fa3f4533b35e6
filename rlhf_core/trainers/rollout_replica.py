"""The rollout role under Ray: a rollout engine on its own copy of the policy, inside a rollout actor.

Built by :func:`rlhf_core.trainers.rl_on_ray.train_rl_on_ray` in each :class:`rlhf_core.trainers.ray_launcher.RolloutActor`;
it generates for the controller, takes the learner's weights however ``rl.distribution.weight_sync`` moves them (a
state dict, CUDA IPC handles, ZeRO-3 buckets, or a broadcast in a weight-sync group), and under ``rl.rollout.sleep``
frees them between a rollout and the next sync.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

from rlhf_core.distributed.parallel import resident_weight_bytes
from rlhf_core.distributed.weight_sync import SyncGroup, bucket_views, unflatten_bucket
from rlhf_core.models.loading import load_causal_lm, load_tokenizer, pick_device, prepare_for_training
from rlhf_core.models.precision import Precision
from rlhf_core.rollout.engine import LoadsWeightBuckets, tensor_bytes
from rlhf_core.trainers import rl_forward
from rlhf_core.trainers.rl_forward import release_memory
from rlhf_core.trainers.rl_parts import build_rollout_engine, syncs_adapters


def replicas_hold_adapters(cfg: Any) -> bool:
    """Whether rollout replicas hold a LoRA policy's frozen base and take its adapters alone at each sync
    (:func:`rlhf_core.trainers.rl_parts.syncs_adapters`: the static and HF engines hold the adapters injected as the
    learner does, vLLM serves them as a LoRA adapter). Without this a 32B LoRA policy's sync was its whole merged
    model, 65.5 GB through the object store, for ~0.3 GB of adapters (BENCHMARKS.md, issue 22's memory plan)."""
    return syncs_adapters(cfg)


class RolloutReplica:
    """A rollout engine on its own copy of the starting policy (built inside the actor).

    With mixed precision the copy is held in the compute dtype (bf16) only: it exists to sample,
    and the learner sends its weights already cast (half the bytes of fp32).
    """

    def __init__(self, cfg: Any):
        device = pick_device()
        self.dtype = Precision.resolve(cfg.precision, device).compute_dtype
        # loaded in the compute dtype directly: parameters bf16, buffers (RoPE's inv_freq) fp32, as the learner's
        policy = load_causal_lm(cfg.model_path, device, self.dtype or torch.float32, cfg.attention)
        if replicas_hold_adapters(cfg):  # the learner's adapter layout: each sync sends the adapters alone
            prepare_for_training(policy, lora_rank=cfg.lora_rank, lora_alpha=cfg.lora_alpha,
                                 lora_dropout=cfg.lora_dropout)
        policy.eval().requires_grad_(False)
        self.engine = build_rollout_engine(cfg, policy, load_tokenizer(cfg.model_path), self.dtype)
        self._released: dict[str, torch.Size] | None = None  # rl.rollout.sleep: the shapes of released weights
        self._filled: set[str] = set()

    def generate(self, prompts: Sequence[str], params: Any) -> Any:
        self._check_awake()
        batch = self.engine.generate(prompts, params)
        self._after_rollout()
        return batch

    def generate_ids(self, encoded: Sequence[list[int]], params: Any, prompts: Sequence[str]) -> Any:
        self._check_awake()
        batch = self.engine.generate_ids(encoded, params, prompts)
        self._after_rollout()
        return batch

    def _after_rollout(self) -> None:
        """Colocated (the GPU shared with learner ranks: ``rl_forward.RELEASE_MEMORY``): the static engine's kept
        decoder (KV cache, fused copies, graphs) is dropped and the cache's blocks go back before the learner's
        phase."""
        if rl_forward.RELEASE_MEMORY:
            self._release_decoder()
        release_memory()

    def _release_decoder(self) -> None:
        release = getattr(self.engine, "release_decoder", None)  # the static engine's; others keep none
        if release is not None:
            release()

    # ---- rl.rollout.sleep: the weights' memory handed back between a rollout and the next sync ------
    #
    # vLLM's sleep mode (level 2) for our engines: a colocated replica's copy of the policy is needed only
    # while it generates, and the sync after every update overwrites all of it, so between the two it is
    # freed (a 7B policy: 15.2 GB of each GPU during the reference, old log-prob and update phases). A
    # parameter keeps its Parameter object, shape and dtype (the engine's modules, the weight-bucket maps
    # and the sync's layout stay valid) but holds an empty tensor until :meth:`_wake` gives it storage again.

    def release_weights(self) -> int:
        """Free the engine's weights (buffers such as RoPE tables stay); returns the bytes freed. A sync must
        refill every one before the next :meth:`generate`."""
        model = self.engine.model
        if getattr(self.engine, "sampler", None) is not None:
            raise RuntimeError("rollout replica: rl.rollout.sleep cannot release a replica that samples through a "
                               "copy of its weights in another dtype")
        if self._released is not None:
            return 0
        freed = resident_weight_bytes(model)
        self._release_decoder()  # its fused copies and graphs belong to the storage released here
        self._released = {}
        for name, p in model.named_parameters():
            self._released[name] = p.shape
            p.data = torch.empty(0, dtype=p.dtype, device=p.device)
        self._filled = set()
        release_memory()
        return freed

    def _wake(self) -> None:
        """Storage for every released weight again (uninitialised: the sync that calls this fills it)."""
        if self._released is None or self._filled:
            return
        for name, p in self.engine.model.named_parameters():
            p.data = torch.empty(self._released[name], dtype=p.dtype, device=p.device)

    def _filled_by_sync(self, names: Any, last: bool) -> None:
        """Record what a sync wrote; at its end every released weight must have been written."""
        if self._released is None:
            return
        self._filled.update(names)
        if last:
            missing = sorted(set(self._released) - self._filled)
            if missing:
                raise RuntimeError(f"rollout replica: the weight sync left {len(missing)} released weight(s) "
                                   f"unwritten ({missing[:3]}); refusing to sample from uninitialised memory")
            self._released, self._filled = None, set()

    def _check_awake(self) -> None:
        if self._released is not None:
            raise RuntimeError("rollout replica: its weights were released after the last rollout (rl.rollout.sleep) "
                               "and no weight sync has refilled them since")

    def update_weights(self, weights: Any) -> int:
        """The learner's weights into the engine; the bytes the engine took in (``perf/weight_sync_bytes``)."""
        self._wake()
        if isinstance(weights, dict) and "cuda_ipc" in weights:  # a rank's buffer on this GPU
            if getattr(self, "_shared", None) is None:  # map it once; the rank refills it in place
                rebuild, args = weights["cuda_ipc"]
                self._shared = rebuild(*args)
            flat = self._shared
            weights = {name: flat[offset:offset + _numel(shape)].view(shape)
                       for name, shape, offset in weights["layout"]}
        moved = self.engine.update_weights(weights)
        # a whole state dict (the engine's load is strict) or a model: every released weight was written
        self._filled_by_sync(self._released or (), last=True)
        return int(moved or 0)

    def load_bucket(self, payload: dict[str, Any]) -> int:
        """One bucket of a ZeRO-3 sync (:class:`rlhf_core.trainers.rl_on_ray.ZeroBuckets`) from the staging buffer of the rank on this GPU into
        the engine's model, in place (captured CUDA graphs stay valid); the last one refreshes a sampling copy.
        Returns the bucket's bytes."""
        if getattr(self, "_staging", None) is None:  # map it once; the rank refills it in place
            rebuild, args = payload["cuda_ipc"]
            self._staging = rebuild(*args)
            self._params = dict(self.engine.model.named_parameters())
        self._wake()
        flat, moved = self._staging, 0
        with torch.no_grad():
            for name, shape, offset in payload["layout"]:
                self._params[name].copy_(flat[offset:offset + _numel(shape)].view(shape))
                moved += _numel(shape) * flat.element_size()
        torch.cuda.synchronize()  # the rank refills the buffer for the next bucket after this returns
        self._filled_by_sync([name for name, _, _ in payload["layout"]], payload["last"])
        if payload["last"] and getattr(self.engine, "sampler", None) is not None:
            self.engine.update_weights(self.engine.model)
        return moved

    # ---- rl.distribution.weight_sync collective: a receiver of the weight-sync group (distributed.weight_sync) ------

    def join_weight_sync(self, addr: str, port: int, rank: int, size: int, timeout_s: float, layout: Any) -> None:
        """Rank ``rank`` (>= 1) of the weight-sync group. The layout must name every parameter of the engine's
        model, in the dtype it holds them (a mismatch would leave weights stale without a word)."""
        model = getattr(self.engine, "model", None)  # vLLM's lives in its workers: names mapped by load_weights
        if model is not None:
            params = dict(model.named_parameters())
            sent = {spec.name: spec for bucket in layout for spec in bucket}
            missing = sorted(set(params) - set(sent))
            wrong = sorted(n for n, s in sent.items() if n not in params or params[n].dtype != s.dtype)
            if missing or wrong:
                raise ValueError(f"weight sync: the learner's layout does not fit this replica's model: "
                                 f"missing {missing[:5]}, unknown or of another dtype {wrong[:5]}")
        self._sync_layout = layout
        self._sync_group = SyncGroup(addr, port, rank, size, timeout_s, pick_device())
        self._sync_group.allocate(layout)

    def receive_weights(self) -> int:
        """One sync: each bucket broadcast from policy rank 0 into the flat buffers, handed to the engine as
        named views (:class:`rlhf_core.rollout.engine.LoadsWeightBuckets`: copied in place), or, for an engine without
        that seam, gathered into one state dict for its ``update_weights``. Returns the bytes received."""
        group, layout = self._sync_group, self._sync_layout
        whole: dict[str, torch.Tensor] = {}
        self._wake()
        moved = 0
        for i, bucket in enumerate(layout):
            flats = bucket_views(bucket, group.buffers)
            group.broadcast(flats)
            named = unflatten_bucket(flats, bucket)
            moved += tensor_bytes(named)
            if isinstance(self.engine, LoadsWeightBuckets):
                self.engine.load_weight_bucket(named, last=i == len(layout) - 1)
                self._filled_by_sync(named, last=i == len(layout) - 1)
            else:
                whole.update({k: v.clone() for k, v in named.items()})
        if whole:
            self.engine.update_weights(whole)
            self._filled_by_sync(whole, last=True)
        if group.device.type == "cuda":
            torch.cuda.synchronize()  # the sync's time is its real end; the next bucket's buffer is free
        return moved

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The weights the engine samples from, on the CPU (a check that a sync arrived; vLLM's are in its workers)."""
        return {k: v.detach().cpu().clone() for k, v in self.engine.model.state_dict().items()}

    def leave_weight_sync(self) -> None:
        """Close this replica's side of the weight-sync group (once; see :meth:`rlhf_core.trainers.rl_on_ray.CollectiveSync.close`)."""
        group, self._sync_group = getattr(self, "_sync_group", None), None
        if group is not None:
            group.close()

    def close(self) -> None:
        self.leave_weight_sync()
        if hasattr(self.engine, "close"):
            self.engine.close()


def _numel(shape: Sequence[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n
