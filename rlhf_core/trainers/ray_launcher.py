"""The one Ray boundary: actor classes, the actor-group helper, placement groups, the cluster, and the
data-parallel launcher.

Everything that makes actors and placement groups lives here; the trainers and roles it hosts
(:mod:`rlhf_core.trainers`, :mod:`rlhf_core.trainers.rl_roles`) run the same in a plain process. Two entry points:

* :func:`train_data_parallel` (here): N ranks of any offline trainer
  as :class:`TrainerActor` s forming one ``torch.distributed`` world (gloo on CPU, NCCL on GPU);
  each rank runs the trainer function, rank 0's metrics stream back to the caller's sink.
  ``alignflow sft --set num_workers=2``.
* :func:`rlhf_core.trainers.rl_on_ray.train_rl_on_ray`: online RL with the controller in this process and
  the models in actor groups made here (that module says how the roles are placed).
  ``alignflow rl --set placement=colocated --set num_workers=2``.

Placement groups are made only by :class:`Launcher`.

The cluster: :func:`connect` attaches to the one ``RAY_ADDRESS`` names (``ray start --head``
on the head node; see README "Scale out with Ray"), or starts a local instance.
"""


from __future__ import annotations

import logging
import math
import os
import socket
import time
from contextlib import contextmanager
from typing import Any, Callable, Iterator, Sequence

import ray
import torch
import torch.distributed as dist
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.queue import Queue
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from rlhf_core.common.offline import NO_MULTICAST_ENV, arm_stack_dumps, child_env
from rlhf_core.distributed.parallel import current_world, join_world
from rlhf_core.trainers import rl_forward

log = logging.getLogger(__name__)

# NVLink multicast off in every actor unless the user sets these (rlhf_core.common.offline.NO_MULTICAST_ENV says why).
_NO_MULTICAST = NO_MULTICAST_ENV
# Test hooks (rlhf_core.common.faults) reach the actors through their runtime env.
_FAULT_ENV = ("ALIGNFLOW_FAULT", "ALIGNFLOW_FAULT_RANK", "ALIGNFLOW_FAULT_SIGNAL")


class RankFailed(RuntimeError):
    """An actor of a group died or raised; the group was torn down (a retry starts fresh ones)."""


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
    """The environment every Ray worker starts with: the offline switches, and NVLink multicast and the math
    libraries' dynamic threading off (unless the driver's environment says otherwise)."""
    return {**child_env(), **{k: os.environ.get(k, v) for k, v in _NO_MULTICAST.items()}}


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
    """Hosts one role object (or runs one trainer function) in an actor; optionally a rank of a world.

    ``stack_dump_s``: the run's periodic stack dumps (:func:`rlhf_core.common.offline.arm_stack_dumps`).
    ``release_memory``: whether this process hands the CUDA allocator's cache back between RL phases
    (:data:`rlhf_core.trainers.rl_forward.RELEASE_MEMORY`; an actor may share its GPU with colocated roles)."""

    def __init__(self, cwd: str, num_threads: int, stack_dump_s: float, release_memory: bool):
        if os.path.isdir(cwd):  # relative paths in configs mean the driver's directory (same machine/NFS)
            os.chdir(cwd)
        torch.set_num_threads(num_threads)
        arm_stack_dumps(stack_dump_s)
        rl_forward.RELEASE_MEMORY = release_memory
        self.role: Any = None

    def rendezvous(self) -> tuple[str, int]:
        """This node's address and a free port, for rank 0 of a world."""
        with socket.socket() as s:
            s.bind(("", 0))
            port = s.getsockname()[1]
        return ray.util.get_node_ip_address(), port

    def join_world(self, addr: str, port: int, rank: int, size: int, timeout_s: float) -> int:
        """Rank ``rank`` of a world of ``size`` (:func:`rlhf_core.distributed.parallel.join_world`); a collective
        waits at most ``timeout_s`` for its peers."""
        join_world(addr, port, rank, size, timeout_s)
        return os.getpid()

    def build(self, factory: Callable[..., Any], *args: Any, **kwargs: Any) -> int:
        self.role = factory(*args, **kwargs)
        return os.getpid()

    def call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        return getattr(self.role, method)(*args, **kwargs)

    def run(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        return fn(*args, **kwargs)

    def leave_world(self) -> None:
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
    """``n`` actors of one class, one per placement-group bundle; optionally one torch.distributed world whose
    collectives wait ``launcher.collective_timeout_s`` for a peer."""

    def __init__(self, actor_cls: Any, name: str, pg: PlacementGroup, bundles: Sequence[int], *, num_cpus: float,
                 num_gpus: float, num_threads: int, world: bool, launcher: "Launcher"):
        self.name = name
        hooks = {k: os.environ[k] for k in _FAULT_ENV if k in os.environ}
        self.actors = [actor_cls.options(
            num_cpus=num_cpus, num_gpus=num_gpus,
            scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=b),
            **({"runtime_env": {"env_vars": hooks}} if hooks else {}),
        ).remote(os.getcwd(), num_threads, launcher.stack_dump_s, launcher.release_memory) for b in bundles]
        if world and len(self.actors) > 1:
            addr, port = ray.get(self.actors[0].rendezvous.remote())
            timeout = launcher.collective_timeout_s
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
    """Creates placement groups and actor groups for one run, and removes them at the end.

    From the run's config (a ``TrainerConfig``): ``collective_timeout_s``, how long a world's collectives wait for
    a peer that stopped answering (its default is long enough for a 7B checkpoint gather; a peer that *died* is
    noticed sooner: Ray reports the dead actor and :func:`gather` tears the group down within seconds), and
    ``stack_dump_s``, each actor's periodic stack dumps; :attr:`release_memory` is what every actor is started
    with."""

    release_memory = True
    """Actors hand the CUDA allocator's cache back between RL phases (they may share a GPU with colocated roles;
    a bench A/B sets this by name)."""

    def __init__(self, use_gpus: bool, cfg: Any):
        self.use_gpus = use_gpus
        self.collective_timeout_s: float = cfg.collective_timeout_s
        self.stack_dump_s: float = cfg.stack_dump_s
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
                       num_threads=num_threads, world=world, launcher=self)
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
    sink = _QueueSink(queue) if current_world().is_main else None
    return train_fn(cfg, sink=sink, show_progress=show_progress and current_world().is_main)


def train_data_parallel(train_fn: Callable[..., Any], cfg: Any, sink: Any = None, show_progress: bool = True) -> Any:
    """Run ``train_fn(cfg)`` on ``cfg.num_workers`` Ray actors forming one data-parallel world.

    Returns rank 0's result (the output directory and metrics); rank 0's metrics reach ``sink``
    while the run goes. Same global batch as one worker (see :mod:`rlhf_core.distributed.parallel`).
    """
    connect(min_cpus=cfg.num_workers)
    queue = Queue()
    try:
        with Launcher(cluster_has_gpus(), cfg).running() as launcher:
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
