"""Padding-free micro-batches on a micro model: packed rows score, and train, like padded ones.

Two levels. The pieces (per-sequence log-probs, packed reward pooling, the distillation loss)
give the padded batch's values and gradients on one packed row. Then each offline trainer
(DPO with a precomputed or live reference, KTO, reward model, distillation) runs 3 steps padded,
packed, and packed under a token budget: the per-step losses and gradient norms and the final
weights agree (fp32, CPU). Steps 2 and 3 depend on step 1's update and Adam's moments, so the
whole gradient, not only its sign, has to match.
"""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from conftest import Recorder
from rlhf_core.config import DistillConfig, DPOConfig, KTOConfig, RewardConfig
from rlhf_core.data.io import read_records
from rlhf_core.data.sequences import tokenize_preference_records
from rlhf_core.data.tokenize import collate_packed, collate_padded, collate_pair_tree, collate_pairs
from rlhf_core.algorithms.logprobs import MODEL_INPUTS, response_logprobs, response_token_counts
from rlhf_core.algorithms.losses import distillation_loss
from rlhf_core.models.loading import load_causal_lm, load_tokenizer
from rlhf_core.rewards.model import load_reward_model, pair_rewards
from rlhf_core.trainers.distill import train_distill
from rlhf_core.trainers.dpo import train_dpo
from rlhf_core.trainers.kto import train_kto
from rlhf_core.trainers.reward import train_reward_model

CPU = torch.device("cpu")


def _pairs(micro_model, micro_data, n=6):
    tok = load_tokenizer(micro_model)
    recs = read_records(micro_data["preferences"])[:n]
    return tok, tokenize_preference_records(tok, recs, path="p", prompt_field="prompt", chosen_field="chosen",
                                            rejected_field="rejected", max_length=64)


def _grads(model):
    return {k: p.grad.detach().clone() for k, p in model.named_parameters() if p.grad is not None}


def _value_and_grads(model, fn, batch):
    model.zero_grad(set_to_none=True)
    out = fn(model, batch)
    weights = torch.linspace(0.5, 1.5, out.numel())  # every sequence's own gradient, not just their sum
    (out * weights).sum().backward()
    return out.detach(), _grads(model)


def _assert_same(a, b, rtol=1e-4, atol=1e-6):
    (va, ga), (vb, gb) = a, b
    assert torch.allclose(va, vb, rtol=rtol, atol=atol), (va, vb)
    assert ga.keys() == gb.keys() and ga
    for k in ga:
        assert torch.allclose(ga[k], gb[k], rtol=rtol, atol=atol), (k, (ga[k] - gb[k]).abs().max())


def test_packed_pair_logprobs_and_gradients_equal_padded(micro_model, micro_data):
    """6 pairs = 12 sequences in one row: each sequence's summed and mean response log-prob, and the
    gradient of a weighted sum of them, equal the padded batch's (rtol 1e-4; sdpa attention with the
    block-diagonal mask transformers builds from the position ids)."""
    tok, pairs = _pairs(micro_model, micro_data)
    model = load_causal_lm(micro_model, CPU)
    assert model.config._attn_implementation == "sdpa"
    padded, packed = collate_pairs(pairs, tok.pad_token_id), collate_pairs(pairs, tok.pad_token_id, packed=True)
    assert packed["input_ids"].shape[0] == 1 and int(packed["n_pairs"]) == 6
    for average in (False, True):
        fn = lambda m, b: response_logprobs(m, b, average=average)  # noqa: E731
        _assert_same(_value_and_grads(model, fn, padded), _value_and_grads(model, fn, packed))


def test_packed_rewards_and_gradients_equal_padded(micro_model, micro_data):
    """The reward head read at each packed sequence's last non-pad token gives the padded forward's
    score per sequence (transformers pools the rightmost non-pad token of each row), and the same
    gradients."""
    tok, pairs = _pairs(micro_model, micro_data)
    rm = load_reward_model(micro_model, CPU)
    padded, packed = collate_pairs(pairs, tok.pad_token_id), collate_pairs(pairs, tok.pad_token_id, packed=True)
    _assert_same(_value_and_grads(rm, pair_rewards, padded), _value_and_grads(rm, pair_rewards, packed))


def test_pair_tree_logprobs_and_gradients_equal_padded(micro_model, micro_data):
    """Pairs as prefix trees: each sequence's summed and mean response log-prob (a labelled token both answers
    share is scored once a side, the rejected answer's first own token from the shared prefix's last position),
    and the gradient of a weighted sum of them, equal the padded batch's."""
    tok, pairs = _pairs(micro_model, micro_data)
    model = load_causal_lm(micro_model, CPU)
    padded, tree = collate_pairs(pairs, tok.pad_token_id), collate_pair_tree(pairs, tok.pad_token_id)
    assert response_token_counts(tree).tolist() == response_token_counts(padded).tolist()
    for average in (False, True):
        fn = lambda m, b: response_logprobs(m, b, average=average)  # noqa: E731
        _assert_same(_value_and_grads(model, fn, padded), _value_and_grads(model, fn, tree))


def test_pair_tree_rewards_and_gradients_equal_padded(micro_model, micro_data):
    """Pairs as prefix trees (each pair's shared prompt once, both answers after it, several pairs to a row under
    a tree mask): each sequence's score and the gradient of a weighted sum of the scores equal the padded
    batch's, and the tree holds fewer tokens than the padded rows."""
    tok, pairs = _pairs(micro_model, micro_data)
    rm = load_reward_model(micro_model, CPU)
    padded, tree = collate_pairs(pairs, tok.pad_token_id), collate_pair_tree(pairs, tok.pad_token_id)
    assert tree["input_ids"].numel() < padded["input_ids"].numel()
    assert int(tree["n_tokens"]) == int(padded["attention_mask"].sum())
    _assert_same(_value_and_grads(rm, pair_rewards, padded), _value_and_grads(rm, pair_rewards, tree))


def test_packed_distillation_loss_and_gradients_equal_padded(micro_model, llama_chat_model, micro_data):
    """Student (qwen2) and teacher (llama) over the same packed row: the token-mean KL + NLL equals the
    padded batch's, and so do the student's gradients."""
    tok, pairs = _pairs(micro_model, micro_data)
    seqs = [c for c, _ in pairs]
    student, teacher = load_causal_lm(micro_model, CPU), load_causal_lm(llama_chat_model, CPU).eval()

    def loss(model, batch):
        inputs = {k: batch[k] for k in MODEL_INPUTS if k in batch}
        with torch.no_grad():
            t = teacher(**inputs, use_cache=False).logits
        s = model(**inputs, use_cache=False).logits
        return distillation_loss(s, t, batch["labels"], temperature=2.0, nll_weight=0.3).reshape(1)

    _assert_same(_value_and_grads(student, loss, collate_padded(seqs, tok.pad_token_id)),
                 _value_and_grads(student, loss, collate_packed(seqs)))


# --------------------------------------------------------------------------------------
# Trainers: padded == packed == packed under a token budget, 3 steps
# --------------------------------------------------------------------------------------

# 12 examples a step (6 x grad_accum 2); a budget of 40 tokens splits them into more micro-batches
# than 2, so the regrouping (and the normalisation over the whole step) is exercised.
STEP = dict(max_steps=3, batch_size=6, grad_accum=2, lr=3e-3, warmup_steps=0, num_threads=1, precision="fp32",
            log_every=1, save_every=0)
VARIANTS = {"padded": {}, "packed": {"packing": True}, "budget": {"packing": True, "micro_batch_tokens": 40}}


def _dpo(micro_model, micro_data, out, **kw):
    return DPOConfig(model_path=str(micro_model), train_file=str(micro_data["preferences"]),
                     eval_file=str(micro_data["eval"]), output_dir=str(out / "model"),
                     checkpoint_dir=str(out / "ckpt"), eval_items=2, beta=0.5, nll_weight=0.3, **STEP, **kw)


def _kto(micro_model, micro_data, out, **kw):
    return KTOConfig(model_path=str(micro_model), train_file=str(micro_data["preferences"]),
                     eval_file=str(micro_data["eval"]), output_dir=str(out / "model"),
                     checkpoint_dir=str(out / "ckpt"), eval_items=2, beta=0.5, **STEP, **kw)


def _reward(micro_model, micro_data, out, **kw):
    return RewardConfig(model_path=str(micro_model), train_file=str(micro_data["preferences"]), eval_file="",
                        output_dir=str(out / "model"), checkpoint_dir=str(out / "ckpt"), **STEP, **kw)


def _distill(micro_model, micro_data, out, teacher, **kw):
    return DistillConfig(model_path=str(micro_model), teacher_path=str(teacher), train_file=str(micro_data["sft"]),
                         eval_file=str(micro_data["eval"]), output_dir=str(out / "model"),
                         checkpoint_dir=str(out / "ckpt"), eval_items=2, temperature=2.0, nll_weight=0.3,
                         **STEP, **kw)


def _run(stage, micro_model, micro_data, teacher, out, **kw):
    sink = Recorder()
    if stage.startswith("dpo"):
        result = train_dpo(_dpo(micro_model, micro_data, out, precompute_reference=stage == "dpo", **kw), sink,
                           show_progress=False)
    elif stage == "kto":
        result = train_kto(_kto(micro_model, micro_data, out, **kw), sink, show_progress=False)
    elif stage == "reward":
        result = train_reward_model(_reward(micro_model, micro_data, out, **kw), sink, show_progress=False)
    else:
        result = train_distill(_distill(micro_model, micro_data, out, teacher, **kw), sink, show_progress=False)
    return sink, load_file(str(result.output_dir / "model.safetensors"))


def _relative_gap(a, b, start):
    """``||a - b|| / ||a - start||`` over the tensors all three hold (a reward model's new head is not in
    ``start``)."""
    keys = [k for k in a if k in start and a[k].shape == start[k].shape]
    diff = sum(float((a[k] - b[k]).double().pow(2).sum()) for k in keys)
    update = sum(float((a[k] - start[k]).double().pow(2).sum()) for k in keys)
    return (diff / update) ** 0.5


@pytest.mark.parametrize("stage", ["dpo", "dpo_live", "kto", "reward", "distill"])
def test_packed_training_equals_padded(stage, micro_model, llama_chat_model, micro_data, tmp_path):
    """Same examples per step, so padded, packed and packed-with-a-budget runs take the same steps:
    per-step loss and gradient norm within 1e-4 relative; the final weights differ by under 1e-3 of the
    3 steps' update (L2 over the weights both files hold). Not element-wise: Adam's first steps move each
    weight by about lr * g / |g|, so a weight whose gradient is near 0 turns float noise into a step.
    The budget run also reports (perf/micro_batches) that it ran more micro-batches than grad_accum."""
    start = load_file(str(micro_model / "model.safetensors"))
    runs = {name: _run(stage, micro_model, micro_data, llama_chat_model, tmp_path / name, **kw)
            for name, kw in VARIANTS.items()}
    (base, w0) = runs["padded"]
    for name in ("packed", "budget"):
        sink, w = runs[name]
        for metric in ("train/loss", "train/grad_norm"):
            a, b = base.series(metric), sink.series(metric)
            assert len(a) == len(b) == 3
            assert a == pytest.approx(b, rel=1e-4), (name, metric, a, b)
        gap = _relative_gap(w0, w, start)
        print(f"{stage} {name}: losses {sink.series('train/loss')}, weight gap to padded / update {gap:.1e}")
        assert gap <= 1e-3, (name, gap)
    assert base.series("train/loss")[0] != base.series("train/loss")[-1]  # the steps moved the model
    assert min(runs["budget"][0].series("perf/micro_batches")) > STEP["grad_accum"]
