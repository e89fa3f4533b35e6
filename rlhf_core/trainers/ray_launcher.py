"""The one Ray boundary: actor classes, the actor-group helper, placement groups, and two launchers.

Everything Ray-specific lives here; the trainers and roles it hosts (:mod:`rlhf_core.trainers`,
:mod:`rlhf_core.trainers.rl_roles`) run the same in a plain process. Two entry points:

* :func:`train_data_parallel`: N ranks of any trainer (SFT, DPO, KTO, reward model, distill)
  as :class:`TrainerActor` s forming one ``torch.distributed`` world (gloo on CPU, NCCL on GPU);
  each rank runs the trainer function, rank 0's metrics stream back to the caller's sink.
  ``alignflow sft --set num_workers=2``.
* :func:`train_rl_on_ray`: online RL with this process as the single controller
  (:func:`rlhf_core.trainers.rl.train_rl`) and the models in actors: the policy learner as N
  data-parallel ranks, reference scorers, rollout engines and (for ``reward_kind: model``) a
  reward model. ``alignflow rl --set placement=colocated --set num_workers=2``.

Placement groups are made only by :class:`Launcher`. *Colocated*: one bundle per policy rank and
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

The cluster: :func:`connect` attaches to the one ``RAY_ADDRESS`` names (``ray start --head``
on the head node; see README "Scale out with Ray"), or starts a local instance.
"""

from __future__ import annotations

import logging
import math
import os
import socket
import time
from dataclasses import dataclass, replace
from contextlib import contextmanager
from typing import Any, Callable, Iterator, Sequence

import ray
import torch
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from rlhf_core.common.offline import NO_MULTICAST_ENV, OFFLINE_ENV, STACK_DUMP_ENV
from rlhf_core.models.layer_compile import BACKEND_ENV as COMPILE_BACKEND_ENV

log = logging.getLogger(__name__)

# How long a rank waits in a collective for a peer that stopped answering (gloo's and NCCL's own
# default is 30 minutes). A peer that *died* is noticed sooner: Ray reports the dead actor and
# gather() below tears the group down within seconds. Long enough for a 7B checkpoint gather.
COLLECTIVE_TIMEOUT_ENV = "ALIGNFLOW_COLLECTIVE_TIMEOUT_S"
_DEFAULT_COLLECTIVE_TIMEOUT_S = 600.0
# NVLink multicast off in every actor unless the user sets these (rlhf_core.common.offline.NO_MULTICAST_ENV says why).
_NO_MULTICAST = NO_MULTICAST_ENV
# Test hooks (rlhf_core.trainers.loop.inject_fault) reach the actors through their runtime env.
# Test and diagnostic hooks each actor inherits from the driver's environment (rlhf_core.common.offline.STACK_DUMP_ENV:
# periodic stack dumps of a run that hangs; rlhf_core.models.layer_compile.BACKEND_ENV: the compiled layers' backend).
_FAULT_ENV = ("ALIGNFLOW_FAULT", "ALIGNFLOW_FAULT_RANK", "ALIGNFLOW_FAULT_SIGNAL", COLLECTIVE_TIMEOUT_ENV,
              STACK_DUMP_ENV, COMPILE_BACKEND_ENV)


class RankFailed(RuntimeError):
    """An actor of a group died or raised; the group was torn down (a retry starts fresh ones)."""


def collective_timeout_s() -> float:
    value = os.environ.get(COLLECTIVE_TIMEOUT_ENV, "")
    try:
        return float(value) if value else _DEFAULT_COLLECTIVE_TIMEOUT_S
    except ValueError:
        raise ValueError(f"{COLLECTIVE_TIMEOUT_ENV}={value!r} is not a number of seconds") from None


def gather(refs: Sequence[Any], what: str, on_wait: Callable[[], None] | None = None,
           fetch_first: bool = True) -> list[Any]:
    """``ray.get(refs)``, but the first failure raises at once instead of after every other ref finished.

    Plain ``ray.get`` of a list waits in list order: with rank 1 dead and rank 0 blocked in a
    collective waiting for it, it would wait out the collective's timeout. ``on_wait`` runs between
    polls (the metric queue's drain). ``fetch_first=False`` leaves ``refs[0]``'s value in the object
    store (a rank's weights headed for other actors) and returns the ref itself in its place.
    """
    results: dict[int, Any] = {}
    index = {ref: i for i, ref in enumerate(refs)}
    pending = list(refs)
    while pending:
        ready, pending = ray.wait(pending, num_returns=len(pending), timeout=0.5)
        for ref in ready:
            i = index[ref]
            if i == 0 and not fetch_first:
                results[i] = ref
                continue
            try:
                results[i] = ray.get(ref)
            except ray.exceptions.RayTaskError:
                raise  # a rank's own error, an instance of its class: a permanent one stays permanent
            except Exception as exc:  # noqa: BLE001 - the actor died (or Ray lost it): retryable
                raise RankFailed(f"ray: {what} failed: {type(exc).__name__}: {exc}") from exc
        if on_wait is not None:
            on_wait()
    return [results[i] for i in range(len(refs))]


# --------------------------------------------------------------------------------------
# The cluster
# --------------------------------------------------------------------------------------


def worker_env() -> dict[str, str]:
    """The environment every Ray worker starts with: the offline switches, NVLink multicast off (unless the
    driver's environment says otherwise), and ``ALIGNFLOW_RELEASE_MEMORY=1`` (a worker may share its GPU with
    colocated roles: :func:`rlhf_core.trainers.rl_roles.release_memory` hands the allocator's cache back
    between phases; the driver's own setting wins)."""
    return {**OFFLINE_ENV, **{k: os.environ.get(k, v) for k, v in _NO_MULTICAST.items()},
            "ALIGNFLOW_RELEASE_MEMORY": os.environ.get("ALIGNFLOW_RELEASE_MEMORY", "1")}


def connect(min_cpus: float = 0.0) -> str:
    """Attach to the cluster ``RAY_ADDRESS`` names, or start a local one; returns the GCS address.

    A local instance gets at least ``min_cpus`` logical CPUs (bundles are scheduling units; on a
    small laptop several roles time-share its cores). Workers inherit the offline switches.
    """
    if not ray.is_initialized():
        address = os.environ.get("RAY_ADDRESS") or None
        env = worker_env()
        kwargs: dict[str, Any] = {"runtime_env": {"env_vars": env}, "log_to_driver": True,
                                  "logging_level": logging.WARNING}
        if address is None:
            kwargs.update(num_cpus=max(os.cpu_count() or 1, math.ceil(min_cpus)), include_dashboard=False)
        # "local": a new instance, never whatever cluster /tmp/ray/ray_current_cluster last named
        # (plain ray.init() would join it, or fail on a stale entry left by a killed head)
        ray.init(address=address or "local", **kwargs)
        log.warning("ray: %s cluster at %s", "attached to" if address else "started a local",
                    ray.get_runtime_context().gcs_address)
    return ray.get_runtime_context().gcs_address


def cluster_has_gpus() -> bool:
    return ray.cluster_resources().get("GPU", 0) >= 1


# --------------------------------------------------------------------------------------
# Actors: one generic host, one named class per role (so Ray's listings say what runs where)
# --------------------------------------------------------------------------------------


class _Worker:
    """Hosts one role object (or runs one trainer function) in an actor; optionally a rank of a world."""

    def __init__(self, cwd: str, num_threads: int):
        if os.path.isdir(cwd):  # relative paths in configs mean the driver's directory (same machine/NFS)
            os.chdir(cwd)
        torch.set_num_threads(num_threads)
        self.role: Any = None

    def rendezvous(self) -> tuple[str, int]:
        """This node's address and a free port, for rank 0 of a world."""
        with socket.socket() as s:
            s.bind(("", 0))
            port = s.getsockname()[1]
        return ray.util.get_node_ip_address(), port

    def join_world(self, addr: str, port: int, rank: int, size: int, timeout_s: float) -> int:
        """``torch.distributed.init_process_group``: NCCL when this actor has a GPU, else gloo; a
        collective waits at most ``timeout_s`` for its peers."""
        import datetime

        import torch.distributed as dist

        backend = "nccl" if torch.cuda.is_available() else "gloo"
        # What torchrun would set; DeepSpeed reads them. Ray shows each actor only its own GPU(s),
        # so the local device is always 0.
        os.environ.update(MASTER_ADDR=addr, MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(size),
                          LOCAL_RANK="0")
        if backend == "nccl":
            torch.cuda.set_device(0)  # Ray exposes this actor's GPU(s) as CUDA_VISIBLE_DEVICES
        dist.init_process_group(backend, init_method=f"tcp://{addr}:{port}", rank=rank, world_size=size,
                                timeout=datetime.timedelta(seconds=timeout_s))
        return os.getpid()

    def build(self, factory: Callable[..., Any], *args: Any, **kwargs: Any) -> int:
        self.role = factory(*args, **kwargs)
        return os.getpid()

    def call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        return getattr(self.role, method)(*args, **kwargs)

    def run(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        return fn(*args, **kwargs)

    def leave_world(self) -> None:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
        if hasattr(self.role, "close"):
            self.role.close()


@ray.remote
class TrainerActor(_Worker):
    """A data-parallel rank: of an offline trainer, or of the RL policy learner (policy + critic)."""


@ray.remote
class ReferenceActor(_Worker):
    """A frozen reference model scoring its share of rollout rows."""


@ray.remote
class RolloutActor(_Worker):
    """A rollout engine replica (HF generate or vLLM) on its own copy of the policy."""


@ray.remote
class RewardModelActor(_Worker):
    """A reward model scoring (prompt, completion) pairs."""


class ActorGroup:
    """``n`` actors of one class, one per placement-group bundle; optionally one torch.distributed world."""

    def __init__(self, actor_cls: Any, name: str, pg: PlacementGroup, bundles: Sequence[int], *, num_cpus: float,
                 num_gpus: float, num_threads: int, world: bool):
        self.name = name
        hooks = {k: os.environ[k] for k in _FAULT_ENV if k in os.environ}
        self.actors = [actor_cls.options(
            num_cpus=num_cpus, num_gpus=num_gpus,
            scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=b),
            **({"runtime_env": {"env_vars": hooks}} if hooks else {}),
        ).remote(os.getcwd(), num_threads) for b in bundles]
        if world and len(self.actors) > 1:
            addr, port = ray.get(self.actors[0].rendezvous.remote())
            timeout = collective_timeout_s()
            gather([a.join_world.remote(addr, port, i, len(self.actors), timeout) for i, a in enumerate(self.actors)],
                   f"{name} joining its world")

    def __len__(self) -> int:
        return len(self.actors)

    def build(self, factory: Callable[..., Any], *args: Any, per_rank: Callable[[int], dict] | None = None,
              **kwargs: Any) -> None:
        gather([a.build.remote(factory, *args, **kwargs, **(per_rank(i) if per_rank else {}))
                for i, a in enumerate(self.actors)], f"{self.name} start")

    def call_all(self, method: str, *args: Any, **kwargs: Any) -> list[Any]:
        """``role.method(*args)`` on every actor (same arguments), results in rank order; the first
        actor to fail fails the call (:func:`gather`)."""
        return gather([a.call.remote(method, *args, **kwargs) for a in self.actors], f"{self.name}.{method}")

    def run_all(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> list[Any]:
        return [a.run.remote(fn, *args, **kwargs) for a in self.actors]

    def shutdown(self, clean: bool = True) -> None:
        """Leave the world and stop the actors; after a failure (``clean=False``) kill them at once: a
        survivor blocked in a collective would not answer ``leave_world`` before its timeout."""
        if clean:
            started = time.perf_counter()
            try:
                ray.get([a.leave_world.remote() for a in self.actors], timeout=60)
            except Exception as exc:  # noqa: BLE001 - best effort: the actors are killed next either way
                log.warning("ray: %s did not leave cleanly: %s", self.name, exc)
            took = time.perf_counter() - started
            if took > 5:  # a slow exit is a teardown that waits on a peer: say which group
                log.warning("ray: %s took %.1f s to leave", self.name, took)
        for a in self.actors:
            ray.kill(a, no_restart=True)


# --------------------------------------------------------------------------------------
# Placement: the only place placement groups are made
# --------------------------------------------------------------------------------------


class Launcher:
    """Creates placement groups and actor groups for one run, and removes them at the end."""

    def __init__(self, use_gpus: bool):
        self.use_gpus = use_gpus
        self.groups: list[ActorGroup] = []
        self.pgs: list[PlacementGroup] = []

    def bundles(self, n: int) -> PlacementGroup:
        """``n`` bundles of one CPU (and one GPU when the cluster has them), packed on few nodes."""
        bundle = {"CPU": 1.0, **({"GPU": 1.0} if self.use_gpus else {})}
        pg = placement_group([dict(bundle) for _ in range(n)], strategy="PACK")
        ray.get(pg.ready(), timeout=300)
        self.pgs.append(pg)
        return pg

    def group(self, actor_cls: Any, name: str, pg: PlacementGroup, bundles: Sequence[int], *, share: float,
              num_threads: int, world: bool = False) -> ActorGroup:
        g = ActorGroup(actor_cls, name, pg, bundles, num_cpus=share, num_gpus=share if self.use_gpus else 0,
                       num_threads=num_threads, world=world)
        self.groups.append(g)
        return g

    def shutdown(self, clean: bool = True) -> None:
        for g in reversed(self.groups):
            g.shutdown(clean)
        for pg in self.pgs:
            remove_placement_group(pg)

    @contextmanager
    def running(self) -> Iterator["Launcher"]:
        """Shut everything down on the way out: cleanly after success, by killing after a failure."""
        try:
            yield self
        except BaseException:
            self.shutdown(clean=False)
            raise
        self.shutdown(clean=True)


# --------------------------------------------------------------------------------------
# Offline trainers: N data-parallel ranks, metrics streamed to the caller's sink
# --------------------------------------------------------------------------------------


class _QueueSink:
    """A rank-0 sink that forwards metrics to the driver through a Ray queue."""

    def __init__(self, queue: Any):
        self.queue = queue

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        self.queue.put((dict(metrics), step))


def _run_rank(train_fn: Callable[..., Any], cfg: Any, queue: Any, show_progress: bool) -> Any:
    from rlhf_core.distributed.parallel import current_world

    sink = _QueueSink(queue) if current_world().is_main else None
    return train_fn(cfg, sink=sink, show_progress=show_progress and current_world().is_main)


def train_data_parallel(train_fn: Callable[..., Any], cfg: Any, sink: Any = None, show_progress: bool = True) -> Any:
    """Run ``train_fn(cfg)`` on ``cfg.num_workers`` Ray actors forming one data-parallel world.

    Returns rank 0's result (the output directory and metrics); rank 0's metrics reach ``sink``
    while the run goes. Same global batch as one worker (see :mod:`rlhf_core.distributed.parallel`).
    """
    from ray.util.queue import Queue

    connect(min_cpus=cfg.num_workers)
    queue = Queue()
    try:
        with Launcher(cluster_has_gpus()).running() as launcher:
            pg = launcher.bundles(cfg.num_workers)
            group = launcher.group(TrainerActor, "trainer", pg, range(cfg.num_workers), share=1.0,
                                   num_threads=cfg.num_threads, world=True)
            refs = group.run_all(_run_rank, train_fn, cfg, queue, show_progress)
            results = gather(refs, "a training rank", on_wait=lambda: _drain(queue, sink))
            _drain(queue, sink)
            return results[0]
    finally:
        queue.shutdown()


def _drain(queue: Any, sink: Any) -> None:
    while not queue.empty():
        metrics, step = queue.get()
        if sink is not None:
            sink.log_metrics(metrics, step)


# --------------------------------------------------------------------------------------
# Online RL: the controller here, the models in actors
# --------------------------------------------------------------------------------------


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
        from rlhf_core.models.loading import load_causal_lm, prepare_for_training

        self.group, self.cfg = group, cfg
        # A CPU copy of the policy for evaluation and saving, refreshed from rank 0 on demand. A LoRA policy's is
        # what the ranks hold, the frozen base (in their dtype) with adapters injected, and a refresh fetches the
        # adapters alone, as the replicas' syncs do: a 32B policy's merged weights were 65.5 GB gathered whole on
        # every GPU beside its shard (more than a GPU holding a replica has), one 65.5 GB Ray object and a
        # 131 GB fp32 copy here, for ~0.3 GB of adapters (BENCHMARKS.md, issue 22's plan).
        self.adapters_only = bool(cfg.lora_rank)
        dtype = getattr(torch, group.call_all("base_dtype")[0]) if self.adapters_only else torch.float32
        self.policy = load_causal_lm(cfg.model_path, torch.device("cpu"), dtype)
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
            if self.cfg.parallel == "zero3" and not self.cfg.lora_rank and self.cfg.rollout_engine != "vllm":
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
            from rlhf_core.models.loading import adapter_parameters, copy_adapters

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
        from rlhf_core.distributed.parallel import assign_weights

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


def replicas_hold_adapters(cfg: Any) -> bool:
    """Whether rollout replicas hold a LoRA policy as the learner does, the frozen base with adapters injected,
    so each sync sends the adapters alone (the static and HF engines sample through them; vLLM takes merged
    weights). Without this a 32B LoRA policy's sync was its whole merged model, 65.5 GB through the object
    store, for ~0.3 GB of adapters (BENCHMARKS.md, issue 22's memory plan)."""
    return bool(cfg.lora_rank) and cfg.rollout_engine != "vllm"


def resolve_rollout_sleep(cfg: Any, gpus: bool) -> bool:
    """``rl.rollout_sleep`` for this run: ``on`` as configured (the config checked it can work), ``auto`` on GPUs
    where it can (colocated replicas sharing a GPU with the learner, synchronous, hf or static engine, whole-weight
    syncs); off on CPUs, where the replica's weights are host memory and nothing is gained."""
    if cfg.rollout_sleep != "auto":
        return cfg.rollout_sleep == "on"
    return (gpus and cfg.placement == "colocated" and cfg.rollout_engine in ("hf", "static") and not cfg.lora_rank
            and not cfg.max_staleness)


def _engine_dtype(cfg: Any) -> torch.dtype | None:
    """The dtype rollout replicas hold their weights in (the compute dtype; ``None``: the policy's own)."""
    from rlhf_core.models.loading import pick_device
    from rlhf_core.models.precision import Precision

    return Precision.resolve(cfg.precision, pick_device()).compute_dtype


@dataclass
class CollectiveSync:
    """``rl.weight_sync`` collective (:mod:`rlhf_core.distributed.weight_sync`): policy rank 0 and ``replicas`` form a group
    of their own. Per sync every learner rank walks the buckets (ZeRO-3: each gathered by all of them), rank 0
    broadcasts each, and the replicas receive it into their engines; the first actor to fail fails the sync."""

    learners: ActorGroup
    replicas: list[Any]

    def run(self) -> None:
        refs = [a.call.remote("broadcast_weights") for a in self.learners.actors]
        gather(refs + [r.call.remote("receive_weights") for r in self.replicas], "weight sync (collective)")

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
        self.sleeps = sleeps  # rl.rollout_sleep resolved (:func:`resolve_rollout_sleep`)
        self._said_freed = False

    def release_weights(self) -> int:
        """rl.rollout_sleep: every replica frees its weights until the next sync (:meth:`RolloutReplica.release_weights`);
        returns the bytes freed over all replicas (0 when the replicas keep their weights)."""
        if not self.sleeps:
            return 0
        freed = sum(self.group.call_all("release_weights"))
        if not self._said_freed:
            log.warning("ray: rollout replicas free %.1f MB of weights each between a rollout and the weight sync "
                        "(rl.rollout_sleep)", freed / len(self.group) / 2**20)
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
        from rlhf_core.trainers.rl import _concat

        k = min(len(self.group), len(rows))
        size = -(-len(rows) // k)
        refs = []
        for i, start in enumerate(range(0, len(rows), size)):
            args = (rows[start:start + size],) + (() if labels is None else (labels[start:start + size],))
            seeded = replace(params, seed=None if params.seed is None else params.seed + i)
            refs.append(self.group.actors[i].call.remote(method, args[0], seeded, *args[1:]))
        return _concat(gather(refs, "rollout"), self.pad_id)

    def update_weights(self, weights: Any) -> None:
        """Push weights (a Ray object reference, fetched once per node, a state dict, or one CUDA IPC
        payload per replica) to every replica, or broadcast them through the weight-sync group."""
        if isinstance(weights, CollectiveSync):
            weights.run()
            return
        if isinstance(weights, PerReplica):
            gather([a.call.remote("update_weights", w) for a, w in zip(self.group.actors, weights)], "weight sync")
            return
        if isinstance(weights, ZeroBuckets):  # rank i's staging buffer -> replica i, a bucket at a time
            for index in range(weights.count):
                payloads = weights.learners.call_all("share_bucket", index, weights.dtype)
                gather([a.call.remote("load_bucket", p) for a, p in zip(self.group.actors, payloads)],
                       f"weight sync bucket {index}")
            return
        self.group.call_all("update_weights", weights)


class RemoteReward:
    """A :class:`rlhf_core.rewards.sources.RewardSource` served by a reward-model actor."""

    def __init__(self, group: ActorGroup):
        self.group = group

    def __call__(self, prompts: Sequence[str], completions: Sequence[str], labels: Sequence[str | None]) -> list[float]:
        return gather([self.group.actors[0].call.remote("__call__", list(prompts), list(completions), list(labels))],
                      "reward model")[0]


class RolloutReplica:
    """A rollout engine on its own copy of the starting policy (built inside the actor).

    With mixed precision the copy is held in the compute dtype (bf16) only: it exists to sample,
    and the learner sends its weights already cast (half the bytes of fp32).
    """

    def __init__(self, cfg: Any):
        from rlhf_core.models.loading import load_causal_lm, load_tokenizer, pick_device, prepare_for_training
        from rlhf_core.models.precision import Precision
        from rlhf_core.trainers.rl import build_rollout_engine

        device = pick_device()
        self.dtype = Precision.resolve(cfg.precision, device).compute_dtype
        # loaded in the compute dtype directly: parameters bf16, buffers (RoPE's inv_freq) fp32, as the learner's
        policy = load_causal_lm(cfg.model_path, device, self.dtype or torch.float32)
        if replicas_hold_adapters(cfg):  # the learner's adapter layout: each sync sends the adapters alone
            prepare_for_training(policy, lora_rank=cfg.lora_rank, lora_alpha=cfg.lora_alpha,
                                 lora_dropout=cfg.lora_dropout)
        policy.eval().requires_grad_(False)
        self.engine = build_rollout_engine(cfg, policy, load_tokenizer(cfg.model_path), self.dtype)
        self._released: dict[str, torch.Size] | None = None  # rl.rollout_sleep: the shapes of released weights
        self._filled: set[str] = set()

    def generate(self, prompts: Sequence[str], params: Any) -> Any:
        from rlhf_core.trainers.rl_roles import release_memory

        self._check_awake()
        batch = self.engine.generate(prompts, params)
        release_memory()  # colocated: the KV cache's blocks go back before the learner's phase
        return batch

    def generate_ids(self, encoded: Sequence[list[int]], params: Any, prompts: Sequence[str]) -> Any:
        from rlhf_core.trainers.rl_roles import release_memory

        self._check_awake()
        batch = self.engine.generate_ids(encoded, params, prompts)
        release_memory()
        return batch

    # ---- rl.rollout_sleep: the weights' memory handed back between a rollout and the next sync ------
    #
    # vLLM's sleep mode (level 2) for our engines: a colocated replica's copy of the policy is needed only
    # while it generates, and the sync after every update overwrites all of it, so between the two it is
    # freed (a 7B policy: 15.2 GB of each GPU during the reference, old log-prob and update phases). A
    # parameter keeps its Parameter object, shape and dtype (the engine's modules, the weight-bucket maps
    # and the sync's layout stay valid) but holds an empty tensor until :meth:`_wake` gives it storage again.

    def release_weights(self) -> int:
        """Free the engine's weights (buffers such as RoPE tables stay); returns the bytes freed. A sync must
        refill every one before the next :meth:`generate`."""
        from rlhf_core.distributed.parallel import resident_weight_bytes
        from rlhf_core.trainers.rl_roles import release_memory

        model = self.engine.model
        if getattr(self.engine, "sampler", None) is not None:
            raise RuntimeError("rollout replica: rl.rollout_sleep cannot release a replica that samples through a "
                               "copy of its weights in another dtype")
        if self._released is not None:
            return 0
        freed = resident_weight_bytes(model)
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
            raise RuntimeError("rollout replica: its weights were released after the last rollout (rl.rollout_sleep) "
                               "and no weight sync has refilled them since")

    def update_weights(self, weights: Any) -> None:
        self._wake()
        if isinstance(weights, dict) and "cuda_ipc" in weights:  # a rank's buffer on this GPU
            if getattr(self, "_shared", None) is None:  # map it once; the rank refills it in place
                rebuild, args = weights["cuda_ipc"]
                self._shared = rebuild(*args)
            flat = self._shared
            weights = {name: flat[offset:offset + _numel(shape)].view(shape)
                       for name, shape, offset in weights["layout"]}
        self.engine.update_weights(weights)
        # a whole state dict (the engine's load is strict) or a model: every released weight was written
        self._filled_by_sync(self._released or (), last=True)

    def load_bucket(self, payload: dict[str, Any]) -> None:
        """One bucket of a ZeRO-3 sync (:class:`ZeroBuckets`) from the staging buffer of the rank on this GPU into
        the engine's model, in place (captured CUDA graphs stay valid); the last one refreshes a sampling copy."""
        if getattr(self, "_staging", None) is None:  # map it once; the rank refills it in place
            rebuild, args = payload["cuda_ipc"]
            self._staging = rebuild(*args)
            self._params = dict(self.engine.model.named_parameters())
        self._wake()
        flat = self._staging
        with torch.no_grad():
            for name, shape, offset in payload["layout"]:
                self._params[name].copy_(flat[offset:offset + _numel(shape)].view(shape))
        torch.cuda.synchronize()  # the rank refills the buffer for the next bucket after this returns
        self._filled_by_sync([name for name, _, _ in payload["layout"]], payload["last"])
        if payload["last"] and getattr(self.engine, "sampler", None) is not None:
            self.engine.update_weights(self.engine.model)

    # ---- rl.weight_sync collective: a receiver of the weight-sync group (rlhf_core.distributed.weight_sync) ------

    def join_weight_sync(self, addr: str, port: int, rank: int, size: int, timeout_s: float, layout: Any) -> None:
        """Rank ``rank`` (>= 1) of the weight-sync group. The layout must name every parameter of the engine's
        model, in the dtype it holds them (a mismatch would leave weights stale without a word)."""
        from rlhf_core.models.loading import pick_device
        from rlhf_core.distributed.weight_sync import SyncGroup

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

    def receive_weights(self) -> None:
        """One sync: each bucket broadcast from policy rank 0 into the flat buffers, handed to the engine as
        named views (:class:`rlhf_core.rollout.engine.LoadsWeightBuckets`: copied in place), or, for an engine without
        that seam, gathered into one state dict for its ``update_weights``."""
        from rlhf_core.rollout.engine import LoadsWeightBuckets
        from rlhf_core.distributed.weight_sync import bucket_views, unflatten_bucket

        group, layout = self._sync_group, self._sync_layout
        whole: dict[str, torch.Tensor] = {}
        self._wake()
        for i, bucket in enumerate(layout):
            flats = bucket_views(bucket, group.buffers)
            group.broadcast(flats)
            named = unflatten_bucket(flats, bucket)
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

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The weights the engine samples from, on the CPU (a check that a sync arrived; vLLM's are in its workers)."""
        return {k: v.detach().cpu().clone() for k, v in self.engine.model.state_dict().items()}

    def leave_weight_sync(self) -> None:
        """Close this replica's side of the weight-sync group (once; see :meth:`CollectiveSync.close`)."""
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


def _reward_model(cfg: Any) -> Any:
    from rlhf_core.models.loading import pick_device
    from rlhf_core.rewards.sources import build_reward_source

    return build_reward_source("model", path=cfg.reward_model_path, device=pick_device(), batch_size=cfg.batch_size)


def _reference(cfg: Any, rank: int, size: int, model_path: str | None = None) -> Any:
    from rlhf_core.distributed.parallel import World
    from rlhf_core.trainers.rl_roles import ReferenceScorer

    return ReferenceScorer(cfg, world=World(rank, size), model_path=model_path)


def _learner(cfg: Any) -> Any:
    from rlhf_core.trainers.loop import seed_everything
    from rlhf_core.trainers.rl_roles import PolicyLearner

    # a LoRA policy's adapters start random (peft's A); seeded, every run of a config starts from the same ones,
    # as one process does (train_rl seeds before it builds the learner)
    seed_everything(cfg.seed)
    return PolicyLearner(cfg)


def _open_weight_sync(cfg: Any, policy: ActorGroup, rollout: ActorGroup, beside_rank0: Sequence[int]) -> CollectiveSync:
    """``rl.weight_sync`` collective: the buckets planned on every learner rank, then policy rank 0 (group rank
    0, hosting the group's store) and every replica (ranks 1..) join a group of their own."""
    if beside_rank0:
        raise ValueError(f"rl.weight_sync collective: rollout replica(s) {list(beside_rank0)} share policy rank 0's "
                         f"GPU (colocated placement), and NCCL cannot put two ranks of one group on one GPU; use "
                         f"weight_sync auto (CUDA IPC to colocated replicas) or placement disaggregated")
    layout = policy.call_all("sync_layout", SYNC_BUCKET_BYTES, _engine_dtype(cfg))[0]
    addr, port = ray.get(policy.actors[0].rendezvous.remote())
    size, timeout = len(rollout) + 1, collective_timeout_s()
    refs = [policy.actors[0].call.remote("join_weight_sync", addr, port, size, timeout)]
    refs += [a.call.remote("join_weight_sync", addr, port, i + 1, size, timeout, layout)
             for i, a in enumerate(rollout.actors)]
    gather(refs, "weight sync group")
    log.warning("ray: weight sync through a %s group of policy rank 0 and %d replica(s), %d bucket(s)",
                "nccl" if cluster_has_gpus() else "gloo", len(rollout), len(layout))
    return CollectiveSync(policy, list(rollout.actors))


def train_rl_on_ray(cfg: Any, sink: Any = None, show_progress: bool = True) -> Any:
    """:func:`rlhf_core.trainers.rl.train_rl` with its models in Ray actors placed as ``cfg.placement`` says."""
    from rlhf_core.config.choices import AdvantageEstimator
    from rlhf_core.trainers.rl import train_rl
    from rlhf_core.trainers.rl_roles import BaseReference, base_is_reference, reference_sharded

    if cfg.placement not in ("colocated", "disaggregated"):
        raise ValueError(f"rl.placement must be colocated or disaggregated to run on Ray, got {cfg.placement!r}")
    workers, replicas = cfg.num_workers, cfg.rollout_workers
    reward_model = cfg.reward_kind == "model"
    teacher = AdvantageEstimator(cfg.estimator).needs_teacher  # on-policy distillation: teacher ranks beside the references
    colocated = cfg.placement == "colocated"
    # a reference rank beside each policy rank, in either placement (module docstring); none where a LoRA
    # policy's frozen base is the reference (the policy ranks score it with their adapters off)
    base_ref = base_is_reference(cfg)
    n_refs = 0 if base_ref else workers
    sharded = reference_sharded(cfg)  # ZeRO-3: reference and teacher ranks each form a world and partition
    bundles = workers if colocated else workers + replicas
    connect(min_cpus=bundles)
    launcher = Launcher(cluster_has_gpus())
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
                                                                "model_path": cfg.teacher_model_path})
            teacher_scorer = RemoteReference(teachers)
        reward_source = None
        if reward_model:
            rm = launcher.group(RewardModelActor, "reward", *pgs["reward"], share=share, num_threads=threads)
            rm.build(_reward_model, cfg)
            reward_source = RemoteReward(rm)
        log.warning("ray: rl %s placement: %d policy rank(s), %d reference%s, %d rollout replica(s)%s, ready in %.1f s",
                    cfg.placement, workers, n_refs, " (ZeRO-3 partitioned)" if sharded and n_refs else "", replicas,
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
    """The controller's engine over the replicas: how weights reach them (``rl.weight_sync``, the collective
    group opened here when it is that) and whether they free their weights between phases (``rl.rollout_sleep``)."""
    from rlhf_core.models.loading import load_tokenizer
    from rlhf_core.distributed.weight_sync import SyncPath, WeightSync, resolve_path

    path = resolve_path(WeightSync(cfg.weight_sync), gpus=launcher.use_gpus, colocated=cfg.placement == "colocated",
                        lora=bool(cfg.lora_rank), engine=cfg.rollout_engine)
    collective = None
    if path is SyncPath.COLLECTIVE:
        (policy_pg, policy_bundles), (rollout_pg, rollout_bundles) = pgs["policy"], pgs["rollout"]
        beside_rank0 = [i for i, b in enumerate(rollout_bundles)
                        if launcher.use_gpus and rollout_pg is policy_pg and b == list(policy_bundles)[0]]
        collective = _open_weight_sync(cfg, policy, rollout, beside_rank0)
    return RemoteRollout(rollout, load_tokenizer(cfg.model_path).pad_token_id, cfg.rollout_engine,
                         collective=collective,
                         beside_ranks=path is SyncPath.BESIDE and cfg.rollout_workers == cfg.num_workers,
                         sleeps=resolve_rollout_sleep(cfg, launcher.use_gpus))
