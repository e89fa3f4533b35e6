"""Our static-cache rollout engine against HF generate: same greedy tokens, the log-prob contract,
groups, early stop, in-place weight updates, and the fallback for models it cannot run."""

from __future__ import annotations

import dataclasses
import logging

import pytest
import torch

from rlhf_core.config import RLConfig, build_config
from rlhf_core.models.loading import load_causal_lm, load_tokenizer
from rlhf_core.rollout.decode.attention import choose_row_kernel
from rlhf_core.rollout.decode.decoder import Decoder
from rlhf_core.rollout.decode.layer import attention_inputs, output_and_mlp
from rlhf_core.rollout.decode.sampling import Sampler, sample, sampling_weights
from rlhf_core.rollout.decode.settings import SETTINGS
from rlhf_core.rollout.engine import HFGenerateEngine, RolloutEngine, SamplingParams, response_mask_from_ids
from rlhf_core.rollout.static import StaticCacheEngine, supports
from rlhf_core.trainers.rl_parts import build_rollout_engine
from test_rollout_hf import forward_logprobs

PROMPTS = ["12+30=", "sort 321=", "7*8=", "sort 90817=", "1+1="]


def _eos_biased(path):
    """The micro model nudged to say eos (+3 on its logit, as a bias of the LM head) so rows end at different steps."""
    model = load_causal_lm(path, torch.device("cpu")).eval()
    tokenizer = load_tokenizer(path)
    head = torch.nn.Linear(model.lm_head.in_features, model.lm_head.out_features, bias=True)
    with torch.no_grad():
        head.weight.copy_(model.lm_head.weight)
        head.bias.zero_()
        head.bias[tokenizer.eos_token_id] = 3.0
    model.lm_head = head
    model.config.tie_word_embeddings = False
    return model, tokenizer


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_greedy_matches_hf_generate_token_for_token(arch, micro_model, llama_chat_model):
    model, tok = _eos_biased(micro_model if arch == "qwen2" else llama_chat_model)
    with torch.no_grad():  # greedy on an untrained model: +3 would make eos win every step
        model.lm_head.bias[tok.eos_token_id] = 0.5
    params = SamplingParams(n=2, temperature=0, max_new_tokens=10)
    # batch sizes that split the prompts differently: chunks of whole groups are stitched together
    ours = StaticCacheEngine(model, tok, batch_size=4).generate(PROMPTS, params)
    ref = HFGenerateEngine(model, tok, batch_size=64).generate(PROMPTS, params)
    assert isinstance(StaticCacheEngine(model, tok), RolloutEngine)
    assert torch.equal(ours.response_ids, ref.response_ids)
    assert torch.equal(ours.response_mask, ref.response_mask)
    assert torch.equal(ours.prompt_ids, ref.prompt_ids) and ours.completions == ref.completions
    torch.testing.assert_close(ours.sampling_logprobs, ref.sampling_logprobs, atol=1e-5, rtol=0)


@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, 0, 1.0), (0.7, 5, 0.9)])
def test_sampling_logprobs_are_the_trainers(temperature, top_k, top_p, micro_model):
    """log_softmax(logits / T) of every sampled token, before top-k/top-p: what the trainer recomputes."""
    model, tok = _eos_biased(micro_model)
    if top_k:  # with the +3 eos bias eos would be drawn nearly every time inside the top 5
        with torch.no_grad():
            model.lm_head.bias.zero_()
    engine = StaticCacheEngine(model, tok, batch_size=64)
    params = SamplingParams(n=4, temperature=temperature, top_k=top_k, top_p=top_p, max_new_tokens=12, seed=5)
    batch = engine.generate(PROMPTS, params)
    assert len(batch) == len(PROMPTS) * 4 and batch.prompts == [p for p in PROMPTS for _ in range(4)]
    torch.testing.assert_close(batch.sampling_logprobs, forward_logprobs(model, batch, temperature), atol=2e-5, rtol=0)
    assert (batch.sampling_logprobs[batch.response_mask == 0] == 0).all()
    lengths = batch.response_lengths()
    if not top_k:
        assert (lengths < 12).any() and (lengths > 1).any()  # rows stop at their own eos
    eos, pad = tok.eos_token_id, tok.pad_token_id
    for row, n in zip(batch.response_ids, batch.response_lengths().tolist()):
        assert (row[:n - 1] != eos).all() and (row[n:] == pad).all()
    if top_k:  # every sampled token is inside the top k of its step
        ranks = []
        ids, mask = batch.sequences()
        with torch.no_grad():
            logits = model(input_ids=ids, attention_mask=mask, position_ids=batch.position_ids()).logits
        p = batch.prompt_ids.shape[1]
        for r in range(len(batch)):
            for t in range(int(batch.response_lengths()[r])):
                step = logits[r, p - 1 + t]
                ranks.append(int((step > step[batch.response_ids[r, t]]).sum()))
        assert max(ranks) < top_k
    # seeded: the same call gives the same samples; another seed other samples
    again = engine.generate(PROMPTS, params)
    assert torch.equal(again.response_ids, batch.response_ids)
    other = engine.generate(PROMPTS, SamplingParams(n=4, temperature=temperature, top_k=top_k, top_p=top_p,
                                                    max_new_tokens=12, seed=6))
    assert not torch.equal(other.response_ids, batch.response_ids) or other.response_ids.shape != batch.response_ids.shape


def test_samples_follow_the_model_distribution(micro_model):
    """First tokens of 4000 samples of one prompt: frequencies within 3 sigma of softmax(logits)."""
    model = load_causal_lm(micro_model, torch.device("cpu")).eval()
    tok = load_tokenizer(micro_model)
    batch = StaticCacheEngine(model, tok, batch_size=4000).generate(
        ["7*8="], SamplingParams(n=4000, temperature=1.0, max_new_tokens=1, seed=0))
    ids = torch.tensor([tok("7*8=", add_special_tokens=False)["input_ids"]])
    with torch.no_grad():
        probs = model(input_ids=ids).logits[0, -1].float().softmax(-1)
    counts = torch.bincount(batch.response_ids[:, 0], minlength=probs.numel()).float()
    expected = probs * 4000
    sigma = (4000 * probs * (1 - probs)).sqrt()
    assert ((counts - expected).abs() <= 3 * sigma + 1).all()


def test_update_weights_in_place_and_the_trainers_model(micro_model):
    model, tok = load_causal_lm(micro_model, torch.device("cpu")).eval(), load_tokenizer(micro_model)
    engine = StaticCacheEngine(model, tok)
    params = SamplingParams(n=1, temperature=0, max_new_tokens=6)
    before = engine.generate(PROMPTS, params)
    other = load_causal_lm(micro_model, torch.device("cpu"))
    with torch.no_grad():
        for p in other.parameters():
            p.add_(torch.randn_like(p) * 0.5)
    engine.update_weights(other.state_dict())
    after = engine.generate(PROMPTS, params)
    assert engine.model is model  # the weights moved into the same model object
    assert not torch.equal(before.sampling_logprobs, after.sampling_logprobs)
    ref = HFGenerateEngine(other, tok).generate(PROMPTS, params)
    assert torch.equal(after.response_ids, ref.response_ids)


def test_rl_config_picks_it_and_falls_back_for_models_it_cannot_run(micro_model, micro_data, tmp_path, caplog):
    cfg = build_config(RLConfig, "rl", {"model_path": str(micro_model), "prompts_file": str(micro_data["prompts"]),
                                        "rollout.engine": "static", "output_dir": str(tmp_path / "o"),
                                        "checkpoint_dir": str(tmp_path / "c")})
    model, tok = load_causal_lm(micro_model, torch.device("cpu")), load_tokenizer(micro_model)
    assert build_rollout_engine(cfg, model, tok).name == "static"
    from rlhf_core.models.loading import prepare_for_training

    lora = prepare_for_training(load_causal_lm(micro_model, torch.device("cpu")), lora_rank=4)
    assert build_rollout_engine(cfg, lora, tok).name == "static"  # a LoRA policy too (it once fell back)
    from transformers import GPT2Config, GPT2LMHeadModel

    gpt2 = GPT2LMHeadModel(GPT2Config(vocab_size=len(tok), n_embd=16, n_layer=1, n_head=2, n_positions=64))
    assert "model_type 'gpt2'" in supports(gpt2)
    with caplog.at_level(logging.WARNING):
        assert build_rollout_engine(cfg, gpt2, tok).name == "hf"
    assert "rollout_engine static cannot run this policy (model_type 'gpt2'" in caplog.text
    with pytest.raises(ValueError, match="cannot run this model: model_type 'gpt2'"):
        StaticCacheEngine(gpt2, tok)


def test_decode_over_the_filled_prefix_equals_the_whole_cache(micro_model, monkeypatch):
    """A decode step that attends over cache columns 0 .. width-1 (what each width-bucketed CUDA graph
    runs) gives the whole-cache step's logits for any width past the current column; the buckets cover
    every step and end at the full width."""
    from rlhf_core.data.tokenize import encode_prompt
    from rlhf_core.rollout.engine import _left_pad

    bucket = 32
    model, tok = _eos_biased(micro_model)
    ids, mask = _left_pad([encode_prompt(tok, p) for p in PROMPTS], tok.pad_token_id)
    R = 3 * bucket + 5
    with torch.no_grad():
        decoder = Decoder(model, ids, mask, max_new_tokens=R, n=2)
        logits = decoder.prefill()
        P = ids.shape[1]
        for t in range(40):
            decoder.token.copy_(logits.argmax(-1))
            decoder._advance()
            decoder.step_index += 1
            col = P - 1 + decoder.step_index
            full = decoder._step()
            for width in (col + 1, col + 7, decoder.shape.width):
                torch.testing.assert_close(decoder._step(width), full, atol=1e-5, rtol=0)
            logits = full
    assert decoder.width_buckets() == [P + R]  # the default: one graph over the whole cache
    monkeypatch.setattr(SETTINGS, "width_bucket", bucket)
    buckets = decoder.width_buckets()
    assert buckets[-1] == P + R and buckets[0] == P + bucket
    assert all(b - a <= bucket for a, b in zip(buckets, buckets[1:]))


@pytest.mark.parametrize("temperature,top_k,top_p,stop", [(1.0, 0, 1.0, False), (0.7, 5, 0.9, True), (0, 0, 1.0, False)])
def test_captured_iteration_equals_the_stepwise_loop(temperature, top_k, top_p, stop, micro_model, monkeypatch):
    """The body a CUDA graph captures (decode, sample with given uniforms, record, eos bookkeeping;
    ``_decode_in_graphs``) run eagerly here, one iteration per replay, gives the stepwise loop's tokens,
    log-probs and stop step exactly: on a CPU one draw of every step's uniforms equals the per-step draws,
    so both see the same numbers. Rows finish at different steps (eos-biased model; a stop token too). The
    stepwise loop keeps its whole batch here (finished rows are not dropped), as the captured one does."""
    from rlhf_core.data.tokenize import encode_prompt
    from rlhf_core.rollout.engine import _left_pad
    from rlhf_core.rollout.static import _decode_eagerly, _decode_in_graphs

    monkeypatch.setattr(SETTINGS, "compact_below", 0.0)
    model, tok = _eos_biased(micro_model)
    ids, mask = _left_pad([encode_prompt(tok, p) for p in PROMPTS], tok.pad_token_id)
    R = 24
    stops = (tok.convert_tokens_to_ids("1"),) if stop else ()
    params = SamplingParams(n=3, temperature=temperature, top_k=top_k, top_p=top_p, max_new_tokens=R,
                            stop_token_ids=stops)
    runs = []
    for path in ("stepwise", "captured body"):
        with torch.no_grad():
            decoder = Decoder(model, ids, mask, max_new_tokens=R, n=3)
            sampler = Sampler(params, ids.shape[0] * 3, R, tok.eos_token_id, tok.pad_token_id, torch.device("cpu"))
            generator = torch.Generator().manual_seed(11)
            logits = decoder.prefill()
            if path == "stepwise":
                steps = _decode_eagerly(decoder, logits, sampler, generator)
            else:
                def replay():  # what graph.replay() runs
                    decoder.step_index += 1
                    decoder._iteration(sampler, decoder.shape.width)
                decoder.replay = replay
                steps = _decode_in_graphs(decoder, logits, sampler, generator)
        runs.append((steps, sampler.out_ids[:, :steps], sampler.out_logp[:, :steps], sampler.finished))
    (s0, ids0, lp0, f0), (s1, ids1, lp1, f1) = runs
    assert s0 == s1 and torch.equal(ids0, ids1) and torch.equal(f0, f1)
    torch.testing.assert_close(lp0, lp1, atol=0, rtol=0)
    ended = (ids0 == tok.eos_token_id).any(-1)
    assert 0 < int(ended.sum()) and (s0 < R or not bool(f0.all()))  # rows ended at different steps


@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, 0, 1.0), (1.0, 5, 0.9)])
def test_dropping_finished_rows_keeps_every_sample(temperature, top_k, top_p, micro_model, monkeypatch):
    """The eager decode drops finished rows from its batch (``SETTINGS.compact_below``): the same tokens and stop step
    as the whole batch to the end (never dropping), the response log-probs to an ulp (a smaller batch's GEMMs may
    round differently), and the batch did shrink (rows of the eos-biased model end at different steps)."""
    from rlhf_core.data.tokenize import encode_prompt
    from rlhf_core.rollout.engine import _left_pad
    from rlhf_core.rollout.static import _decode_eagerly

    model, tok = _eos_biased(micro_model)
    ids, mask = _left_pad([encode_prompt(tok, p) for p in PROMPTS], tok.pad_token_id)
    R, n = 24, 4
    params = SamplingParams(n=n, temperature=temperature, top_k=top_k, top_p=top_p, max_new_tokens=R)
    runs = []
    for share in (0.0, 0.75):  # 0: never drop (kept <= 0 rows only once all have finished)
        monkeypatch.setattr(SETTINGS, "compact_below", share)
        with torch.no_grad():
            decoder = Decoder(model, ids, mask, max_new_tokens=R, n=n)
            sampler = Sampler(params, ids.shape[0] * n, R, tok.eos_token_id, tok.pad_token_id, torch.device("cpu"))
            steps = _decode_eagerly(decoder, decoder.prefill(), sampler, torch.Generator().manual_seed(5))
        kept = response_mask_from_ids(sampler.out_ids[:, :steps], tok.eos_token_id, ()).bool()
        runs.append((steps, sampler.out_ids[:, :steps], sampler.out_logp[:, :steps][kept], decoder.shape.rows))
    (s0, ids0, lp0, rows0), (s1, ids1, lp1, rows1) = runs
    assert s0 == s1 and torch.equal(ids0, ids1)
    torch.testing.assert_close(lp0, lp1, atol=1e-6, rtol=0)
    assert rows0 == len(PROMPTS) * n and rows1 < rows0 / 2  # the second run's batch shrank


# test_the_triton_sampler_decodes_as_torchs's child: the eos-biased micro model (argv[1]) with each sampler
_SAMPLER_CHILD = """
import json, sys, torch
from rlhf_core.models.loading import load_causal_lm, load_tokenizer
from rlhf_core.rollout.decode.settings import SETTINGS
from rlhf_core.rollout.engine import SamplingParams
from rlhf_core.rollout.static import StaticCacheEngine
model, tok = load_causal_lm(sys.argv[1], torch.device("cpu")).eval(), load_tokenizer(sys.argv[1])
head = torch.nn.Linear(model.lm_head.in_features, model.lm_head.out_features, bias=True)
with torch.no_grad():
    head.weight.copy_(model.lm_head.weight)
    head.bias.zero_()
    head.bias[tok.eos_token_id] = 3.0
model.lm_head, model.config.tie_word_embeddings = head, False
out = {}
for sampler in ("torch", "triton"):
    SETTINGS.sampler = sampler
    engine = StaticCacheEngine(model, tok, batch_size=8)
    batch = engine.generate(json.loads(sys.argv[2]), SamplingParams(n=4, temperature=0.8, max_new_tokens=16, seed=3))
    out[sampler] = {"ids": batch.response_ids.tolist(), "logp": batch.sampling_logprobs.tolist(),
                    "lengths": batch.response_lengths().tolist(), "used": engine._kept[1].sampler}
print(json.dumps(out))
"""


def test_the_triton_sampler_decodes_as_torchs(micro_model):
    """The engine's eager decode (the CPU's) with ``SETTINGS.sampler`` triton, its kernel run by Triton's interpreter
    (a child process: Triton reads ``TRITON_INTERPRET`` on its first import), gives torch's tokens and their log-probs
    to 1e-5, rows ending at different steps (the batch shrinks as they finish: the kernel samples the live rows)."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    pytest.importorskip("triton")
    root = str(Path(__file__).resolve().parents[2])
    env = {**os.environ, "TRITON_INTERPRET": "1",
           "PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")])}
    res = subprocess.run([sys.executable, "-c", _SAMPLER_CHILD, str(micro_model), json.dumps(PROMPTS)], check=False,
                         env=env, capture_output=True, text=True, timeout=300, cwd=root)
    assert res.returncode == 0, res.stderr[-3000:]
    runs = json.loads(res.stdout.strip().splitlines()[-1])
    ours, ref = runs["triton"], runs["torch"]
    assert (ours["used"], ref["used"]) == ("triton", "torch")
    assert ours["ids"] == ref["ids"] and len(set(ref["lengths"])) > 1
    torch.testing.assert_close(torch.tensor(ours["logp"]), torch.tensor(ref["logp"]), atol=1e-5, rtol=0)


def _engine_with_broken(micro_model, monkeypatch, module, kernel: str):
    """A static engine over the eos-biased micro model, ``module.kernel`` raising as a Triton build failure does,
    and the test prompts left-padded: ``(model, tok, engine, ids, mask)``."""
    from rlhf_core.data.tokenize import encode_prompt
    from rlhf_core.rollout.engine import _left_pad

    def broken(*args, **kwargs):
        raise RuntimeError("PassManager::run failed")

    monkeypatch.setattr(module, kernel, broken)
    model, tok = _eos_biased(micro_model)
    ids, mask = _left_pad([encode_prompt(tok, p) for p in PROMPTS], tok.pad_token_id)
    return model, tok, StaticCacheEngine(model, tok, batch_size=8), ids, mask


def test_auto_falls_back_to_torch_sampling_where_the_triton_sampler_fails(micro_model, monkeypatch, caplog):
    """Under auto a Triton sampler that fails to build is tried once, eagerly, on the prefill's logits before any
    capture; the engine then samples with torch, in that call and after."""
    from rlhf_core.models import fused_sampling
    from rlhf_core.rollout.decode.sampling import choose_sampler, sampling_function

    model, tok, engine, ids, mask = _engine_with_broken(micro_model, monkeypatch, fused_sampling, "fused_sample")
    params = SamplingParams(n=2, max_new_tokens=4)
    decoder = Decoder(model, ids, mask, max_new_tokens=4, n=2, triton_sampler=engine.triton_sampler)
    decoder.sampler, decoder.sample = "triton", sampling_function("triton", False)  # auto's pick on a CUDA device
    sampler = Sampler(params, ids.shape[0] * 2, 4, tok.eos_token_id, tok.pad_token_id, torch.device("cpu"))
    monkeypatch.setattr(SETTINGS, "sampler", "auto")
    with torch.no_grad(), caplog.at_level(logging.WARNING, logger="rlhf_core.rollout.static"):
        engine._check_sampler(decoder, sampler, decoder.prefill())
    assert decoder.sampler == "torch" and decoder.sample is sample and engine.triton_sampler is False
    assert "Triton sampler failed (PassManager::run failed)" in caplog.text
    monkeypatch.setattr(fused_sampling, "available", lambda: True)
    assert choose_sampler(torch.device("cuda"), triton=engine.triton_sampler) == "torch"


def _assert_steps_equal(decoder, masked, steps: int) -> None:
    """``decoder``'s prefill and ``steps`` greedy decode steps give ``masked``'s logits (to 1e-5), fed the same
    tokens."""
    logits = masked.prefill()
    torch.testing.assert_close(decoder.prefill(), logits, atol=1e-5, rtol=0)
    for _ in range(steps):
        token = logits.argmax(-1)
        expected = masked.step(token)
        torch.testing.assert_close(decoder.step(token), expected, atol=1e-5, rtol=0)
        logits = expected


@pytest.mark.parametrize("fused,grouped", [(True, True), (True, False), (False, True)])
def test_flash_layout_steps_equal_the_masked_cache(fused, grouped, micro_model, monkeypatch):
    """The flash layout's bookkeeping (cache ``(B, W, H_kv, D)``, each row's keys from its first prompt token,
    a count of used keys advanced in place, no mask; grouped: each KV head's query heads folded into query
    rows, with Q's heads and o_proj's columns reordered in the fused weights, or regrouped around the call
    with the model's own modules) gives the masked whole-cache step's logits at every step. On a CPU its attention is the
    reference inside ``flash_layout_attention`` (the same keys through SDPA); the flash kernel itself is checked on
    a GPU by bench/gpu_engine.py (greedy tokens against HF generate, log-probs against the trainer's)."""
    from rlhf_core.data.tokenize import encode_prompt
    from rlhf_core.rollout.engine import _left_pad

    model, tok = _eos_biased(micro_model)
    ids, mask = _left_pad([encode_prompt(tok, p) for p in PROMPTS], tok.pad_token_id)
    assert len(set(mask.sum(-1).tolist())) > 1  # rows start at different columns
    if not fused:
        monkeypatch.setattr(Decoder, "_fuse_weights", lambda self: None)
    monkeypatch.setattr(SETTINGS, "flash_grouped", grouped)
    decoders = {}
    with torch.no_grad():
        for choice in ("sdpa", "flash"):
            monkeypatch.setattr(SETTINGS, "attention", choice)
            decoders[choice] = Decoder(model, ids, mask, max_new_tokens=20, n=2)
        masked, flash = decoders["sdpa"], decoders["flash"]
        assert flash.flash and not masked.flash and (flash.fused is not None) == fused
        assert flash.grouped == grouped and flash.heads_regrouped == (grouped and fused)
        assert masked.shape.heads > masked.shape.kv_heads  # the micro model has grouped-query attention
        assert flash.k[0].shape == (masked.shape.rows, masked.shape.width, masked.shape.kv_heads, masked.shape.head_dim)
        _assert_steps_equal(flash, masked, 19)
        assert torch.equal(flash.used, (mask.sum(-1) + 19).repeat_interleave(2).int())


@pytest.mark.parametrize("grouped", [True, False])
def test_the_triton_row_kernel_takes_the_flash_layout_arguments(grouped, micro_model, monkeypatch):
    """``SETTINGS.attention = "triton"``: the decoder hands the Triton kernel the flash layout's tensors (the
    rows' queries, the caches end to end, ``cu_k``, the used counts), and through the kernel's contract
    (``decode_attention_reference``, standing in for the kernel, which needs a GPU or Triton's interpreter:
    tests/unit/test_decode_attention.py runs it against that contract) every step's logits equal the masked
    cache's."""
    from rlhf_core.models import decode_attention as da
    from rlhf_core.data.tokenize import encode_prompt
    from rlhf_core.rollout.engine import _left_pad

    calls = []

    def contract(q, k, v, cu_k, used, scale):
        calls.append(tuple(q.shape))
        return da.decode_attention_reference(q, k, v, cu_k, used, k.shape[0] // (cu_k.shape[0] - 1), scale)

    monkeypatch.setattr(da, "decode_attention", contract)
    monkeypatch.setattr(da, "available", lambda: True)  # the kernel's stand-in runs anywhere
    monkeypatch.setattr(SETTINGS, "flash_grouped", grouped)
    model, tok = _eos_biased(micro_model)
    ids, mask = _left_pad([encode_prompt(tok, p) for p in PROMPTS], tok.pad_token_id)
    with torch.no_grad():
        monkeypatch.setattr(SETTINGS, "attention", "sdpa")
        masked = Decoder(model, ids, mask, max_new_tokens=12, n=2)
        monkeypatch.setattr(SETTINGS, "attention", "triton")
        rows = Decoder(model, ids, mask, max_new_tokens=12, n=2)
        assert rows.flash and rows.row_kernel == "triton"
        _assert_steps_equal(rows, masked, 11)
    s = masked.shape
    G = s.heads // s.kv_heads
    assert len(calls) == 11 * len(masked.layers)
    assert calls[0] == ((s.rows * G, s.kv_heads, s.head_dim) if grouped else (s.rows, s.heads, s.head_dim))


def test_asking_for_the_triton_kernel_where_it_cannot_run_says_so(micro_model, monkeypatch):
    from rlhf_core.models import decode_attention as da

    monkeypatch.setattr(da, "available", lambda: False)
    monkeypatch.setattr(SETTINGS, "attention", "triton")
    with pytest.raises(ValueError, match="the decode attention triton needs Triton and a CUDA device"):
        choose_row_kernel(torch.device("cpu"), 16)


@pytest.mark.parametrize("capability,head_dim,triton_here,expected", [
    ((9, 0), 64, True, "triton"), ((9, 0), 128, True, "triton"), ((8, 0), 64, True, "flash"),
    ((10, 0), 64, True, "flash"), ((9, 0), 80, True, "flash"), ((9, 0), 64, False, "flash")])
def test_auto_takes_the_triton_kernel_on_hopper_only(capability, head_dim, triton_here, expected, monkeypatch):
    """Auto's kernel of the row layout: Triton where it was measured (Hopper), with Triton importable and a power-of-
    two head size; torch's flash op otherwise."""
    from rlhf_core.models import decode_attention as da

    monkeypatch.setattr(SETTINGS, "attention", "auto")
    monkeypatch.setattr(da, "available", lambda: triton_here)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    assert choose_row_kernel(torch.device("cuda"), head_dim) == expected
    assert choose_row_kernel(torch.device("cpu"), head_dim) == "flash"


def test_auto_falls_back_to_torch_flash_where_the_triton_kernel_fails(micro_model, monkeypatch, caplog):
    """Under auto a Triton kernel that fails to build (a Triton or driver it does not build on) is tried once,
    eagerly, before any capture; the engine then decodes through torch's flash kernel, in that call and after."""
    from rlhf_core.models import decode_attention as da

    model, tok, engine, ids, mask = _engine_with_broken(micro_model, monkeypatch, da, "decode_attention")
    monkeypatch.setattr(SETTINGS, "attention", "flash")
    decoder = Decoder(model, ids, mask, max_new_tokens=4, n=2, triton=engine.triton_attention)
    decoder.row_kernel = "triton"  # what auto picks on a CUDA device with Triton
    monkeypatch.setattr(SETTINGS, "attention", "auto")
    with caplog.at_level(logging.WARNING, logger="rlhf_core.rollout.static"):
        engine._check_row_kernel(decoder)
    assert decoder.row_kernel == "flash" and engine.triton_attention is False
    assert "Triton decode attention failed (PassManager::run failed)" in caplog.text
    assert choose_row_kernel(torch.device("cuda"), 64, triton=engine.triton_attention) == "flash"
    with torch.no_grad():
        decoder.prefill()
        decoder.step(torch.zeros(decoder.shape.rows, dtype=torch.long))  # decodes through the flash path


@pytest.mark.parametrize("attention", ["sdpa", "flash"])
def test_compiled_layer_halves_trace_whole_and_equal_the_plain_ones(attention, micro_model, monkeypatch):
    """Both halves a GPU compiles trace into one graph each (``fullgraph``: no break, so inductor sees the
    whole chain), and the traced graphs give the plain functions' values exactly (``aot_eager``: the traced
    aten graph run eagerly; inductor's fused kernels are checked on a GPU by bench/gpu_engine.py)."""
    from rlhf_core.data.tokenize import encode_prompt
    from rlhf_core.rollout.engine import _left_pad

    monkeypatch.setattr(SETTINGS, "attention", attention)
    model, tok = _eos_biased(micro_model)
    ids, mask = _left_pad([encode_prompt(tok, p) for p in PROMPTS], tok.pad_token_id)
    traced = tuple(torch.compile(fn, backend="aot_eager", fullgraph=True)
                   for fn in (attention_inputs, output_and_mlp))
    runs = []
    with torch.no_grad():
        for halves in ((attention_inputs, output_and_mlp), traced):
            decoder = Decoder(model, ids, mask, max_new_tokens=6, n=2)
            decoder.halves = halves
            logits = [decoder.prefill()]
            for _ in range(5):
                logits.append(decoder.step(logits[-1].argmax(-1)))
            runs.append(torch.stack(logits))
    assert torch.equal(runs[0], runs[1])


def test_biased_projections_decode_as_the_model(llama_chat_model, micro_tokenizer):
    """Llama with ``attention_bias`` and ``mlp_bias``: the fused Q/K/V and gate/up GEMMs carry the biases
    (the gate/up biases were once dropped), so greedy tokens and log-probs match HF generate."""
    from transformers import LlamaForCausalLM

    base = load_causal_lm(llama_chat_model, torch.device("cpu"))
    cfg = base.config
    cfg.attention_bias, cfg.mlp_bias = True, True
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).eval()
    model.load_state_dict(base.state_dict(), strict=False)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(".bias"):
                p.normal_(0, 0.5)
    tok = load_tokenizer(llama_chat_model)
    params = SamplingParams(n=2, temperature=0, max_new_tokens=10)
    ours = StaticCacheEngine(model, tok, batch_size=64).generate(PROMPTS, params)
    ref = HFGenerateEngine(model, tok, batch_size=64).generate(PROMPTS, params)
    assert all(b is not None for b in (model.model.layers[0].mlp.gate_proj.bias, model.model.layers[0].self_attn.q_proj.bias))
    assert torch.equal(ours.response_ids, ref.response_ids)
    torch.testing.assert_close(ours.sampling_logprobs, ref.sampling_logprobs, atol=1e-5, rtol=0)


@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, 0, 1.0), (0.8, 5, 1.0), (0.7, 5, 0.9), (0, 0, 1.0)])
def test_compiled_sampler_traces_whole_and_equals_the_plain_one(temperature, top_k, top_p):
    """Sampling as a GPU compiles it (its weights ``fullgraph``; ``aot_eager`` here) draws the plain function's
    tokens and log-probs from the same logits and uniforms (top-p takes the plain weights)."""
    import functools

    torch.manual_seed(0)
    logits, uniform = torch.randn(12, 50) * 3, torch.rand(12, 1)
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p)
    traced = functools.partial(sample, weights_fn=torch.compile(sampling_weights, backend="aot_eager",
                                                                 fullgraph=True))
    token, logp = sample(logits, params, uniform=uniform)
    token_c, logp_c = traced(logits, params, uniform=uniform)
    assert torch.equal(token, token_c) and torch.equal(logp, logp_c)


@pytest.mark.parametrize("fused", [True, False])
def test_a_lora_policy_decodes_through_its_adapters(fused, micro_model, monkeypatch):
    """A policy with peft LoRA adapters (as the RL trainer injects them) runs on this engine: the fused
    projections carry the merged ``W + s B A`` (the model's own modules otherwise), so greedy tokens and
    log-probs match HF generate through the adapters, and with the adapters switched off (the policy's base,
    a LoRA run's reference) match it there too. DoRA is refused with the reason."""
    from peft import LoraConfig, get_peft_model

    from rlhf_core.models.loading import adapters_off, prepare_for_training

    if not fused:
        monkeypatch.setattr(Decoder, "_fuse_weights", lambda self: None)
    model = prepare_for_training(load_causal_lm(micro_model, torch.device("cpu")), lora_rank=4, lora_alpha=8.0).eval()
    torch.manual_seed(0)
    with torch.no_grad():  # peft starts B at zero: move it, so the adapters change the outputs
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.3)
    tok = load_tokenizer(micro_model)
    assert supports(model) is None
    params = SamplingParams(n=2, temperature=0, max_new_tokens=10)
    ours = StaticCacheEngine(model, tok, batch_size=64).generate(PROMPTS, params)
    ref = HFGenerateEngine(model, tok, batch_size=64).generate(PROMPTS, params)
    assert torch.equal(ours.response_ids, ref.response_ids)
    torch.testing.assert_close(ours.sampling_logprobs, ref.sampling_logprobs, atol=1e-5, rtol=0)
    with adapters_off(model):
        base = StaticCacheEngine(model, tok, batch_size=64).generate(PROMPTS, params)
        base_ref = HFGenerateEngine(model, tok, batch_size=64).generate(PROMPTS, params)
    assert torch.equal(base.response_ids, base_ref.response_ids)
    torch.testing.assert_close(base.sampling_logprobs, base_ref.sampling_logprobs, atol=1e-5, rtol=0)
    assert not torch.equal(base.sampling_logprobs, ours.sampling_logprobs)

    dora = get_peft_model(load_causal_lm(micro_model, torch.device("cpu")),
                          LoraConfig(r=4, target_modules=["q_proj"], use_dora=True))
    assert "use_dora" in supports(dora.get_base_model())


@pytest.mark.parametrize("lora", [False, True])
def test_a_kept_decoder_samples_as_a_fresh_engine_after_a_weight_update(lora, micro_model, monkeypatch):
    """The engine keeps its decoder (cache, fused weight copies; on a GPU the captured graphs) from one generate
    call to the next of the same shape: after ``update_weights`` (and, for a LoRA policy, its adapters moved in
    place as an optimizer step moves them, with no sync at all) the second call's tokens and log-probs are
    bit-identical to a freshly built engine's with the new weights and the same seed, and the decoder was kept.
    A call of another shape builds a new one; with ``keep_decoder`` off none is kept."""
    monkeypatch.setattr(SETTINGS, "compact_below", 0.0)  # a shrunk eager batch is not kept; keep this one whole
    model, tok = _eos_biased(micro_model)
    with torch.no_grad():
        model.lm_head.bias[tok.eos_token_id] = 0.5  # rows still end at different steps
    if lora:
        from rlhf_core.models.loading import prepare_for_training

        model = prepare_for_training(model, lora_rank=4, lora_alpha=8.0).eval()
    params = SamplingParams(n=3, temperature=0.9, top_p=0.95, max_new_tokens=10, seed=7)
    engine = StaticCacheEngine(model, tok, batch_size=64)
    first = engine.generate(PROMPTS, params)
    kept = engine._kept[1]
    assert kept.fused is not None  # the fused copies are what a weight update must reach
    torch.manual_seed(1)
    with torch.no_grad():
        if lora:  # in place, as the optimizer moves them: the engine holds the trainer's own model
            for name, p in model.named_parameters():
                if "lora_" in name:
                    p.add_(torch.randn_like(p) * 0.3)
        else:
            moved = {k: v + torch.randn_like(v) * 0.05 for k, v in model.state_dict().items()}
            engine.update_weights(moved)
    second = engine.generate(PROMPTS, dataclasses.replace(params, seed=8))
    assert engine._kept[1] is kept  # the same decoder, reset and refreshed
    fresh = StaticCacheEngine(model, tok, batch_size=64).generate(PROMPTS, dataclasses.replace(params, seed=8))
    for name in ("response_ids", "response_mask", "sampling_logprobs", "prompt_ids"):
        assert torch.equal(getattr(second, name), getattr(fresh, name)), name
    assert second.completions == fresh.completions
    assert not torch.equal(first.sampling_logprobs[:, :4], second.sampling_logprobs[:, :4])
    lengths = second.response_lengths()
    assert (lengths < 10).any() and (lengths > 1).any()  # rows ended at different steps
    engine.generate(PROMPTS[:2], params)  # another prompt shape: a new decoder
    assert engine._kept[1] is not kept
    monkeypatch.setattr(SETTINGS, "keep_decoder", False)
    again = engine.generate(PROMPTS, dataclasses.replace(params, seed=8))
    assert engine._kept is None and torch.equal(again.sampling_logprobs, fresh.sampling_logprobs)
