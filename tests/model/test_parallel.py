"""Distributed core on real Ray (local instance, CPU, gloo): data-parallel ranks match one process,
GRPO runs with colocated and disaggregated placement, LoRA trains, merges and reloads as a plain model.

Everything here is real: Ray actors in placement groups forming a torch.distributed world, torch DDP
and DeepSpeed ZeRO-2 on DeepSpeed's CPU accelerator, peft adapters.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from conftest import Recorder
from rlhf_core.config import RLConfig, build_config, SFTConfig
from rlhf_core.models.loading import export_state_dict, load_causal_lm, merged_model, prepare_for_training
from rlhf_core.trainers.loop import save_hf_dir
from rlhf_core.trainers.sft import train_sft


def _sft(micro_model, micro_data, tmp_path, **kw) -> SFTConfig:
    base = dict(model_path=str(micro_model), train_file=str(micro_data["sft"]), eval_file=str(micro_data["eval"]),
                output_dir=str(tmp_path / "sft"), checkpoint_dir=str(tmp_path / "ckpt"), max_steps=4, batch_size=8,
                grad_accum=2, lr=3e-3, warmup_steps=1, eval_items=4, num_threads=1, precision="fp32", log_every=1,
                save_every=0)
    return SFTConfig(**{**base, **kw})


# ZeRO-2 (DeepSpeed's CPU accelerator, about 60 s with its op build) sits in the slow tier to keep
# `make test` under 30 minutes; DDP exercises the same loop and world on every run.
@pytest.mark.parametrize("parallel", ["ddp", pytest.param("zero2", marks=pytest.mark.slow)])
def test_two_workers_take_the_step_one_worker_takes(ray_local, micro_model, micro_data, tmp_path, parallel):
    """fp32, same global batch (8 rows x 2 micro-batches): each step's loss with 2 data-parallel Ray
    workers is within 1e-4 (relative) of one process's, and so are the final weights."""
    from rlhf_core.trainers.ray_launcher import train_data_parallel

    one, two = Recorder(), Recorder()
    a = train_sft(_sft(micro_model, micro_data, tmp_path / "one"), one, show_progress=False)
    b = train_data_parallel(train_sft, _sft(micro_model, micro_data, tmp_path / "two", num_workers=2,
                                            parallel=parallel), two, show_progress=False)
    la, lb = one.series("train/loss"), two.series("train/loss")
    print(f"{parallel}: per-step loss, 1 process {la}; 2 Ray workers {lb}; "
          f"max relative gap {max(abs(x - y) / abs(x) for x, y in zip(la, lb)):.2e}")
    assert len(la) == len(lb) == 4
    for x, y in zip(la, lb):
        assert abs(x - y) <= 1e-4 * abs(x), (la, lb)
    assert la[-1] != la[0]  # the steps did move the model
    wa, wb = load_file(str(a.output_dir / "model.safetensors")), load_file(str(b.output_dir / "model.safetensors"))
    for k in wa:
        assert torch.allclose(wa[k], wb[k], rtol=1e-3, atol=1e-5), k
    # rank 0's metrics streamed back; the token count is the whole world's
    assert one.series("perf/tokens_per_s") and two.series("perf/tokens_per_s")
    assert json.loads((b.output_dir / "alignflow.json").read_text())["config"]["num_workers"] == 2


@pytest.mark.slow  # DeepSpeed's CPU op build (about 60 s on a fresh machine)
def test_zero2_in_one_process_takes_the_plain_step(micro_model, micro_data, tmp_path):
    """``parallel: zero2`` with one worker (ZeRO in one process, as ``offload_optimizer`` on one GPU runs): the
    strategy joins a process group of one itself (before, DeepSpeed looked for MPI and failed without mpi4py),
    and each step's loss is within 1e-4 (relative) of the plain one-process run's."""
    import torch.distributed as dist

    one, zero = Recorder(), Recorder()
    train_sft(_sft(micro_model, micro_data, tmp_path / "one", max_steps=3), one, show_progress=False)
    try:
        train_sft(_sft(micro_model, micro_data, tmp_path / "zero", max_steps=3, parallel="zero2"), zero,
                  show_progress=False)
        assert dist.is_initialized() and dist.get_world_size() == 1
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    la, lz = one.series("train/loss"), zero.series("train/loss")
    assert len(la) == len(lz) == 3 and la[-1] != la[0]
    for x, y in zip(la, lz):
        assert abs(x - y) <= 1e-4 * abs(x), (la, lz)


def test_two_workers_with_compiled_layers_take_the_eager_step(ray_local, micro_model, micro_data, tmp_path):
    """``compile_layers: on`` under DDP (what ``auto`` picks on GPUs): two Ray workers whose decoder layers run
    compiled (dynamo + AOTAutograd, eager kernels: ``compile_backend: aot_eager`` reaches the actors) take the
    steps one eager process takes: losses within 1e-4 relative, final weights within 1e-3."""
    from rlhf_core.trainers.ray_launcher import train_data_parallel

    one, two = Recorder(), Recorder()
    a = train_sft(_sft(micro_model, micro_data, tmp_path / "one", max_steps=3), one, show_progress=False)
    b = train_data_parallel(train_sft, _sft(micro_model, micro_data, tmp_path / "two", max_steps=3, num_workers=2,
                                            compile_layers="on", compile_backend="aot_eager"), two,
                          show_progress=False)
    la, lb = one.series("train/loss"), two.series("train/loss")
    assert len(la) == len(lb) == 3 and la[-1] != la[0]
    for x, y in zip(la, lb):
        assert abs(x - y) <= 1e-4 * abs(x), (la, lb)
    wa, wb = load_file(str(a.output_dir / "model.safetensors")), load_file(str(b.output_dir / "model.safetensors"))
    for k in wa:
        assert torch.allclose(wa[k], wb[k], rtol=1e-3, atol=1e-5), k
    assert json.loads((b.output_dir / "alignflow.json").read_text())["config"]["compile_layers"] == "on"


# ZeRO-2 in the slow tier, as above: it checks that the loop, not DeepSpeed's own micro-step count, puts
# the accumulation boundary where a step of a varying number of micro-batches ends.
@pytest.mark.parametrize("parallel", ["ddp", pytest.param("zero2", marks=pytest.mark.slow)])
def test_token_budget_with_uneven_micro_batch_counts_takes_one_process_step(ray_local, micro_model, micro_data,
                                                                           tmp_path, parallel):
    """DPO, packed, 8 pairs x 2 draws a step, a 40-token budget (about one pair a micro-batch): each rank
    groups its own pairs, so the ranks' micro-batch counts differ and the shorter one runs empty
    micro-batches (perf/empty_micro_batches > 0 at some step). The per-step loss and gradient norm stay
    within 1e-4 (relative) of one process's, and so do the final weights (1e-3 relative, 1e-5 absolute)."""
    from rlhf_core.config import DPOConfig
    from rlhf_core.trainers.ray_launcher import train_data_parallel
    from rlhf_core.trainers.dpo import train_dpo

    def cfg(root, **kw):
        return DPOConfig(model_path=str(micro_model), train_file=str(micro_data["preferences"]),
                         eval_file=str(micro_data["eval"]), output_dir=str(root / "dpo"),
                         checkpoint_dir=str(root / "ckpt"), max_steps=4, batch_size=8, grad_accum=2, lr=3e-3,
                         warmup_steps=1, eval_items=2, num_threads=1, precision="fp32", log_every=1, save_every=0,
                         beta=0.5, packing=True, micro_batch_tokens=40, **kw)

    one, two = Recorder(), Recorder()
    a = train_dpo(cfg(tmp_path / "one"), one, show_progress=False)
    b = train_data_parallel(train_dpo, cfg(tmp_path / "two", num_workers=2, parallel=parallel), two,
                            show_progress=False)
    print(f"{parallel}: micro-batches per step, 1 process {one.series('perf/micro_batches')}; 2 workers "
          f"{two.series('perf/micro_batches')} + empty {two.series('perf/empty_micro_batches')}; losses "
          f"{one.series('train/loss')} vs {two.series('train/loss')}")
    assert max(two.series("perf/empty_micro_batches")) > 0
    assert one.series("perf/empty_micro_batches") == [0.0] * 4
    for key in ("train/loss", "train/grad_norm"):
        la, lb = one.series(key), two.series(key)
        assert len(la) == len(lb) == 4 and la == pytest.approx(lb, rel=1e-4), (key, la, lb)
    wa, wb = load_file(str(a.output_dir / "model.safetensors")), load_file(str(b.output_dir / "model.safetensors"))
    for k in wa:
        assert torch.allclose(wa[k], wb[k], rtol=1e-3, atol=1e-5), k


def _rl(micro_model, micro_data, tmp_path, reward_function, **kw) -> RLConfig:
    values = {"model_path": str(micro_model), "prompts_file": str(micro_data["prompts"]),
              "eval_file": str(micro_data["eval"]), "output_dir": str(tmp_path / "rl"),
              "checkpoint_dir": str(tmp_path / "ckpt"), "reward.function": reward_function, "max_steps": 2,
              "rollout.prompts_per_step": 4, "rollout.group_size": 4, "rollout.max_new_tokens": 6, "batch_size": 64,
              "algorithm.mini_batch_size": 8,
              "lr": 3e-3, "warmup_steps": 0, "weight_decay": 0.0, "eval_items": 4, "eval_at_start": False,
              "num_threads": 1,
              "precision": "fp32", "save_every": 0}
    values.update(kw)
    return build_config(RLConfig, "rl", {**values})


@pytest.mark.parametrize("placement", ["colocated", pytest.param("disaggregated", marks=pytest.mark.slow)])
def test_grpo_runs_on_ray_with_either_placement(ray_local, micro_model, micro_data, tmp_path, length_reward,
                                                placement, caplog):
    """GRPO with the controller here and the models in actors: 2 policy ranks (DDP over gloo), reference
    scorers, a rollout replica; the trained policy differs from the start and the controller's metrics
    are the one-process run's on the same rollouts (one replica samples with the same seed). Colocated, the
    replica also releases its weights after each rollout (``rollout_sleep: on``, what auto picks on GPUs), so
    the second step's samples come from weights the sync had to allocate and fill again."""
    import logging

    from rlhf_core.trainers.rl_on_ray import train_rl_on_ray
    from rlhf_core.trainers.rl import train_rl

    local, remote = Recorder(), Recorder()
    train_rl(_rl(micro_model, micro_data, tmp_path / "local", length_reward), local, show_progress=False)
    with caplog.at_level(logging.WARNING, logger="rlhf_core.trainers.rl_on_ray"):
        result = train_rl_on_ray(_rl(micro_model, micro_data, tmp_path / "ray", length_reward,
                                     **{"distribution.placement": placement},
                                     num_workers=2, **{"rollout.sleep": "on" if placement == "colocated" else "auto"}),
                                 remote, show_progress=False)
    assert ("rollout replicas free" in caplog.text) == (placement == "colocated")
    before = load_file(str(micro_model / "model.safetensors"))
    after = load_file(str(result.output_dir / "model.safetensors"))
    assert any(not torch.equal(before[k], after[k]) for k in before)
    # the same samples and rewards (one rollout replica, same seed), and the same update to 1e-4
    assert local.series("rollout/reward_mean") == remote.series("rollout/reward_mean")
    for key in ("train/policy_loss", "train/kl", "train/grad_norm"):
        for x, y in zip(local.series(key), remote.series(key)):
            assert abs(x - y) <= 1e-4 * max(abs(x), 1e-6) + 1e-7, (key, local.series(key), remote.series(key))
    assert result.metrics["eval/accuracy"] >= 0.0
    # the run's placement groups are gone with it (the cluster's own listing: tests/e2e/test_ray_cluster.py)
    assert all(pg["state"] == "REMOVED" for pg in ray_local.util.placement_group_table().values())


def test_lora_policy_takes_its_own_base_as_the_reference(ray_local, micro_model, micro_data, tmp_path, length_reward,
                                                        caplog):
    """A LoRA run whose reference is its starting model scores the reference with the policy's adapters off
    (``rl_roles.BaseReference``) and loads no reference model: in one process it gives the run with a separate
    reference scorer exactly (KL loss on, so the reference enters the update: same KL, losses and weights); on
    Ray, 2 policy ranks score it with no reference ranks. (Ray's two ranks split the batch and its replicas
    sample with seeds of their own, so their rollouts differ from one process's: the check there is the KL's.)"""
    import logging
    from dataclasses import replace

    from rlhf_core.trainers.rl_on_ray import train_rl_on_ray
    from rlhf_core.trainers.rl import train_rl
    from rlhf_core.trainers.rl_roles import ReferenceScorer, base_is_reference

    def cfg(name, **kw):
        return _rl(micro_model, micro_data, tmp_path / name, length_reward, **{"kl.coef": 0.05}, lora_rank=4,
                   lora_alpha=8.0, **kw)

    separate, base, remote = Recorder(), Recorder(), Recorder()
    with_scorer = cfg("separate")
    assert base_is_reference(with_scorer) and not base_is_reference(replace(with_scorer, lora_rank=0))
    assert not base_is_reference(replace(with_scorer, ref_model_path=str(tmp_path / "another")))
    a = train_rl(with_scorer, separate, show_progress=False,
                 reference=ReferenceScorer(with_scorer, torch.device("cpu")))
    b = train_rl(cfg("base"), base, show_progress=False)
    for key in ("train/kl", "train/kl_loss", "train/policy_loss", "train/grad_norm"):
        assert len(separate.series(key)) == 2 and separate.series(key) == base.series(key), key
    assert separate.series("train/kl")[-1] > 0
    wa, wb = load_file(str(a.output_dir / "model.safetensors")), load_file(str(b.output_dir / "model.safetensors"))
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
    with caplog.at_level(logging.WARNING, logger="rlhf_core.trainers.rl_on_ray"):
        train_rl_on_ray(cfg("ray", num_workers=2, placement="colocated"), remote, show_progress=False)
    assert "2 policy rank(s), 0 reference" in caplog.text
    # LoRA's B starts at zero: before the first update the policy is its base, so a reference scored on the
    # wrong rows (or with the adapters on) would show as KL; after it, the adapters have moved the policy
    for run in (separate, base, remote):
        kl = run.series("train/kl")
        assert len(kl) == 2 and abs(kl[0]) <= 1e-7 and kl[1] > 0, kl


def test_a_lora_replica_takes_the_adapters_alone_and_samples_as_the_merged_weights(micro_model, micro_data, tmp_path,
                                                                                  length_reward):
    """Issue 22's sync: a rollout replica of a LoRA policy holds the frozen base with adapters injected, as the
    learner does, and each sync sends the adapters alone (``engine_weights(adapters_only=True)``, what
    ``PolicyGroup.engine_weights`` asks of rank 0 for such replicas). Loaded into the replica they give the
    greedy tokens and log-probs of a plain replica loaded with the merged weights, for a fraction of the bytes;
    a sync whose names are not exactly the adapters' is refused by the strict load. Each sync reports the bytes it
    moved (``perf/weight_sync_bytes``): the adapters', against the whole merged model's. ``rl.rollout.lora_sync``
    merged sends the merged weights instead, to a plain replica."""
    from rlhf_core.trainers.rollout_replica import RolloutReplica, replicas_hold_adapters
    from rlhf_core.rollout.engine import SamplingParams
    from rlhf_core.trainers.rl_roles import PolicyLearner

    cfg = _rl(micro_model, micro_data, tmp_path, length_reward, lora_rank=4, lora_alpha=8.0)
    assert replicas_hold_adapters(cfg) and not replicas_hold_adapters(_rl(micro_model, micro_data, tmp_path,
                                                                          length_reward, lora_rank=4,
                                                                          **{"rollout.lora_sync": "merged"}))
    assert replicas_hold_adapters(_rl(micro_model, micro_data, tmp_path, length_reward, lora_rank=4,
                                      **{"rollout.engine": "vllm"}))
    learner = PolicyLearner(cfg, torch.device("cpu"))
    torch.manual_seed(0)
    with torch.no_grad():  # trained adapters: B away from its zero start
        for name, p in learner.policy.named_parameters():
            if "lora_" in name:
                p.normal_(0, 0.3)
    adapters = learner.engine_weights(adapters_only=True)
    merged = learner.engine_weights()
    assert adapters and all("lora_" in k for k in adapters) and not any("lora_" in k for k in merged)
    assert sum(t.numel() for t in adapters.values()) < 0.2 * sum(t.numel() for t in merged.values())

    holding, plain = RolloutReplica(cfg), RolloutReplica(_rl(micro_model, micro_data, tmp_path, length_reward))
    assert holding.engine.name == "static"
    from rlhf_core.rollout.engine import tensor_bytes

    moved_adapters, moved_merged = holding.update_weights(adapters), plain.update_weights(merged)
    assert moved_adapters == tensor_bytes(adapters) and moved_merged == tensor_bytes(merged) > 5 * moved_adapters
    params = SamplingParams(n=2, temperature=0, max_new_tokens=8)
    prompts = ["12+30=", "sort 321=", "7*8="]
    a, b = holding.generate(prompts, params), plain.generate(prompts, params)
    assert torch.equal(a.response_ids, b.response_ids)
    torch.testing.assert_close(a.sampling_logprobs, b.sampling_logprobs, atol=1e-5, rtol=0)
    with pytest.raises(RuntimeError, match="Missing key"):
        holding.update_weights(dict(list(adapters.items())[:-1]))
    # the shared copy's contract: exactly the adapters, or nothing copied (no adapters here; names that differ)
    from rlhf_core.models.loading import copy_adapters

    assert not copy_adapters(plain.engine.model, adapters)
    assert not copy_adapters(holding.engine.model, dict(list(adapters.items())[:-1]))
    assert copy_adapters(holding.engine.model, adapters)


def test_a_released_replica_holds_no_weights_until_a_sync_refills_them(micro_model, micro_data, tmp_path,
                                                                      length_reward):
    """``rl.rollout.sleep``: a replica that released its weights holds none of their bytes (its RoPE buffers
    stay), refuses to sample, and refuses a sync that would leave a weight unwritten (the strict load); a
    whole sync gives it storage again and it samples what it sampled before, token for token."""
    from rlhf_core.distributed.parallel import resident_weight_bytes
    from rlhf_core.trainers.rollout_replica import RolloutReplica
    from rlhf_core.rollout.engine import SamplingParams

    replica = RolloutReplica(_rl(micro_model, micro_data, tmp_path, length_reward))
    model = replica.engine.model
    whole = resident_weight_bytes(model)
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    params = SamplingParams(n=2, temperature=0, max_new_tokens=8)
    prompts = ["12+30=", "sort 321="]
    before = replica.generate(prompts, params)

    assert replica.release_weights() == whole > 0
    assert resident_weight_bytes(model) == 0 and replica.release_weights() == 0  # once
    assert all(b.numel() for b in model.buffers())
    with pytest.raises(RuntimeError, match="released after the last rollout"):
        replica.generate(prompts, params)
    with pytest.raises(RuntimeError, match="Missing key"):
        replica.update_weights(dict(list(weights.items())[1:]))
    with pytest.raises(RuntimeError, match="released after the last rollout"):
        replica.generate(prompts, params)

    replica.update_weights(weights)
    assert resident_weight_bytes(model) == whole
    after = replica.generate(prompts, params)
    assert torch.equal(before.response_ids, after.response_ids)
    torch.testing.assert_close(before.sampling_logprobs, after.sampling_logprobs, atol=0, rtol=0)


def test_a_lora_controller_copy_takes_the_adapters_alone_and_merges_as_rank_0(ray_local, micro_model, micro_data,
                                                                             tmp_path, length_reward):
    """LoRA on Ray: the controller's copy of the policy is the frozen base with adapters injected (in the dtype the
    ranks hold the base in), and a refresh fetches the adapters alone, as a replica's sync does; the merged
    weights of a 32B policy, gathered whole on every GPU, would not fit beside a replica. New adapters set on both
    ranks through the resume path (a checkpoint's LoRA names) reach the copy at the next refresh (its own were
    zeroed in between), its merge equals rank 0's merged weights to 1e-6, and its base never moves."""
    from rlhf_core.trainers import ray_launcher as rl_ray, rl_on_ray
    from rlhf_core.models.loading import adapter_parameters, export_state_dict

    cfg = _rl(micro_model, micro_data, tmp_path, length_reward, lora_rank=4, lora_alpha=8.0, num_workers=2,
              **{"distribution.placement": "colocated"})
    launcher = rl_ray.Launcher(False, cfg)
    with launcher.running():
        policy = launcher.group(rl_ray.TrainerActor, "policy", launcher.bundles(2), [0, 1], share=1.0, num_threads=1,
                                world=True)
        policy.build(rl_on_ray._learner, cfg)
        learner = rl_on_ray.RemoteLearner(policy, cfg)
        view = learner.view()
        base = {k: v.clone() for k, v in view.state_dict().items() if "lora_" not in k}
        g = torch.Generator().manual_seed(0)
        new = {k: v + 0.1 * torch.randn(v.shape, generator=g) if "lora_" in k else v
               for k, v in view.state_dict().items()}
        learner.load_state_dict(learner.state_dict(), new)
        with torch.no_grad():
            for p in adapter_parameters(view).values():
                p.zero_()
        learner.masters_into_model()  # what the end of a run does; the next view refreshes
        refreshed = learner.view()
        rank0_merged = rl_ray.gather([a.call.remote("engine_weights", None, None, False) for a in policy.actors],
                                     "merged weights")[0]
    assert refreshed is view and adapter_parameters(view)
    assert all(torch.equal(p, new[k]) for k, p in adapter_parameters(view).items())
    assert all(torch.equal(v, base[k]) for k, v in view.state_dict().items() if "lora_" not in k)
    ours = export_state_dict(refreshed)
    plain_base = {k.replace(".base_layer.", "."): v for k, v in base.items()}  # the merged model's names
    assert ours.keys() == rank0_merged.keys() == plain_base.keys()
    assert any(not torch.equal(ours[k], plain_base[k]) for k in ours)  # the new adapters are merged in
    for k in ours:
        torch.testing.assert_close(ours[k], rank0_merged[k], atol=1e-6, rtol=0)


@pytest.mark.slow  # three LoRA GRPO runs on Ray (about a minute)
def test_lora_grpo_on_ray_resumes_from_its_checkpoint_as_the_uninterrupted_run(ray_local, micro_model, micro_data,
                                                                               tmp_path, length_reward, monkeypatch):
    """A LoRA policy on Ray checkpoints what the controller holds, the base with adapters injected (LoRA names, as
    one process does), and resumes from it: a run that fails in iteration 3's update, after its step-2
    checkpoint, and is run again ends with the weights of the run nobody stopped, bit for bit (fp32). The
    controller held the merged plain model before, whose names a LoRA rank's load refuses."""
    from rlhf_core.trainers.rl_on_ray import train_rl_on_ray

    def cfg(name):
        return _rl(micro_model, micro_data, tmp_path / name, length_reward, lora_rank=4, lora_alpha=8.0,
                   **{"kl.coef": 0.05}, num_workers=2, **{"distribution.placement": "colocated"}, max_steps=4,
                   save_every=2,
                   keep_checkpoints=10)

    monkeypatch.setenv("ALIGNFLOW_FAULT", "rl-learner:3")
    with pytest.raises(Exception, match="fault injected"):
        train_rl_on_ray(cfg("stopped"), show_progress=False)
    monkeypatch.delenv("ALIGNFLOW_FAULT")
    assert (tmp_path / "stopped" / "ckpt" / "step-0000002").is_dir()
    resumed, whole = Recorder(), Recorder()
    a = train_rl_on_ray(cfg("stopped"), resumed, show_progress=False)
    b = train_rl_on_ray(cfg("whole"), whole, show_progress=False)
    assert resumed.series("checkpoint/resumed_from_step") == [2.0]
    wa, wb = load_file(str(a.output_dir / "model.safetensors")), load_file(str(b.output_dir / "model.safetensors"))
    assert wa.keys() == wb.keys() and not any("lora_" in k for k in wa)
    assert all(torch.equal(wa[k], wb[k]) for k in wa)


@pytest.mark.slow  # DeepSpeed's CPU op build, then a ZeRO-3 GRPO run on Ray
def test_zero3_reference_ranks_partition_the_weights_and_score_as_the_whole_model(ray_local, micro_model, micro_data,
                                                                                  tmp_path, length_reward, caplog):
    """``rl.distribution.shard_reference`` under ZeRO-3: two reference actors forming a world of their own each hold
    about half
    of the frozen weights' bytes and, on 7 rows (one rank scores a row fewer: the ranks still agree on the
    chunks, since every ZeRO-3 forward is a collective), give the log-probs a whole reference gives (fp32, to
    1e-6). Then a colocated GRPO run on two ZeRO-3 policy ranks starts partitioned reference ranks and logs a KL
    of 0 before the first update (the reference is the starting policy) and above 0 after it."""
    import logging

    from rlhf_core.trainers import ray_launcher as rl_ray, rl_on_ray
    from rlhf_core.models.loading import load_tokenizer
    from rlhf_core.distributed.parallel import resident_weight_bytes
    from rlhf_core.rollout.engine import HFGenerateEngine, SamplingParams
    from rlhf_core.trainers.rl_roles import ReferenceScorer, reference_sharded

    cfg = _rl(micro_model, micro_data, tmp_path, length_reward, **{"kl.coef": 0.05}, num_workers=2,
              **{"distribution.placement": "colocated"},
              parallel="zero3")
    assert reference_sharded(cfg) and not reference_sharded(_rl(micro_model, micro_data, tmp_path, length_reward,
                                                                 num_workers=2,
                                                                 **{"distribution.placement": "colocated"},
                                                                 parallel="zero3",
                                                                 **{"distribution.shard_reference": False}))
    whole = ReferenceScorer(cfg, torch.device("cpu"))  # one process: nothing to partition over
    batch = HFGenerateEngine(whole.model, load_tokenizer(micro_model)).generate(
        ["12+30=", "7*8=", "sort 321=", "1+1=", "9-4=", "3*3=", "sort 12="], SamplingParams(n=1, max_new_tokens=6,
                                                                                            seed=3))
    exp = batch.learner_inputs()
    p = batch.prompt_ids.shape[1]
    launcher = rl_ray.Launcher(False, cfg)
    with launcher.running():
        group = launcher.group(rl_ray.ReferenceActor, "reference", launcher.bundles(2), [0, 1], share=1.0,
                               num_threads=1, world=True)
        group.build(rl_on_ray._reference, cfg, per_rank=lambda i: {"rank": i, "size": 2})
        held = group.call_all("resident_bytes")
        sharded = rl_on_ray.RemoteReference(group).logprobs(exp, p)
    total = resident_weight_bytes(whole.model)
    print(f"reference weights: {total} B whole; {held} B on the two ZeRO-3 ranks")
    assert all(h < 0.55 * total for h in held) and sum(held) >= total
    mask = batch.response_mask.float()
    torch.testing.assert_close(sharded * mask, whole.logprobs(exp, p) * mask, atol=1e-6, rtol=0)

    sink = Recorder()
    with caplog.at_level(logging.WARNING, logger="rlhf_core.trainers.rl_on_ray"):
        rl_on_ray.train_rl_on_ray(cfg, sink, show_progress=False)
    assert "2 policy rank(s), 2 reference (ZeRO-3 partitioned)" in caplog.text
    kl = sink.series("train/kl")
    assert len(kl) == 2 and abs(kl[0]) <= 1e-6 and kl[1] > 0, kl


@pytest.mark.slow  # DeepSpeed's CPU op build (about 60 s on a fresh machine)
@pytest.mark.parametrize("ranks", [2, 1])
def test_lora_grpo_under_zero3_scores_the_base_on_the_policy_ranks(ray_local, micro_model, micro_data, tmp_path,
                                                                   length_reward, caplog, ranks):
    """LoRA adapters over a ZeRO-3 base (the large-model setting): the run completes (before, DeepSpeed dropped
    the empty no-decay group and the schedule's first step failed), no reference ranks are started, and the
    reference, the base scored on the policy ranks with the adapters off, gives a KL of 0 before the first
    update and above 0 after it. Also with one rank (the eight-GPU variant's path on one device), which forms no
    Ray world: DeepSpeed gets a process group of one (before, it looked for MPI and failed without mpi4py)."""
    import logging

    from rlhf_core.trainers.rl_on_ray import train_rl_on_ray

    sink = Recorder()
    with caplog.at_level(logging.WARNING, logger="rlhf_core.trainers.rl_on_ray"):
        train_rl_on_ray(_rl(micro_model, micro_data, tmp_path, length_reward, **{"kl.coef": 0.05}, lora_rank=4,
                            lora_alpha=8.0,
                            num_workers=ranks, **{"distribution.placement": "colocated"}, parallel="zero3"), sink,
                            show_progress=False)
    assert f"{ranks} policy rank(s), 0 reference" in caplog.text
    kl = sink.series("train/kl")
    assert len(kl) == 2 and abs(kl[0]) <= 1e-7 and kl[1] > 0, kl


@pytest.mark.slow  # two GRPO runs, one on Ray (about 30 s); the padded/packed equality itself is in the default tier
def test_packed_grpo_on_two_ray_ranks_takes_the_padded_one_process_update(ray_local, micro_model, micro_data, tmp_path,
                                                                          length_reward):
    """``rl.packing`` under DDP: 2 policy ranks each packing its rows of every micro-batch into one row (one
    forward per micro-batch on every rank), with the reference packed too, take the padded one-process run's
    update on the same rollouts (KL loss on, so the reference log-probs enter it)."""
    from rlhf_core.trainers.rl_on_ray import train_rl_on_ray
    from rlhf_core.trainers.rl import train_rl

    local, remote = Recorder(), Recorder()
    train_rl(_rl(micro_model, micro_data, tmp_path / "local", length_reward, **{"kl.coef": 0.05}), local,
             show_progress=False)
    train_rl_on_ray(_rl(micro_model, micro_data, tmp_path / "ray", length_reward, **{"kl.coef": 0.05}, num_workers=2,
                        **{"distribution.placement": "colocated"}, packing=True), remote, show_progress=False)
    assert local.series("rollout/reward_mean") == remote.series("rollout/reward_mean")
    for key in ("train/policy_loss", "train/kl_loss", "train/kl", "train/grad_norm"):
        assert len(local.series(key)) == 2, key
        for x, y in zip(local.series(key), remote.series(key)):
            assert abs(x - y) <= 1e-4 * max(abs(x), 1e-6) + 1e-7, (key, local.series(key), remote.series(key))


@pytest.mark.slow
def test_on_policy_distillation_on_ray_scores_with_teacher_actors(ray_local, micro_model, micro_data, tmp_path,
                                                                   length_reward, monkeypatch):
    """estimator distill with colocated placement (2 policy ranks, each with a reference and a teacher rank
    beside it): the teacher's per-token reverse KL and the update match the one-process run on the same rollouts
    (one replica, same seed), so the rows reach the teacher ranks and come back in order. The teacher is the
    micro model with its weights scaled (same tokenizer, other log-probs). (Slow tier: about a minute.)"""
    import shutil

    from rlhf_core.trainers.rl_on_ray import train_rl_on_ray
    from rlhf_core.trainers.rl import train_rl

    teacher = tmp_path / "teacher"
    shutil.copytree(micro_model, teacher)
    model = load_causal_lm(teacher)
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(1.5)
    model.save_pretrained(str(teacher), safe_serialization=True)
    kw = dict(estimator="distill", teacher_model_path=str(teacher), kl_coef=0.0)
    local, remote = Recorder(), Recorder()
    train_rl(_rl(micro_model, micro_data, tmp_path / "local", length_reward, **kw), local, show_progress=False)
    # under Ray the controller loads no scorer of its own: the teacher's log-probs come from the actors
    monkeypatch.setattr("rlhf_core.trainers.rl_roles.ReferenceScorer", lambda *a, **k: pytest.fail("scored in-process"))
    train_rl_on_ray(_rl(micro_model, micro_data, tmp_path / "ray", length_reward,
                        **{"distribution.placement": "colocated"},
                        num_workers=2, **kw), remote, show_progress=False)
    assert len(local.series("rollout/teacher_reverse_kl")) == 2
    for key in ("rollout/teacher_reverse_kl", "train/policy_loss", "train/grad_norm"):
        for x, y in zip(local.series(key), remote.series(key), strict=True):
            assert abs(x - y) <= 1e-4 * max(abs(x), 1e-6) + 1e-7, (key, local.series(key), remote.series(key))


def test_lora_trains_merges_and_reloads_as_a_plain_model(micro_model, micro_data, tmp_path):
    """peft adapters: the merged export is a plain HF directory whose logits equal the adapted model's;
    the state dict a rollout engine gets (merged, adapter-free names) is the same weights; and an SFT
    run with lora_rank > 0 trains only adapters and saves a plain model that moved from the base."""
    model = load_causal_lm(micro_model, torch.device("cpu"))
    prepare_for_training(model, lora_rank=4, lora_alpha=8.0)
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)
    with torch.no_grad():  # a trained-looking adapter: B != 0
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.05)
    ids = torch.tensor([[5, 17, 42, 8, 99, 3]])
    with torch.no_grad():
        adapted = model(input_ids=ids).logits
    before = {k: v.clone() for k, v in model.state_dict().items()}
    engine_weights = export_state_dict(model)
    assert not any("lora_" in k or "base_layer" in k for k in engine_weights)
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())  # the base did not move by an ulp
    save_hf_dir(merged_model(model), _tok(micro_model), tmp_path / "merged")
    plain = load_causal_lm(tmp_path / "merged", torch.device("cpu")).eval()
    assert not any("lora" in k for k in load_file(str(tmp_path / "merged" / "model.safetensors")))
    with torch.no_grad():
        assert torch.allclose(plain(input_ids=ids).logits, adapted, atol=1e-5)
    for k, v in plain.state_dict().items():
        assert torch.allclose(engine_weights[k], v, atol=1e-6), k

    result = train_sft(_sft(micro_model, micro_data, tmp_path, max_steps=6, batch_size=16, grad_accum=1,
                            lora_rank=8, lora_alpha=16.0, lr=1e-2), show_progress=False)
    base = load_file(str(micro_model / "model.safetensors"))
    out = load_file(str(result.output_dir / "model.safetensors"))
    assert set(out) == set(base)  # plain names: no adapter tensors
    assert any(not torch.equal(base[k], out[k]) for k in base)
    assert torch.equal(base["model.norm.weight"], out["model.norm.weight"])  # not adapted: frozen
    load_causal_lm(result.output_dir, torch.device("cpu"))


def _tok(path):
    from rlhf_core.models.loading import load_tokenizer

    return load_tokenizer(path)
