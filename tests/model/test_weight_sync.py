"""``rl.distribution.weight_sync: collective`` on real Ray (local instance, CPU, gloo): policy rank 0 and the rollout
replicas
in a torch.distributed group of their own (rlhf_core/distributed/weight_sync.py). After a sync every replica holds rank 0's
weights bitwise; GRPO logs the same metrics through the collective as through the object store (same seed);
a replica that stops answering or dies fails the sync within the collective timeout instead of hanging.

NCCL on GPUs is not run here: ``bench/gpu_grpo.py --weight-sync`` measures it (its docstring has the command).
"""

from __future__ import annotations

import time

import pytest
import ray
import torch

from conftest import Recorder
from rlhf_core.config import RLConfig, build_config

_TIMEOUT_S = 10.0


def _rl(micro_model, micro_data, root, **kw) -> RLConfig:
    reward = root.parent / "length_reward.py"
    reward.write_text("def reward(prompts, completions, labels):\n    return [len(c) / 10 for c in completions]\n")
    values = {"model_path": str(micro_model), "prompts_file": str(micro_data["prompts"]),
              "eval_file": str(micro_data["eval"]), "output_dir": str(root / "rl"),
              "checkpoint_dir": str(root / "ckpt"),
              "reward.function": f"{reward}:reward", "max_steps": 2, "rollout.prompts_per_step": 4,
              "rollout.group_size": 4, "rollout.max_new_tokens": 6,
              "batch_size": 64, "algorithm.mini_batch_size": 8, "lr": 3e-3, "warmup_steps": 0, "weight_decay": 0.0,
              "eval_items": 4,
              "eval_at_start": False, "num_threads": 1, "precision": "fp32", "save_every": 0,
              "distribution.placement": "disaggregated",
              "num_workers": 2, "distribution.rollout_workers": 2, "distribution.weight_sync": "collective"}
    return build_config(RLConfig, "rl", {**{**values, **kw}})


@pytest.mark.parametrize("parallel", ["ddp", pytest.param("zero3", marks=pytest.mark.slow)])
def test_collective_sync_gives_every_replica_rank0s_weights_and_a_dead_replica_fails_it_fast(
        ray_local, micro_model, micro_data, tmp_path, monkeypatch, parallel):
    """2 policy ranks (a world of their own) and 2 replicas; the buckets are made small (4 KiB) so the micro
    model's weights take many of them, and under ZeRO-3 both ranks gather each one. Rank 0 takes new weights
    (a checkpoint's: the start plus noise), one sync later both replicas hold them bitwise. Then rank 0
    broadcasting alone (replicas idle) raises after the collective timeout (10 s here), and a sync with a
    replica killed fails at once."""
    from rlhf_core.trainers import ray_launcher as rl_ray, rl_on_ray
    from rlhf_core.trainers.ray_launcher import Launcher, RankFailed, RolloutActor, TrainerActor
    from rlhf_core.trainers.rl_on_ray import RemoteLearner, RemoteRollout
    from rlhf_core.trainers.rollout_replica import RolloutReplica

    monkeypatch.setattr(rl_on_ray, "SYNC_BUCKET_BYTES", 4096)
    cfg = _rl(micro_model, micro_data, tmp_path, parallel=parallel, collective_timeout_s=_TIMEOUT_S)
    launcher = Launcher(False, cfg)
    try:
        pg = launcher.bundles(4)
        policy = launcher.group(TrainerActor, "policy", pg, [0, 1], share=1.0, num_threads=1, world=True)
        policy.build(rl_on_ray._learner, cfg)
        rollout = launcher.group(RolloutActor, "rollout", pg, [2, 3], share=1.0, num_threads=1)
        rollout.build(RolloutReplica, cfg)
        sync = rl_on_ray._open_weight_sync(cfg, policy, rollout, [])
        learner = RemoteLearner(policy, cfg)
        engine = RemoteRollout(rollout, 0, "static", collective=sync)
        assert len(policy.call_all("sync_layout", 4096, None)[0]) > 10  # many buckets

        g, moved = torch.Generator().manual_seed(1), {}
        new = {}
        for k, v in learner.view().state_dict().items():  # tied weights (embedding, head) move together
            moved.setdefault(v.data_ptr(), v + 0.01 * torch.randn(v.shape, generator=g))
            new[k] = moved[v.data_ptr()]
        learner.load_state_dict(learner.state_dict(), new)
        engine.update_weights(learner.engine_weights(engine))
        rank0 = policy.call_all("engine_weights", None, None)[0]
        assert rank0.keys() == new.keys() and all(torch.equal(rank0[k], new[k]) for k in new)
        for replica in rollout.call_all("state_dict"):
            assert replica.keys() == rank0.keys()
            assert all(torch.equal(replica[k], rank0[k]) for k in rank0)

        started = time.perf_counter()  # replicas that never answer: rank 0's broadcast times out
        with pytest.raises(ray.exceptions.RayTaskError, match="(?i)timed? ?out"):
            rl_ray.gather([a.call.remote("broadcast_weights") for a in policy.actors], "rank 0 alone")
        assert time.perf_counter() - started < _TIMEOUT_S + 20

        ray.kill(rollout.actors[1], no_restart=True)  # a replica that died
        started = time.perf_counter()
        with pytest.raises((RankFailed, ray.exceptions.RayTaskError)):
            engine.update_weights(learner.engine_weights(engine))
        assert time.perf_counter() - started < _TIMEOUT_S
    finally:
        launcher.shutdown(clean=False)


@pytest.mark.slow  # two Ray GRPO runs (about 45 s); the default tier's test above checks the sync itself
def test_grpo_logs_the_same_metrics_through_the_collective_as_through_the_object_store(
        ray_local, micro_model, micro_data, tmp_path):
    """Same seed, same placement (disaggregated: a policy rank, 2 replicas, a reference): the collective only
    changes how the weights travel, so every logged rollout/ and train/ metric is identical."""
    from rlhf_core.trainers.rl_on_ray import train_rl_on_ray

    runs = {}
    for sync in ("object_store", "collective"):
        sink = Recorder()
        train_rl_on_ray(_rl(micro_model, micro_data, tmp_path / sync, num_workers=1,
                            **{"distribution.weight_sync": sync}), sink,
                        show_progress=False)
        runs[sync] = sink
    names = [k for _, m in runs["object_store"].rows for k in m if k.startswith(("rollout/", "train/", "eval/"))]
    assert "rollout/logprob_mismatch" in names and "train/policy_loss" in names
    for name in sorted(set(names)):
        assert runs["object_store"].series(name) == runs["collective"].series(name), name
    assert len(runs["collective"].series("perf/weight_sync_s")) == 2
    for run in runs.values():  # the bytes each path moved to the 2 replicas, logged beside the seconds
        assert len(run.series("perf/weight_sync_bytes")) == 2 and min(run.series("perf/weight_sync_bytes")) > 0
    # a replica left on the old weights would sample off the learner's policy from the second batch on
    assert max(runs["collective"].series("rollout/logprob_mismatch")) < 1e-4
