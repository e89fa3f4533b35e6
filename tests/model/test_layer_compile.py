"""Compiled decoder layers (``compile_layers``, :mod:`rlhf_core.models.layer_compile`) against the eager layers.

The compile runs through dynamo and AOTAutograd with the ``aot_eager`` backend: the same traced forward and
backward graphs inductor would get, run by eager kernels, so the comparison is exact and no C++ is built per
graph on this 2-core CPU. Inductor's own kernels on a GPU: ``bench/gpu_lm_head_check.py --parts compiled``
(``bench/results/h200/2026-11-29/gpu_layer_compile_check_h200.json``: bf16 against fp32 at the same error as the eager layers).
"""

from __future__ import annotations

import logging

import pytest
import torch
from torch._dynamo.utils import counters

from conftest import Recorder
from rlhf_core.models import layer_compile
from rlhf_core.config import SFTConfig
from rlhf_core.data.io import read_records
from rlhf_core.data.sequences import tokenize_preference_records
from rlhf_core.data.tokenize import collate_pairs
from rlhf_core.models.lm_head import prepare_decoder_kernels
from rlhf_core.algorithms.logprobs import response_logprobs
from rlhf_core.models.loading import enable_checkpointing, load_causal_lm, load_tokenizer
from rlhf_core.trainers.sft import train_sft

CPU = torch.device("cpu")


@pytest.fixture()
def aot_eager(monkeypatch):
    """The backend to compile with (dynamo + AOTAutograd, eager kernels: ``compile_backend: aot_eager``); a fresh
    compile cache before and after."""
    monkeypatch.setattr(layer_compile, "_COMPILED", {})
    torch._dynamo.reset()
    yield "aot_eager"
    torch._dynamo.reset()


def _pairs(model_dir, micro_data, n=6):
    tok = load_tokenizer(model_dir)
    recs = read_records(micro_data["preferences"])[:n]
    pairs = tokenize_preference_records(tok, recs, path="p", prompt_field="prompt", chosen_field="chosen",
                                        rejected_field="rejected", max_length=64)
    return tok, pairs


def _sums_and_grads(model, batch, weights):
    model.zero_grad(set_to_none=True)
    sums = response_logprobs(model, batch, average=False)
    (sums * weights).sum().backward()
    return sums.detach(), {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_compiled_layers_equal_eager(aot_eager, micro_model, llama_chat_model, micro_data, arch):
    """Per-sequence response log-prob sums and every parameter's gradient under a non-uniform upstream
    weight: padded rows (a mask inside the graph), packed rows and padded rows with gradient checkpointing,
    compiled equal to eager (exactly: the same kernels run the traced graphs). One graph serves every layer
    and every length: after the first few batches (a graph with a mask and one without; a Llama's packed rows
    carry a mask, and its batch size turns symbolic at the first recompile) new lengths and row counts compile
    nothing more."""
    model_dir = micro_model if arch == "qwen2" else llama_chat_model
    tok, pairs = _pairs(model_dir, micro_data)
    eager, compiled = load_causal_lm(model_dir, CPU), load_causal_lm(model_dir, CPU)
    assert layer_compile.compile_decoder_layers(compiled, aot_eager) == compiled.config.num_hidden_layers
    weights = torch.linspace(-1.5, 2.0, 2 * len(pairs))
    graphs = counters["stats"]["unique_graphs"]
    for i, (packed, n) in enumerate(((False, 6), (True, 6), (False, 4), (True, 3), (False, 5), (True, 5), (False, 2))):
        if i == 4:
            assert 2 <= counters["stats"]["unique_graphs"] - graphs <= 3
            graphs = counters["stats"]["unique_graphs"]
        batch = collate_pairs(pairs[:n], tok.pad_token_id, packed=packed)
        (a, ga), (b, gb) = (_sums_and_grads(m, batch, weights[:2 * n]) for m in (eager, compiled))
        assert torch.equal(a, b), (packed, n, a, b)
        assert ga.keys() == gb.keys() and ga
        for k in ga:
            assert torch.equal(ga[k], gb[k]), (packed, n, k, (ga[k] - gb[k]).abs().max())
    assert counters["stats"]["unique_graphs"] == graphs  # new lengths and row counts: no compile
    enable_checkpointing(eager)
    enable_checkpointing(compiled)
    batch = collate_pairs(pairs, tok.pad_token_id)
    (a, ga), (b, gb) = (_sums_and_grads(m, batch, weights) for m in (eager, compiled))
    assert torch.equal(a, b) and all(torch.equal(ga[k], gb[k]) for k in ga)
    assert not any(c.failed for c in layer_compile._COMPILED.values())


def test_generation_runs_the_eager_layers(aot_eager, micro_model):
    """A pass with a KV cache (HF ``generate``) takes the eager layers: the same greedy tokens, no graph
    compiled for it."""
    tok = load_tokenizer(micro_model, padding_side="left")
    eager, compiled = load_causal_lm(micro_model, CPU), load_causal_lm(micro_model, CPU)
    layer_compile.compile_decoder_layers(compiled, aot_eager)
    inputs = tok(["12+7=", "sort 3142="], return_tensors="pt", padding=True)
    graphs = counters["stats"]["unique_graphs"]
    outs = [m.generate(**inputs, max_new_tokens=6, do_sample=False, pad_token_id=tok.pad_token_id)
            for m in (eager, compiled)]
    assert torch.equal(outs[0], outs[1])
    assert counters["stats"]["unique_graphs"] == graphs


def _grouped_rows(tok):
    """Two prompts, three rows each, responses of 2-4 tokens: left-padded prompts, right-padded responses."""
    prompts = [tok(t)["input_ids"] for t in ("12+7=", "sort 3142=")]
    answers = [tok(t)["input_ids"] for t in ("19", "1234", "9", "12", "1243", "3")]
    P, R = max(map(len, prompts)), max(map(len, answers))
    ids = torch.full((6, P + R), tok.pad_token_id)
    att = torch.zeros_like(ids)
    for row, answer in enumerate(answers):
        prompt = prompts[row // 3]
        ids[row, P - len(prompt):P], att[row, P - len(prompt):P] = torch.tensor(prompt), 1
        ids[row, P:P + len(answer)], att[row, P:P + len(answer)] = torch.tensor(answer), 1
    exp = {"input_ids": ids, "attention_mask": att, "position_ids": (att.cumsum(1) - 1).clamp(min=0),
           "response_ids": ids[:, P:]}
    return exp, P, att[:, P:].float()


def test_rl_prefix_tree_runs_the_compiled_layers(aot_eager, micro_model):
    """RL's shared-prompt pass (a prefix tree with a boolean mask, no KV cache) goes through the compiled layers:
    graphs are compiled for it, and its log-probs and gradients under a non-uniform weight equal the eager
    layers' exactly."""
    from rlhf_core.trainers.rl_forward import token_logprobs

    exp, P, mask = _grouped_rows(load_tokenizer(micro_model))
    weights = torch.linspace(-1.0, 2.0, mask.numel()).view_as(mask) * mask
    eager, compiled = load_causal_lm(micro_model, CPU), load_causal_lm(micro_model, CPU)
    layer_compile.compile_decoder_layers(compiled, aot_eager)
    graphs = counters["stats"]["unique_graphs"]
    out = []
    for model in (eager, compiled):
        model.zero_grad(set_to_none=True)
        logp, _ = token_logprobs(model, exp, P, 1.0, share_prompts=True)
        (logp * weights).sum().backward()
        out.append((logp.detach(), {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}))
    assert counters["stats"]["unique_graphs"] > graphs
    (a, ga), (b, gb) = out
    assert torch.equal(a * mask, b * mask)
    assert ga.keys() == gb.keys() and all(torch.equal(ga[k], gb[k]) for k in ga)
    assert not any(c.failed for c in layer_compile._COMPILED.values())


def _failing_backend(gm, example_inputs):
    raise RuntimeError("this backend cannot compile")


def test_compile_failure_falls_back_to_eager(aot_eager, micro_model, micro_data, caplog):
    """A backend that fails (here: one that raises): a warning naming the layer class and the cause, the
    eager layers from then on, the same values."""
    tok, pairs = _pairs(micro_model, micro_data)
    eager, compiled = load_causal_lm(micro_model, CPU), load_causal_lm(micro_model, CPU)
    layer_compile.compile_decoder_layers(compiled, _failing_backend)
    batch = collate_pairs(pairs, tok.pad_token_id)
    weights = torch.ones(2 * len(pairs))
    with caplog.at_level(logging.WARNING, logger="rlhf_core.models.layer_compile"):
        a, b = (_sums_and_grads(m, batch, weights)[0] for m in (eager, compiled))
    assert torch.equal(a, b)
    assert "compiling Qwen2DecoderLayer failed (BackendCompilerFailed" in caplog.text
    assert "layers run eagerly from now on" in caplog.text
    assert [c.failed for c in layer_compile._COMPILED.values()][0].startswith("BackendCompilerFailed")


def test_sft_with_compiled_layers_trains_as_eager(aot_eager, micro_model, micro_data, tmp_path, caplog):
    """``compile_layers: on`` through the SFT trainer: the same losses and gradient norms step by step as
    ``off``, and the choice logged."""
    def run(setting):
        cfg = SFTConfig(model_path=str(micro_model), train_file=str(micro_data["sft"]), eval_file=str(micro_data["eval"]),
                        output_dir=str(tmp_path / setting / "out"), checkpoint_dir=str(tmp_path / setting / "ckpt"),
                        max_steps=3, batch_size=8, lr=3e-3, warmup_steps=0, eval_items=4, save_every=0,
                        num_threads=1, log_every=1, precision="fp32", packing=True, compile_layers=setting,
                        compile_backend=aot_eager)
        sink = Recorder()
        train_sft(cfg, sink, show_progress=False)
        return sink

    with caplog.at_level(logging.INFO, logger="rlhf_core.models.lm_head"):
        on = run("on")
    assert "sft: decoder layers compiled: on (2 layers)" in caplog.text
    off = run("off")
    for metric in ("train/loss", "train/grad_norm"):
        assert on.series(metric) == off.series(metric) and len(on.series(metric)) == 3


def test_prepare_decoder_kernels_resolves_auto_off_on_a_cpu(micro_model):
    """auto on a CPU: the layers stay as they are (the CPU pipeline's outputs do not change)."""
    import types

    model = load_causal_lm(micro_model, CPU)
    cfg = types.SimpleNamespace(section="sft", fused_kernels="auto", compile_layers="auto", num_workers=1,
                                parallel="ddp", lora_rank=0)
    prepare_decoder_kernels(cfg, model)
    assert all("forward" not in vars(layer) for layer in layer_compile.decoder_layers(model))
