"""FP8 rollouts (rl.rollout.fp8): the engines sample through an e4m3 copy (prefill and decode alike), each weight
sync quantizes again, the trainer's model stays as it was, and a device without FP8 products is refused. On a CPU
the pinned torch runs the scaled products too (slowly), which is how the engine path is checked here; the GPU test
compares with bf16 on a card that has them."""

from __future__ import annotations

import pytest
import torch

from rlhf_core.config import ConfigError, RLConfig, build_config
from rlhf_core.models.fp8 import Fp8Linear, dequantize, fp8_unsupported
from rlhf_core.models.loading import load_causal_lm, load_tokenizer
from rlhf_core.rollout.engine import HFGenerateEngine, SamplingParams
from rlhf_core.rollout.static import StaticCacheEngine
from rlhf_core.trainers.rl_parts import build_rollout_engine
from test_rollout_hf import forward_logprobs

PROMPTS = ["12+30=", "sort 321=", "7*8=", "sort 90817=", "1+1="]


@pytest.mark.parametrize("engine_class", [StaticCacheEngine, HFGenerateEngine])
def test_engine_samples_through_its_fp8_copy(engine_class, micro_model):
    """The engine's log-probs are those of a forward through its own e4m3 copy (so prefill and decode both ran FP8),
    near the fp32 model's; the trainer's model keeps its fp32 weights."""
    model, tok = load_causal_lm(micro_model, torch.device("cpu")).eval(), load_tokenizer(micro_model)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    engine = engine_class(model, tok, batch_size=64, fp8=True)
    assert sum(isinstance(m, Fp8Linear) for m in engine.sampler.modules()) == 7 * len(model.model.layers)
    assert type(engine.sampler.lm_head) is torch.nn.Linear
    batch = engine.generate(PROMPTS, SamplingParams(n=3, temperature=1.0, max_new_tokens=8, seed=3))
    torch.testing.assert_close(batch.sampling_logprobs, forward_logprobs(engine.sampler, batch, 1.0), atol=1e-4,
                               rtol=0)
    gap = (batch.sampling_logprobs - forward_logprobs(model, batch, 1.0)).abs()
    assert 0 < gap.max() < 0.1
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())


def test_each_sync_quantizes_again(micro_model):
    model, tok = load_causal_lm(micro_model, torch.device("cpu")).eval(), load_tokenizer(micro_model)
    engine = StaticCacheEngine(model, tok, fp8=True)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.5)
    moved = engine.update_weights(model)  # the trainer's own model: the copy is refreshed from it
    q_proj = engine.sampler.model.layers[0].self_attn.q_proj
    new = model.model.layers[0].self_attn.q_proj.weight.detach()
    torch.testing.assert_close(dequantize(q_proj.weight, q_proj.weight_scale), new, atol=float(0.07 * new.abs().max()),
                               rtol=0)
    assert moved == sum(t.numel() * t.element_size() for t in engine.sampler.state_dict().values())


def test_fp8_is_refused_on_a_cpu(micro_model):
    model, tok = load_causal_lm(micro_model, torch.device("cpu")).eval(), load_tokenizer(micro_model)
    cfg = build_config(RLConfig, "rl", {"rollout.fp8": True})
    with pytest.raises(ConfigError) as refused:
        build_rollout_engine(cfg, model, tok)
    assert str(refused.value) == ("rl.rollout.fp8: FP8 matrix products need a CUDA GPU of compute capability 8.9 or "
                                  "newer (Ada, Hopper); the engine runs on the CPU; set rollout.fp8 false")


@pytest.mark.skipif(not torch.cuda.is_available() or fp8_unsupported(torch.device("cuda")) is not None,
                    reason="needs a CUDA GPU with FP8 matrix products (compute capability >= 8.9)")
def test_fp8_logprobs_near_bf16_on_a_gpu(micro_tokenizer, tmp_path):
    """bf16 model on the GPU (dimensions multiples of 16, as the scaled product needs): the FP8 static engine's
    sampling log-probs against the bf16 trainer's recomputation, beside the bf16 engine's own gap."""
    from rlhf_core.embedded.tiny_model import build_tiny_model
    from rlhf_core.trainers.rl_forward import token_logprobs

    path = build_tiny_model(micro_tokenizer, tmp_path / "m", arch="qwen2", hidden_size=64, num_layers=2, num_heads=4,
                            num_kv_heads=2, intermediate_size=128, max_positions=64, seed=0)
    device = torch.device("cuda")
    model = load_causal_lm(path, device).to(torch.bfloat16).eval()
    tok = load_tokenizer(path, padding_side="left")
    params = SamplingParams(n=4, temperature=1.0, max_new_tokens=16, seed=0)
    gaps = {}
    for fp8 in (False, True):
        batch = StaticCacheEngine(model, tok, batch_size=64, fp8=fp8).generate(PROMPTS, params)
        mask = batch.response_mask.bool()
        exp = {k: v.to(device) for k, v in batch.learner_inputs().items()}
        with torch.no_grad():
            trainer = token_logprobs(model, exp, batch.prompt_ids.shape[1], 1.0)[0].float().cpu()
        gaps[fp8] = (batch.sampling_logprobs - trainer)[mask].abs()
    # the quantization's own gap: at the 0.5B shape a mean of about 0.1 nats (BENCHMARKS.md, "FP8 rollouts")
    assert gaps[True].mean() < 0.15 and gaps[True].max() < 1.0
    assert gaps[True].mean() >= gaps[False].mean()
