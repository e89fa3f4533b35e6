"""Variable-length attention for packed rows (``rlhf_core.models.attention``) against today's padded SDPA path.

On a CPU the varlen path runs its torch reference (causal SDPA per sequence) through the same
transformers dispatch, segment bookkeeping and mask rule the GPU kernel runs behind; the GPU kernel's
own comparison is ``bench/gpu_lm_head_check.py --parts packed`` (result under ``bench/results/``). Models load with it
here by ``attention="varlen"`` (a trainer config's ``attention``). Tolerances: fp32, only summation order differs (1e-4 relative,
1e-6 absolute on values and gradients); upstream gradients are per-sequence weights of both signs.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from conftest import Recorder
from rlhf_core.models import attention
from rlhf_core.config import DPOConfig, RewardConfig
from rlhf_core.data.io import read_records
from rlhf_core.data.tokenize import collate_pairs
from rlhf_core.algorithms.logprobs import response_logprobs
from rlhf_core.models.loading import load_causal_lm, load_tokenizer
from rlhf_core.rewards.model import load_reward_model, pair_rewards
from rlhf_core.trainers.dpo import train_dpo
from rlhf_core.trainers.reward import train_reward_model
from test_packing_tiny import _pairs  # six tokenized preference pairs of the micro data

CPU = torch.device("cpu")


# --------------------------------------------------------------------------------------
# The pieces, by hand
# --------------------------------------------------------------------------------------

def test_segment_bounds_by_hand():
    """Positions 0 1 2 | 0 1 | 0 1 2 3 in one row: sequences start at 0, 3, 5 and the row ends at 9, the
    longest is 4. Three unpadded rows sharing one (1, 4) arange are three sequences of 4."""
    cu, longest = attention.segment_bounds(torch.tensor([[0, 1, 2, 0, 1, 0, 1, 2, 3]]), rows=1)
    assert cu.tolist() == [0, 3, 5, 9] and cu.dtype == torch.int32 and longest == 4
    cu, longest = attention.segment_bounds(torch.arange(4)[None], rows=3)
    assert cu.tolist() == [0, 4, 8, 12] and longest == 4
    # a row that does not start at position 0 still starts a sequence
    cu, _ = attention.segment_bounds(torch.tensor([[5, 6, 0, 1], [0, 1, 2, 0]]), rows=2)
    assert cu.tolist() == [0, 2, 4, 7, 8]


def test_varlen_reference_equals_block_diagonal_sdpa():
    """Grouped-query heads (4 query heads over 2 KV heads), sequences of 3, 1 and 5 tokens: the
    reference equals one SDPA call under the dense block-diagonal causal mask transformers builds."""
    torch.manual_seed(0)
    T, H, H_kv, D = 9, 4, 2, 8
    q, k, v = torch.randn(T, H, D), torch.randn(T, H_kv, D), torch.randn(T, H_kv, D)
    cu = torch.tensor([0, 3, 4, 9], dtype=torch.int32)
    got = attention.varlen_attention(q, k, v, cu, 5, scale=0.3)
    seg = torch.repeat_interleave(torch.arange(3), torch.tensor([3, 1, 5]))
    allowed = (seg[:, None] == seg[None, :]) & torch.ones(T, T, dtype=torch.bool).tril()
    dense = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None],
                                           v.transpose(0, 1)[None], attn_mask=allowed, scale=0.3,
                                           enable_gqa=True)[0].transpose(0, 1)
    torch.testing.assert_close(got, dense, atol=1e-6, rtol=1e-5)


def test_use_varlen_rule():
    """auto: only where the kernel runs (CUDA) and for models without a sliding window; explicit choices win."""
    from transformers import Qwen2Config

    plain, sliding = Qwen2Config(), Qwen2Config(use_sliding_window=True, sliding_window=64)
    assert not attention.use_varlen(plain, CPU)  # no kernel on a CPU
    assert attention.use_varlen(plain, CPU, "varlen") and not attention.use_varlen(plain, CPU, "sdpa")
    gpu = torch.device("cuda")
    assert attention.use_varlen(plain, gpu) == (attention._kernel() is not None)
    assert not attention.use_varlen(sliding, gpu)
    with pytest.raises(ValueError, match="auto, varlen or sdpa"):
        attention.use_varlen(plain, CPU, "flash")


# --------------------------------------------------------------------------------------
# A micro model: packed rows through varlen == padded rows through SDPA
# --------------------------------------------------------------------------------------

def _value_and_grads(model, fn, batch):
    model.zero_grad(set_to_none=True)
    out = fn(model, batch)
    weights = torch.linspace(-1.0, 1.5, out.numel())  # signed per-sequence weights, as advantages are
    (out * weights).sum().backward()
    return out.detach(), {k: p.grad.detach().clone() for k, p in model.named_parameters() if p.grad is not None}


def _assert_same(a, b):
    (va, ga), (vb, gb) = a, b
    torch.testing.assert_close(va, vb, rtol=1e-4, atol=1e-6)
    assert ga.keys() == gb.keys() and ga
    for k in ga:
        torch.testing.assert_close(ga[k], gb[k], rtol=1e-4, atol=1e-6, msg=k)


def test_packed_varlen_logprobs_rewards_and_gradients_equal_padded_sdpa(micro_model, micro_data, monkeypatch):
    """12 sequences in one packed row through the varlen model: every layer takes the varlen path, and
    the per-sequence log-probs (sum and mean), rewards and their gradients equal the padded batch's under
    SDPA. A padded batch on the varlen model takes SDPA, as before."""
    tok, pairs = _pairs(micro_model, micro_data)
    padded, packed = collate_pairs(pairs, tok.pad_token_id), collate_pairs(pairs, tok.pad_token_id, packed=True)
    torch.manual_seed(0)  # the same random score head on both reward models
    sdpa_lm, sdpa_rm = load_causal_lm(micro_model, CPU), load_reward_model(micro_model, CPU)
    torch.manual_seed(0)
    lm, rm = (load(micro_model, CPU, attention="varlen") for load in (load_causal_lm, load_reward_model))
    assert lm.config._attn_implementation == rm.config._attn_implementation == attention.VARLEN
    assert sdpa_lm.config._attn_implementation == "sdpa"
    layers = lm.config.num_hidden_layers
    worked_out_in_model = []  # the bounds come from the host's positions (packed_forward_kwargs), not layer 1
    monkeypatch.setattr(attention, "_bounds", lambda *a: worked_out_in_model.append(a) or pytest.fail("bounds"))
    for average in (False, True):
        fn = lambda m, b: response_logprobs(m, b, average=average)  # noqa: E731
        before = dict(attention.calls)
        got = _value_and_grads(lm, fn, packed)
        assert attention.calls["varlen"] - before["varlen"] == layers and attention.calls["sdpa"] == before["sdpa"]
        _assert_same(_value_and_grads(sdpa_lm, fn, padded), got)
        before = dict(attention.calls)
        _assert_same(_value_and_grads(sdpa_lm, fn, padded), _value_and_grads(lm, fn, padded))
        assert attention.calls["sdpa"] - before["sdpa"] == layers and attention.calls["varlen"] == before["varlen"]
    _assert_same(_value_and_grads(sdpa_rm, pair_rewards, padded), _value_and_grads(rm, pair_rewards, packed))
    assert not worked_out_in_model


def test_host_bounds_equal_the_first_layers(micro_model, micro_data):
    """The packed row's bounds handed to the model as forward arguments (worked out from the collated
    CPU positions) give exactly the logits of the model working them out itself from its own copy; a
    model without varlen attention gets no such arguments."""
    tok, pairs = _pairs(micro_model, micro_data)
    packed = collate_pairs(pairs, tok.pad_token_id, packed=True)
    assert attention.packed_forward_kwargs(load_causal_lm(micro_model, CPU), packed["position_ids"], CPU) == {}
    lm = load_causal_lm(micro_model, CPU, attention="varlen")
    extra = attention.packed_forward_kwargs(lm, packed["position_ids"], CPU)
    cu, longest = attention.segment_bounds(packed["position_ids"], 1)
    assert torch.equal(extra["cu_seq_lens_q"], cu) and extra["max_length_q"] == longest == max(map(len, sum(pairs, ())))
    inputs = {k: packed[k] for k in ("input_ids", "position_ids")}
    with torch.no_grad():
        own = lm(**inputs, use_cache=False).logits
        given = lm(**inputs, use_cache=False, **extra).logits
    assert torch.equal(own, given)


def test_packed_row_skips_mask_preparation_where_the_decoder_takes_a_mapping(micro_model, llama_chat_model,
                                                                          micro_data, monkeypatch):
    """A Qwen2 packed row gets ``attention_mask={"full_attention": None}``: transformers builds no mask, so
    ``find_packed_sequence_indices`` (whose ``.all()`` waits for the device) never runs, and the logits are
    those of the forward that builds it. A Llama row (no mapping in its forward) keeps transformers' path."""
    from transformers import masking_utils

    tok, pairs = _pairs(micro_model, micro_data)
    packed = collate_pairs(pairs, tok.pad_token_id, packed=True)
    inputs = {k: packed[k] for k in ("input_ids", "position_ids")}
    calls = []
    original = masking_utils.find_packed_sequence_indices
    monkeypatch.setattr(masking_utils, "find_packed_sequence_indices", lambda p: calls.append(1) or original(p))
    for path, maps in ((micro_model, True), (llama_chat_model, False)):
        lm = load_causal_lm(path, CPU, attention="varlen")
        extra = attention.packed_forward_kwargs(lm, packed["position_ids"], CPU)
        assert ("attention_mask" in extra) == maps, path
        with torch.no_grad():
            own = lm(**inputs, use_cache=False).logits
            calls.clear()
            given = lm(**inputs, use_cache=False, **extra).logits
        assert (len(calls) == 0) == maps, (path, calls)
        torch.testing.assert_close(given, own, rtol=1e-5, atol=1e-6)
    from transformers import Qwen2Config

    assert not attention._skips_mask_preparation(Qwen2Config(use_sliding_window=True, sliding_window=64))


def test_varlen_model_generates_and_saves_like_sdpa(micro_model, micro_data, tmp_path):
    """Generation (left-padded prompts, a KV cache) on the varlen model is SDPA's, token for token; a model
    saved from it names no alignflow attention in its config, so plain transformers loads it."""
    from transformers import AutoModelForCausalLM

    tok = load_tokenizer(micro_model, padding_side="left")
    prompts = [r["prompt"] for r in read_records(micro_data["eval"])[:4]]
    enc = tok(prompts, return_tensors="pt", padding=True)
    sdpa_lm = load_causal_lm(micro_model, CPU)
    lm = load_causal_lm(micro_model, CPU, attention="varlen")
    kw = dict(max_new_tokens=8, do_sample=False, pad_token_id=tok.pad_token_id)
    assert torch.equal(lm.generate(**enc, **kw), sdpa_lm.generate(**enc, **kw))
    lm.save_pretrained(tmp_path / "saved")
    assert attention.VARLEN not in (tmp_path / "saved" / "config.json").read_text()
    AutoModelForCausalLM.from_pretrained(str(tmp_path / "saved"))


@pytest.mark.parametrize("stage", ["dpo_live", "reward"])
def test_packed_varlen_training_equals_padded_sdpa(stage, micro_model, micro_data, tmp_path):
    """3 steps padded (SDPA) and packed under a token budget (varlen): the same per-step loss and gradient
    norm (1e-4 relative) and final weights within 1e-3 of the update (test_packing_tiny's criterion)."""
    step = dict(max_steps=3, batch_size=6, grad_accum=2, lr=3e-3, warmup_steps=0, num_threads=1,
                precision="fp32", log_every=1, save_every=0)

    def run(name, **kw):
        out, sink = tmp_path / name, Recorder()
        common = dict(model_path=str(micro_model), train_file=str(micro_data["preferences"]),
                      output_dir=str(out / "model"), checkpoint_dir=str(out / "ckpt"), **step, **kw)
        if stage == "reward":
            result = train_reward_model(RewardConfig(eval_file="", **common), sink, show_progress=False)
        else:
            result = train_dpo(DPOConfig(eval_file=str(micro_data["eval"]), eval_items=2, beta=0.5, nll_weight=0.3,
                                         precompute_reference=False, **common), sink, show_progress=False)
        return sink, load_file(str(result.output_dir / "model.safetensors"))

    base, w0 = run("padded")
    before = attention.calls["varlen"]
    sink, w = run("varlen", packing=True, micro_batch_tokens=40, attention="varlen")
    assert attention.calls["varlen"] > before
    for metric in ("train/loss", "train/grad_norm"):
        assert base.series(metric) == pytest.approx(sink.series(metric), rel=1e-4), metric
    start = load_file(str(micro_model / "model.safetensors"))
    keys = [k for k in w0 if k in start and w0[k].shape == start[k].shape]
    gap = sum(float((w0[k] - w[k]).double().pow(2).sum()) for k in keys) ** 0.5
    update = sum(float((w0[k] - start[k]).double().pow(2).sum()) for k in keys) ** 0.5
    assert update > 0 and gap / update <= 1e-3, gap / update


def test_packed_rl_training_on_varlen_equals_padded_sdpa(micro_model, micro_data, tmp_path):
    """``rl.packing`` (auto: on where the model attends with varlen, off on SDPA): 3 GRPO steps (KL loss, pi_old
    fused into the update, 4 micro-batches, the reference in no-grad chunks) with every micro-batch one
    padding-free row through the varlen path equal the padded run on SDPA: the same rollouts (engine untouched), per-step losses and KL (1e-4 relative) and final weights
    within 1e-3 of the update. A token budget is refused for rl (its micro-batches are rows)."""
    from rlhf_core.config import ConfigError, RLConfig, build_config
    from rlhf_core.trainers.rl import train_rl

    reward = tmp_path / "length_reward.py"
    reward.write_text("def reward(prompts, completions, labels):\n    return [len(c) / 10 for c in completions]\n")

    def run(name, **kw):
        out, sink = tmp_path / name, Recorder()
        cfg = build_config(RLConfig, "rl", {"model_path": str(micro_model),
                                            "prompts_file": str(micro_data["prompts"]),
                                            "eval_file": str(micro_data["eval"]), "output_dir": str(out / "rl"),
                                            "checkpoint_dir": str(out / "ckpt"),
                                            "reward.function": f"{reward}:reward", "max_steps": 3,
                                            "rollout.prompts_per_step": 4, "rollout.group_size": 4,
                                            "rollout.max_new_tokens": 6, "batch_size": 8,
                                            "algorithm.mini_batch_size": 16, "micro_batch_size": 4, "kl.coef": 0.04,
                                            "lr": 3e-3, "warmup_steps": 0, "weight_decay": 0.0, "eval_items": 4,
                                            "eval_at_start": False, "log_rollouts_every": 0, "num_threads": 1, **kw})
        train_rl(cfg, sink, show_progress=False)
        return sink, load_file(str(out / "rl" / "model.safetensors"))

    before = attention.calls["varlen"]
    base, w0 = run("padded")  # packing auto (the default) on SDPA: padded rows
    assert attention.calls["varlen"] == before
    sink, w = run("packed", attention="varlen")  # packing auto where the model attends with varlen (a GPU's choice): packed
    assert attention.calls["varlen"] > before
    assert base.series("rollout/response_length") == sink.series("rollout/response_length")
    for metric in ("train/policy_loss", "train/kl_loss", "train/kl"):
        assert len(base.series(metric)) == 3, metric
        assert base.series(metric) == pytest.approx(sink.series(metric), rel=1e-4, abs=1e-7), metric
    start = load_file(str(micro_model / "model.safetensors"))
    keys = [k for k in w0 if k in start and w0[k].shape == start[k].shape]
    gap = sum(float((w0[k] - w[k]).double().pow(2).sum()) for k in keys) ** 0.5
    update = sum(float((w0[k] - start[k]).double().pow(2).sum()) for k in keys) ** 0.5
    assert update > 0 and gap / update <= 1e-3, gap / update
    with pytest.raises(ConfigError, match="micro_batch_tokens"):
        RLConfig(packing=True, micro_batch_tokens=64)
    with pytest.raises(ConfigError, match=r"rl.packing: must be auto, true or false, got 'sometimes'"):
        RLConfig(packing="sometimes")


def test_rl_prefix_tree_on_a_varlen_model_takes_sdpa_with_its_mask(micro_model):
    """RL's shared-prompt pass hands the model a 4D tree mask: on a model loaded with varlen attention (a GPU's
    default) every layer routes it to SDPA, and the log-probs equal the SDPA model's padded rows."""
    from rlhf_core.models.loading import load_tokenizer
    from rlhf_core.trainers.rl_forward import token_logprobs
    from test_layer_compile import _grouped_rows

    exp, P, mask = _grouped_rows(load_tokenizer(micro_model))
    sdpa_lm = load_causal_lm(micro_model, CPU)
    lm = load_causal_lm(micro_model, CPU, attention="varlen")
    assert lm.config._attn_implementation == attention.VARLEN
    with torch.no_grad():
        padded, _ = token_logprobs(sdpa_lm, exp, P, 1.0)
        before = dict(attention.calls)
        tree, _ = token_logprobs(lm, exp, P, 1.0, share_prompts=True)
    assert attention.calls["sdpa"] - before["sdpa"] == lm.config.num_hidden_layers
    assert attention.calls["varlen"] == before["varlen"]
    torch.testing.assert_close(tree * mask, padded * mask, atol=1e-5, rtol=0)
