"""Online RL on Ray: this process is the single controller, the models run in actor groups.

:func:`train_rl_on_ray` runs :func:`rlhf_core.trainers.rl.train_rl` here with the policy learner as N
data-parallel ranks, reference scorers, rollout replicas (:class:`rlhf_core.trainers.rollout_replica.RolloutReplica`)
and (for ``reward_kind: model``) a reward model in actors made by :mod:`rlhf_core.trainers.ray_launcher`.
The controller talks to each group through a handle with the same methods as the in-process role
(:class:`RemoteLearner`, :class:`RemoteReference`, :class:`RemoteRollout`, :class:`RemoteReward`).
``alignflow rl --set placement=colocated --set num_workers=2``.

*Colocated*: one bundle per policy rank and
every role takes a fraction of it (reference rank i, rollout replica i, the reward model and, for
on-policy distillation, teacher rank i share policy rank i's device; each role hands its cached memory
back after its phase).
*Disaggregated*: the devices split in two sides, the learning side (policy ranks, each with a reference
rank on its bundle, as colocated) and the generating side (rollout replicas, with the reward model on
replica 0's bundle, since rewards are scored as batches are generated): one policy rank and one replica
run on two GPUs. Only generation can overlap the update (asynchronous training, ``max_staleness >= 1``);
the reference's pass and the update run one after the other on the learning side in either mode, so a
bundle of its own would sit idle. Synchronous and asynchronous runs therefore use the same devices, and
``max_staleness`` 0 against 1 compares like with like.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, replace
from typing import Any, Sequence

import ray
import torch

from rlhf_core.algorithms.rl_math import AdvantageEstimator
from rlhf_core.distributed.parallel import World, assign_weights
from rlhf_core.distributed.weight_sync import SyncPath, WeightSync, resolve_path
from rlhf_core.models.loading import (adapter_parameters, copy_adapters, load_causal_lm, load_tokenizer, pick_device,
                                      prepare_for_training)
from rlhf_core.models.precision import Precision
from rlhf_core.rewards.sources import build_reward_source
from rlhf_core.trainers.ray_launcher import (ActorGroup, Launcher, ReferenceActor, RewardModelActor, RolloutActor,
                                             TrainerActor, cluster_has_gpus, connect, gather)
from rlhf_core.trainers.rl import train_rl
from rlhf_core.trainers.rl_parts import concat_batches
from rlhf_core.trainers.rl_roles import (BaseReference, PolicyLearner, ReferenceScorer, base_is_reference,
                                         reference_sharded)
from rlhf_core.trainers.rollout_replica import RolloutReplica, replicas_hold_adapters
from rlhf_core.trainers.step import seed_everything

log = logging.getLogger(__name__)



def _interleave(shards: Sequence[torch.Tensor]) -> torch.Tensor:
    """Undo ``rows rank::N`` sharding: shard r holds rows r, r+N, ... of the result."""
    n = len(shards)
    rows = sum(s.shape[0] for s in shards)
    out = torch.empty((rows, *shards[0].shape[1:]), dtype=shards[0].dtype)
    for r, s in enumerate(shards):
        out[r::n] = s
    return out


class RemoteLearner:
    """The controller's handle on the policy learner group: same methods as :class:`PolicyLearner`."""

    def __init__(self, group: ActorGroup, cfg: Any):
        self.group, self.cfg = group, cfg
        # A CPU copy of the policy for evaluation and saving, refreshed from rank 0 on demand. A LoRA policy's is
        # what the ranks hold, the frozen base (in their dtype) with adapters injected, and a refresh fetches the
        # adapters alone, as the replicas' syncs do: a 32B policy's merged weights were 65.5 GB gathered whole on
        # every GPU beside its shard (more than a GPU holding a replica has), one 65.5 GB Ray object and a
        # 131 GB fp32 copy here, for ~0.3 GB of adapters (BENCHMARKS.md, issue 22's plan).
        self.adapters_only = bool(cfg.lora_rank)
        dtype = getattr(torch, group.call_all("base_dtype")[0]) if self.adapters_only else torch.float32
        self.policy = load_causal_lm(cfg.model_path, torch.device("cpu"), dtype, cfg.attention)
        if self.adapters_only:
            prepare_for_training(self.policy, lora_rank=cfg.lora_rank, lora_alpha=cfg.lora_alpha,
                                 lora_dropout=cfg.lora_dropout)
        self.policy.eval().requires_grad_(False)
        self._fresh = not self.adapters_only  # this copy's adapters start random: the first view fetches rank 0's
        self._buckets: int | None = None

    def score(self, exp: dict[str, torch.Tensor], prompt_width: int) -> dict[str, torch.Tensor]:
        exp = {k: v.cpu() for k, v in exp.items()}
        outs = self.group.call_all("score", exp, prompt_width)
        return {k: _interleave([o[k] for o in outs]) for k in outs[0]}

    def update(self, exp: dict[str, torch.Tensor], prompt_width: int, orders: list[torch.Tensor], kl_coef: float,
               step: int) -> dict[str, list[float]]:
        self._fresh = False
        exp = {k: v.cpu() for k, v in exp.items()}
        return self.group.call_all("update", exp, prompt_width, orders, kl_coef, step)[0]

    def reference_logprobs(self, exp: dict[str, torch.Tensor], prompt_width: int) -> torch.Tensor:
        """The LoRA policy's base as the reference (:class:`rlhf_core.trainers.rl_roles.BaseReference`): rows
        split across the policy ranks as the reference ranks split them."""
        exp = {k: v.cpu() for k, v in exp.items()}
        return _interleave(self.group.call_all("reference_logprobs", exp, prompt_width))

    def end_iteration(self) -> float:
        return self.group.call_all("end_iteration")[0]

    def engine_weights(self, engine: Any = None) -> Any:
        """Rank 0's weights as a Ray object (every rank takes part: ZeRO-3 gathers them), in the
        engine's compute dtype when it samples in one; for replicas in a weight-sync group, the
        :class:`CollectiveSync` that :meth:`RemoteRollout.update_weights` runs; for replicas holding a LoRA
        policy's base and adapters (:func:`replicas_hold_adapters`), the adapters alone."""
        if isinstance(engine, RemoteRollout) and engine.collective is not None:
            return engine.collective
        dtype = _engine_dtype(self.cfg) if isinstance(engine, RemoteRollout) else None
        if isinstance(engine, RemoteRollout) and engine.beside_ranks:
            # replica i shares rank i's GPU: CUDA IPC handles, one per rank (None where it cannot work)
            handles = self.group.call_all("share_weights", dtype)
            if all(h is not None for h in handles):
                return PerReplica(handles)
            if self.cfg.parallel == "zero3" and not self.cfg.lora_rank and self.cfg.rollout.engine != "vllm":
                if self._buckets is None:  # planned once: the parameters never change
                    self._buckets = self.group.call_all("weight_buckets", SYNC_BUCKET_BYTES, dtype)[0]
                return ZeroBuckets(self.group, self._buckets, dtype)
        adapters_only = isinstance(engine, RemoteRollout) and replicas_hold_adapters(self.cfg)
        return self._rank0_weights(dtype, adapters_only, fetch=not isinstance(engine, RemoteRollout))

    def _rank0_weights(self, dtype: torch.dtype | None, adapters_only: bool, fetch: bool = True) -> Any:
        """Rank 0's :meth:`PolicyLearner.engine_weights` (every rank takes part); ``fetch=False`` leaves them in the
        object store and returns the Ray reference (weights headed for the replicas)."""
        refs = [a.call.remote("engine_weights", None, dtype, adapters_only) for a in self.group.actors]
        return gather(refs, "policy.engine_weights", fetch_first=fetch)[0]

    def view(self) -> Any:
        """The controller's copy of the policy with rank 0's current weights."""
        if not self._fresh:
            started = time.perf_counter()
            weights = self._rank0_weights(None, self.adapters_only)
            if self.adapters_only:  # the frozen base is here already (strictly the adapters' names)
                if not copy_adapters(self.policy, weights):
                    odd = sorted(set(weights) ^ set(adapter_parameters(self.policy)))[:3]
                    raise RuntimeError(f"ray: rank 0 sent adapters {odd} that do not match the controller's copy")
            else:
                self.policy.load_state_dict(weights)
            self._fresh = True
            # at 7B this is the end of a run's largest cost (BENCHMARKS.md, issue 22's plan): say what it took
            log.info("ray: the controller's copy of the policy took rank 0's weights (%.2f GB) in %.1f s",
                     sum(t.numel() * t.element_size() for t in weights.values()) / 2**30, time.perf_counter() - started)
        return self.policy

    def masters_into_model(self) -> None:
        """Every rank's policy takes its fp32 masters (mixed precision); the next :meth:`view` fetches them."""
        self.group.call_all("masters_into_model")
        self._fresh = False

    def state_dict(self) -> dict[str, Any]:
        return self.group.call_all("state_dict")[0]

    def load_state_dict(self, state: dict[str, Any], policy_weights: dict[str, torch.Tensor]) -> None:
        """A checkpoint's state and weights on every rank (stored once in the object store) and in the
        controller's view."""
        assign_weights(self.policy, policy_weights, "rl checkpoint")
        self.group.call_all("load_state_dict", state, ray.put(policy_weights))
        self._fresh = True


class RemoteReference:
    """The controller's handle on the reference scorers: rows split across replicas."""

    def __init__(self, group: ActorGroup):
        self.group = group

    def logprobs(self, exp: dict[str, torch.Tensor], prompt_width: int) -> torch.Tensor:
        exp = {k: v.cpu() for k, v in exp.items()}
        return _interleave(self.group.call_all("logprobs", exp, prompt_width))


class PerReplica(list):
    """Weights payloads, one per rollout replica in order (CUDA IPC handles of the ranks beside them)."""


SYNC_BUCKET_BYTES = 1 << 30
"""ZeRO-3 weight sync to colocated replicas: the most bytes whole on a rank at once (a larger single
weight, a 7B model's 1.09 GB embedding, gets a bucket of its own)."""


@dataclass
class ZeroBuckets:
    """ZeRO-3 weights for colocated replicas, moved bucket by bucket (:meth:`PolicyLearner.share_bucket`): the
    learner group and how many buckets; :meth:`RemoteRollout.update_weights` drives the transfer."""

    learners: ActorGroup
    count: int
    dtype: torch.dtype | None


def resolve_rollout_sleep(cfg: Any, gpus: bool) -> bool:
    """``rl.rollout.sleep`` for this run: ``on`` as configured (the config checked it can work), ``auto`` on GPUs where
    it can (colocated replicas sharing a GPU with the learner, synchronous, hf or static engine, whole-weight syncs, no
    FP8 sampling copy);
    off on CPUs, where the replica's weights are host memory and nothing is gained."""
    if cfg.rollout.sleep != "auto":
        return cfg.rollout.sleep == "on"
    return (gpus and cfg.distribution.placement == "colocated" and cfg.rollout.engine in ("hf", "static")
            and not cfg.lora_rank and not cfg.off_policy.max_staleness and not cfg.rollout.fp8)


def _engine_dtype(cfg: Any) -> torch.dtype | None:
    """The dtype rollout replicas hold their weights in (the compute dtype; ``None``: the policy's own)."""
    return Precision.resolve(cfg.precision, pick_device()).compute_dtype


@dataclass
class CollectiveSync:
    """``rl.distribution.weight_sync`` collective (:mod:`rlhf_core.distributed.weight_sync`): policy rank 0 and
    ``replicas`` form a group of their own. Per sync every learner rank walks the buckets (ZeRO-3: each gathered by all
    of them), rank 0 broadcasts each, and the replicas receive it into their engines; the first actor to fail fails the
    sync."""

    learners: ActorGroup
    replicas: list[Any]

    def run(self) -> int:
        """One sync; the bytes the replicas received, all of them together."""
        refs = [a.call.remote("broadcast_weights") for a in self.learners.actors]
        received = gather(refs + [r.call.remote("receive_weights") for r in self.replicas], "weight sync (collective)")
        return sum(int(b or 0) for b in received[len(refs):])

    def close(self) -> None:
        """Every member closes its side at once. One at a time (as each actor group is shut down in turn) an
        NCCL member blocks in its communicator's teardown until its peers reach theirs, which they never do
        before the first one's leave times out: on two H100s each run's exit took minutes."""
        gather([self.learners.actors[0].call.remote("leave_weight_sync")]
               + [r.call.remote("leave_weight_sync") for r in self.replicas], "weight sync group close")


class RemoteRollout:
    """A :class:`rlhf_core.rollout.engine.RolloutEngine` over rollout replicas: prompts split, batches joined.

    ``beside_ranks``: replica ``i`` runs on policy rank ``i``'s GPU (colocated, one replica per rank),
    so weights can move GPU to GPU through CUDA IPC (:meth:`PolicyLearner.share_weights`).
    ``collective``: the replicas are in a weight-sync group with policy rank 0 (:func:`_open_weight_sync`).
    """

    def __init__(self, group: ActorGroup, pad_id: int, inner_name: str, beside_ranks: bool = False,
                 collective: CollectiveSync | None = None, sleeps: bool = False):
        self.group, self.pad_id, self.inner_name = group, pad_id, inner_name
        self.beside_ranks, self.collective = beside_ranks, collective
        self.sleeps = sleeps  # rl.rollout.sleep resolved (:func:`resolve_rollout_sleep`)
        self._said_freed = False

    def release_weights(self) -> int:
        """rl.rollout.sleep: every replica frees its weights until the next sync
        (:meth:`RolloutReplica.release_weights`); returns the bytes freed over all replicas (0 when the replicas keep
        their weights)."""
        if not self.sleeps:
            return 0
        freed = sum(self.group.call_all("release_weights"))
        if not self._said_freed:
            log.warning("ray: rollout replicas free %.1f MB of weights each between a rollout and the weight sync "
                        "(rl.rollout.sleep)", freed / len(self.group) / 2**20)
            self._said_freed = True
        return freed

    @property
    def name(self) -> str:
        return f"ray[{len(self.group)}x{self.inner_name}]"

    def generate(self, prompts: Sequence[str], params: Any) -> Any:
        return self._split("generate", list(prompts), params)

    def generate_ids(self, encoded: Sequence[list[int]], params: Any, prompts: Sequence[str] | None = None) -> Any:
        """One turn of a multi-turn rollout (:func:`rlhf_core.rollout.environments.rollout_with_environment`): each
        trajectory's exact ids go to a replica and come back with the turn appended. The environment itself
        stays in this process (the controller), so a Python-file or HTTP environment needs nothing of Ray."""
        labels = list(prompts) if prompts is not None else [""] * len(encoded)
        return self._split("generate_ids", [list(ids) for ids in encoded], params, labels)

    def _split(self, method: str, rows: list[Any], params: Any, labels: list[str] | None = None) -> Any:
        """``method`` on contiguous chunks of ``rows``, a chunk per replica (replica i's seed: the seed + i), the
        batches joined in order."""
        k = min(len(self.group), len(rows))
        size = -(-len(rows) // k)
        refs = []
        for i, start in enumerate(range(0, len(rows), size)):
            args = (rows[start:start + size],) + (() if labels is None else (labels[start:start + size],))
            seeded = replace(params, seed=None if params.seed is None else params.seed + i)
            refs.append(self.group.actors[i].call.remote(method, args[0], seeded, *args[1:]))
        return concat_batches(gather(refs, "rollout"), self.pad_id)

    def update_weights(self, weights: Any) -> int:
        """Push weights (a Ray object reference, fetched once per node, a state dict, or one CUDA IPC
        payload per replica) to every replica, or broadcast them through the weight-sync group. Returns the bytes
        the replicas took in, all of them together (each takes its own copy)."""
        if isinstance(weights, CollectiveSync):
            return weights.run()
        if isinstance(weights, PerReplica):
            return sum(gather([a.call.remote("update_weights", w) for a, w in zip(self.group.actors, weights)],
                              "weight sync"))
        if isinstance(weights, ZeroBuckets):  # rank i's staging buffer -> replica i, a bucket at a time
            moved = 0
            for index in range(weights.count):
                payloads = weights.learners.call_all("share_bucket", index, weights.dtype)
                moved += sum(gather([a.call.remote("load_bucket", p) for a, p in zip(self.group.actors, payloads)],
                                    f"weight sync bucket {index}"))
            return moved
        return sum(self.group.call_all("update_weights", weights))


class RemoteReward:
    """A :class:`rlhf_core.rewards.sources.RewardSource` served by a reward-model actor."""

    def __init__(self, group: ActorGroup):
        self.group = group

    def __call__(self, prompts: Sequence[str], completions: Sequence[str], labels: Sequence[str | None]) -> list[float]:
        return gather([self.group.actors[0].call.remote("__call__", list(prompts), list(completions), list(labels))],
                      "reward model")[0]


def _reward_model(cfg: Any) -> Any:
    return build_reward_source("model", path=cfg.reward.model_path, device=pick_device(), batch_size=cfg.batch_size,
                               attention=cfg.attention)


def _reference(cfg: Any, rank: int, size: int, model_path: str | None = None) -> Any:
    return ReferenceScorer(cfg, world=World(rank, size), model_path=model_path)


def _learner(cfg: Any) -> Any:
    # a LoRA policy's adapters start random (peft's A); seeded, every run of a config starts from the same ones,
    # as one process does (train_rl seeds before it builds the learner)
    seed_everything(cfg.seed)
    return PolicyLearner(cfg)


def _open_weight_sync(cfg: Any, policy: ActorGroup, rollout: ActorGroup, beside_rank0: Sequence[int]) -> CollectiveSync:
    """``rl.distribution.weight_sync`` collective: the buckets planned on every learner rank, then policy rank 0 (group
    rank 0, hosting the group's store) and every replica (ranks 1..) join a group of their own."""
    if beside_rank0:
        raise ValueError(f"rl.distribution.weight_sync collective: rollout replica(s) {list(beside_rank0)} share "
                         "policy rank 0's "
                         f"GPU (colocated placement), and NCCL cannot put two ranks of one group on one GPU; use "
                         f"weight_sync auto (CUDA IPC to colocated replicas) or placement disaggregated")
    layout = policy.call_all("sync_layout", SYNC_BUCKET_BYTES, _engine_dtype(cfg))[0]
    addr, port = ray.get(policy.actors[0].rendezvous.remote())
    size, timeout = len(rollout) + 1, cfg.collective_timeout_s
    refs = [policy.actors[0].call.remote("join_weight_sync", addr, port, size, timeout)]
    refs += [a.call.remote("join_weight_sync", addr, port, i + 1, size, timeout, layout)
             for i, a in enumerate(rollout.actors)]
    gather(refs, "weight sync group")
    log.warning("ray: weight sync through a %s group of policy rank 0 and %d replica(s), %d bucket(s)",
                "nccl" if cluster_has_gpus() else "gloo", len(rollout), len(layout))
    return CollectiveSync(policy, list(rollout.actors))


def train_rl_on_ray(cfg: Any, sink: Any = None, show_progress: bool = True) -> Any:
    """:func:`rlhf_core.trainers.rl.train_rl` with its models in Ray actors placed as ``cfg.distribution.placement``
    says."""
    if cfg.distribution.placement not in ("colocated", "disaggregated"):
        raise ValueError("rl.distribution.placement must be colocated or disaggregated to run on Ray, got "
                         f"{cfg.distribution.placement!r}")
    workers, replicas = cfg.num_workers, cfg.distribution.rollout_workers
    reward_model = cfg.reward.kind == "model"
    # on-policy distillation: teacher ranks beside the references
    teacher = AdvantageEstimator(cfg.algorithm.estimator).needs_teacher
    colocated = cfg.distribution.placement == "colocated"
    # a reference rank beside each policy rank, in either placement (module docstring); none where a LoRA
    # policy's frozen base is the reference (the policy ranks score it with their adapters off)
    base_ref = base_is_reference(cfg)
    n_refs = 0 if base_ref else workers
    sharded = reference_sharded(cfg)  # ZeRO-3: reference and teacher ranks each form a world and partition
    bundles = workers if colocated else workers + replicas
    connect(min_cpus=bundles)
    launcher = Launcher(cluster_has_gpus(), cfg)
    started = time.perf_counter()
    with launcher.running():  # a failed rank tears every group down at once (no wait on its peers)
        if colocated:
            pg = launcher.bundles(workers)
            ranks = list(range(workers))
            pgs = {"policy": (pg, ranks), "reference": (pg, ranks),
                   "rollout": (pg, [i % workers for i in range(replicas)]), "reward": (pg, [0])}
            share = 1.0 / (3 + reward_model + teacher - base_ref)  # every role on a rank's bundle takes a fraction
        else:  # two sides: learning (policy + reference ranks) and generating (replicas + reward model)
            learning, generating = launcher.bundles(workers), launcher.bundles(replicas)
            pgs = {"policy": (learning, range(workers)), "reference": (learning, range(workers)),
                   "rollout": (generating, range(replicas)), "reward": (generating, [0])}
            share = 1.0 / (2 + teacher - base_ref)  # policy + reference (+ teacher) | replica + reward model
        threads = cfg.num_threads
        policy = launcher.group(TrainerActor, "policy", *pgs["policy"], share=share, num_threads=threads, world=True)
        policy.build(_learner, cfg)
        learner = RemoteLearner(policy, cfg)
        if base_ref:
            reference_scorer: Any = BaseReference(learner)
        else:
            reference = launcher.group(ReferenceActor, "reference", *pgs["reference"], share=share, num_threads=threads,
                                       world=sharded)
            reference.build(_reference, cfg, per_rank=lambda i: {"rank": i, "size": n_refs})
            reference_scorer = RemoteReference(reference)
        rollout = launcher.group(RolloutActor, "rollout", *pgs["rollout"], share=share, num_threads=threads)
        rollout.build(RolloutReplica, cfg)
        teacher_scorer = None
        if teacher:  # the reference's machinery on the teacher's weights, rows split across its ranks the same way
            teachers = launcher.group(ReferenceActor, "teacher", *pgs["reference"], share=share, num_threads=threads,
                                      world=sharded)
            teachers.build(_reference, cfg, per_rank=lambda i: {"rank": i, "size": workers,
                                                                "model_path": cfg.distill.teacher_model_path})
            teacher_scorer = RemoteReference(teachers)
        reward_source = None
        if reward_model:
            rm = launcher.group(RewardModelActor, "reward", *pgs["reward"], share=share, num_threads=threads)
            rm.build(_reward_model, cfg)
            reward_source = RemoteReward(rm)
        log.warning("ray: rl %s placement: %d policy rank(s), %d reference%s, %d rollout replica(s)%s, ready in %.1f s",
                    cfg.distribution.placement, workers, n_refs,
                    " (ZeRO-3 partitioned)" if sharded and n_refs else "", replicas,
                    " and a reward model" if reward_model else "", time.perf_counter() - started)
        engine = _remote_engine(cfg, launcher, pgs, policy, rollout)
        result = train_rl(cfg, sink, show_progress, engine=engine, reward_source=reward_source,
                          learner=learner, reference=reference_scorer,
                          teacher=teacher_scorer)
        if engine.collective is not None:  # after a failure the launcher kills every actor instead
            engine.collective.close()
        return result


def _remote_engine(cfg: Any, launcher: Launcher, pgs: dict[str, Any], policy: ActorGroup,
                   rollout: ActorGroup) -> RemoteRollout:
    """The controller's engine over the replicas: how weights reach them (``rl.distribution.weight_sync``, the
    collective group opened here when it is that) and whether they free their weights between phases
    (``rl.rollout.sleep``)."""
    path = resolve_path(WeightSync(cfg.distribution.weight_sync), gpus=launcher.use_gpus,
                        colocated=cfg.distribution.placement == "colocated",
                        lora=bool(cfg.lora_rank), engine=cfg.rollout.engine)
    collective = None
    if path is SyncPath.COLLECTIVE:
        (policy_pg, policy_bundles), (rollout_pg, rollout_bundles) = pgs["policy"], pgs["rollout"]
        beside_rank0 = [i for i, b in enumerate(rollout_bundles)
                        if launcher.use_gpus and rollout_pg is policy_pg and b == list(policy_bundles)[0]]
        collective = _open_weight_sync(cfg, policy, rollout, beside_rank0)
    return RemoteRollout(rollout, load_tokenizer(cfg.model_path).pad_token_id, cfg.rollout.engine,
                         collective=collective,
                         beside_ranks=path is SyncPath.BESIDE and cfg.distribution.rollout_workers == cfg.num_workers,
                         sleeps=resolve_rollout_sleep(cfg, launcher.use_gpus))
