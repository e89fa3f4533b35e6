"""The precision regimes' optimizer on hand-made tensors (rlhf_core/models/precision.py), against torch's own AdamW.

Expected values are torch AdamW's on fp32 tensors (the reference the regimes are defined by), cast
or rounded as each regime says; gradients are chosen exactly representable in bf16 so every
difference between accumulating in fp32 and in bf16 is one we can name.
"""

from __future__ import annotations

import copy

import pytest
import torch

from rlhf_core.models import precision as precision_mod
from rlhf_core.models.precision import MasterWeightAdamW, Precision, cast_parameters, clip_grad_norm_fp32

HYPER = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-8)


def _groups(params: list[torch.nn.Parameter]) -> list[dict]:
    # the trainers' layout: a decayed group and an undecayed one
    return [{"params": params[:1], "weight_decay": 0.1}, {"params": params[1:], "weight_decay": 0.0}]


def _start() -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return [torch.randn(4, 3, generator=gen), torch.randn(5, generator=gen)]


def _grads(step: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(100 + step)
    return [torch.randn(4, 3, generator=gen).bfloat16().float(), torch.randn(5, generator=gen).bfloat16().float()]


def test_mixed_step_is_fp32_adamw_then_a_cast():
    """Three steps: the masters equal torch AdamW's fp32 parameters bit for bit, the bf16 parameters their
    cast, and AdamW's moments are fp32 (keyed by the masters)."""
    ref = [torch.nn.Parameter(t.clone()) for t in _start()]
    ref_opt = torch.optim.AdamW(_groups(ref), **HYPER)
    params = [torch.nn.Parameter(t.clone()) for t in _start()]
    opt = MasterWeightAdamW(_groups(params), Precision.MIXED, **HYPER)
    cast_parameters(torch.nn.ParameterList(params), torch.bfloat16)
    for step in range(3):
        for p, r, g in zip(params, ref, _grads(step)):
            r.grad = g.clone()
            p.grad = g.bfloat16()  # no hooks: the gradient reaches the masters at the step
        ref_opt.step()
        opt.step()
        opt.zero_grad()
        for p, r in zip(params, ref):
            assert torch.equal(opt.masters[p], r.detach())
            assert p.dtype == torch.bfloat16 and torch.equal(p.detach(), r.detach().bfloat16())
            assert p.grad is None and opt.masters[p].grad is None
    state = opt.state[opt.masters[params[0]]]
    assert state["exp_avg"].dtype == state["exp_avg_sq"].dtype == torch.float32


def test_mixed_hooks_accumulate_micro_batches_in_fp32():
    """Two micro-batches with gradients 1 and 2^-9 (each exact in bf16; their sum is not: bf16 keeps 8
    significant bits, so 1 + 2^-9 rounds to 1). The hook adds each into the fp32 master's gradient and
    frees the bf16 one: the accumulated gradient is 1 + 2^-9, the gradient of one batch holding both
    (sum_i x_i, in fp32); bf16 accumulation in ``.grad`` would have lost the 2^-9."""
    p = torch.nn.Parameter(torch.zeros(2))
    opt = MasterWeightAdamW([{"params": [p]}], Precision.MIXED, grad_hooks=True, **HYPER)
    cast_parameters(torch.nn.ParameterList([p]), torch.bfloat16)
    xs = [torch.tensor([1.0, 2.0], dtype=torch.bfloat16), torch.tensor([2.0**-9, 2.0**-8], dtype=torch.bfloat16)]
    for x in xs:
        (p * x).sum().backward()
        assert p.grad is None  # moved to the master, freed
    one_batch = xs[0].float() + xs[1].float()
    assert torch.equal(opt.masters[p].grad, one_batch)
    assert torch.equal(one_batch, torch.tensor([1 + 2.0**-9, 2 + 2.0**-8]))
    assert not torch.equal((xs[0] + xs[1]).float(), one_batch)  # what bf16 accumulation gives
    assert float(opt.clip_grad_norm_(0.0)) == pytest.approx(float(one_batch.norm()))


def test_bf16_step_chunk_grows_into_memory_the_allocator_holds_free():
    """The transient step's chunk: the 1 GiB floor, or half of the allocator's free cached bytes at 8 bytes
    an element (a 0.5B model's step, 386.6M elements, is one chunk once the backward freed 6.2 GB or more);
    off CUDA nothing is cached, so the floor."""
    floor = precision_mod.BF16_STEP_CHUNK
    assert precision_mod.transient_chunk(0) == floor
    assert precision_mod.transient_chunk(16 * floor - 1) == floor
    assert precision_mod.transient_chunk(16 * floor + 16) == floor + 1
    assert precision_mod.transient_chunk(14 * 2**30) >= 386_570_112
    assert precision_mod.free_cached_bytes(torch.device("cpu")) == 0


@pytest.mark.parametrize("chunk", [precision_mod.BF16_STEP_CHUNK, 5])
def test_bf16_step_is_fp32_adamw_on_the_rounded_weights(chunk, monkeypatch):
    """``bf16``: each step is torch AdamW on fp32 copies of the bf16 weights, moments persisting in fp32,
    rounded back: the reference rounds its fp32 parameters to bf16 after every step. Chunks of 5
    elements (the 5-vector alone, the 4x3 matrix alone) step exactly as one chunk does."""
    monkeypatch.setattr(precision_mod, "BF16_STEP_CHUNK", chunk)
    ref = [torch.nn.Parameter(t.bfloat16().float()) for t in _start()]
    ref_opt = torch.optim.AdamW(_groups(ref), **HYPER)
    params = [torch.nn.Parameter(t.bfloat16()) for t in _start()]
    opt = MasterWeightAdamW(_groups(params), Precision.BF16, **HYPER)
    for step in range(3):
        for p, r, g in zip(params, ref, _grads(step)):
            r.grad = g.clone()
            p.grad = g.bfloat16()
        ref_opt.step()
        with torch.no_grad():
            for r in ref:
                r.copy_(r.bfloat16().float())
        opt.step()
        opt.zero_grad()
        for p, r in zip(params, ref):
            assert p.dtype == torch.bfloat16 and torch.equal(p.detach().float(), r.detach())
            assert opt.masters[p].numel() == 0  # no master persists between steps
    state = opt.state[opt.masters[params[0]]]
    assert state["exp_avg"].dtype == torch.float32 and state["exp_avg"].shape == (4, 3)
    assert torch.equal(state["exp_avg"], ref_opt.state[ref[0]]["exp_avg"])


def test_mixed_state_dict_carries_the_masters():
    """torch's state_dict format plus the masters: a fresh optimizer loaded from it takes the next step
    exactly as the original does (the bf16 parameters alone would have lost the masters' low bits)."""
    def fresh():
        params = [torch.nn.Parameter(t.clone()) for t in _start()]
        opt = MasterWeightAdamW(_groups(params), Precision.MIXED, **HYPER)
        cast_parameters(torch.nn.ParameterList(params), torch.bfloat16)
        return params, opt

    def step(params, opt, k):
        for p, g in zip(params, _grads(k)):
            p.grad = g.bfloat16()
        opt.step()
        opt.zero_grad()

    a, opt_a = fresh()
    step(a, opt_a, 0)
    b, opt_b = fresh()
    opt_b.load_state_dict(copy.deepcopy(opt_a.state_dict()))  # as through a file: torch's holds live tensors
    assert all(torch.equal(opt_b.masters[pb], opt_a.masters[pa]) for pa, pb in zip(a, b))
    step(a, opt_a, 1)
    step(b, opt_b, 1)
    assert all(torch.equal(opt_b.masters[pb], opt_a.masters[pa]) and torch.equal(pa, pb) for pa, pb in zip(a, b))


def test_clip_grad_norm_fp32_by_hand():
    """Gradients (3, 4) and (0,): norm 5; clipped to 1 they become (0.6, 0.8) up to torch's 1e-6 guard
    (coef = 1 / (5 + 1e-6)); with max_norm 0 they are only measured."""
    grads = [torch.tensor([3.0, 4.0], dtype=torch.bfloat16), torch.zeros(1, dtype=torch.bfloat16)]
    norm = clip_grad_norm_fp32(grads, 0.0)  # a 0-dim fp32 tensor: the caller reads it (a sync) when it chooses
    assert norm.shape == () and norm.dtype == torch.float32 and float(norm) == 5.0 and grads[0].tolist() == [3.0, 4.0]
    assert float(clip_grad_norm_fp32(grads, 1.0)) == 5.0
    assert torch.allclose(grads[0].float(), torch.tensor([0.6, 0.8]), atol=4e-3)  # bf16 resolution near 0.8


def test_cast_parameters_keeps_buffers_and_objects():
    model = torch.nn.Linear(3, 2)
    model.register_buffer("inv_freq", torch.tensor([1.0 / 3]))
    weight = model.weight
    cast_parameters(model, torch.bfloat16)
    assert model.weight is weight and weight.dtype == torch.bfloat16 and model.bias.dtype == torch.bfloat16
    assert model.inv_freq.dtype == torch.float32


def test_regime_properties():
    cpu = torch.device("cpu")
    assert Precision.resolve("auto", cpu) is Precision.FP32  # the CPU pipeline stays fp32
    assert Precision.MIXED.load_dtype == torch.float32 and Precision.MIXED.weight_dtype == torch.bfloat16
    assert Precision.BF16.load_dtype == torch.bfloat16
    assert Precision.MIXED.keeps_masters("ddp") and not Precision.BF16.keeps_masters("ddp")
    assert Precision.BF16.keeps_masters("zero2") and not Precision.FP32.keeps_masters("zero3")
    with pytest.raises(ValueError, match="fp32 uses torch.optim.AdamW"):
        MasterWeightAdamW([{"params": [torch.nn.Parameter(torch.zeros(1))]}], Precision.FP32, **HYPER)


def test_fp32_optimizer_on_a_cpu_is_torchs_fused_adamw_with_the_same_steps():
    """fp32 on a CPU: ``build_optimizer`` hands back torch's fused AdamW (one pass a step, as HF Trainer's
    default optimizer), with the no-decay group; three steps land where torch's per-tensor AdamW lands."""
    from rlhf_core.trainers.step import build_optimizer

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.LayerNorm(5), torch.nn.Linear(5, 3))
    reference = copy.deepcopy(model)
    opt = build_optimizer(model, lr=1e-2, weight_decay=0.1)
    assert opt.defaults["fused"] is True and [g["weight_decay"] for g in opt.param_groups] == [0.1, 0.0]
    ref_opt = torch.optim.AdamW([{"params": [p for p in reference.parameters() if p.ndim >= 2], "weight_decay": 0.1},
                                 {"params": [p for p in reference.parameters() if p.ndim < 2], "weight_decay": 0.0}],
                                lr=1e-2, betas=(0.9, 0.95), eps=1e-8, foreach=False)
    x = torch.randn(8, 6)
    for step in range(3):
        for m, o in ((model, opt), (reference, ref_opt)):
            o.zero_grad()
            (m(x) * torch.linspace(-1, 2, 3)).sum().backward()  # uneven upstream gradient
            o.step()
    for p, r in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(p, r, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("fused", [True, False])
def test_a_flagged_step_leaves_weights_moments_and_count_as_they_were(fused):
    """``parallel.optimizer_step`` with a nonzero ``skip`` flag: torch's fused AdamW (which takes the flag on the
    device, as GradScaler's ``found_inf``) and the per-tensor AdamW (which reads it first) leave the weights, both
    moments and the step count exactly as the last good step left them; a zero flag steps as ``step()`` does."""
    from rlhf_core.distributed.parallel import optimizer_step

    torch.manual_seed(0)
    model, twin = torch.nn.Linear(4, 3), torch.nn.Linear(4, 3)
    twin.load_state_dict(model.state_dict())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True if fused else None, foreach=None if fused else False)
    ref = torch.optim.AdamW(twin.parameters(), lr=1e-2, fused=True if fused else None, foreach=None if fused else False)
    x = torch.randn(5, 4)

    def grads(m):
        m.zero_grad()
        (m(x) * torch.linspace(-1, 2, 3)).sum().backward()

    for m, o in ((model, opt), (twin, ref)):
        grads(m)
        optimizer_step(o, torch.zeros(()))  # a good step, flag 0
    torch.testing.assert_close(list(model.parameters()), list(twin.parameters()), rtol=0, atol=0)
    before = copy.deepcopy(opt.state_dict()), [p.detach().clone() for p in model.parameters()]
    grads(model)
    optimizer_step(opt, torch.ones(()))  # flagged: nothing moves
    after = opt.state_dict()
    for p, q in zip(model.parameters(), before[1]):
        assert torch.equal(p, q)
    for key, state in before[0]["state"].items():
        for name in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(after["state"][key][name], state[name]), name
    assert not hasattr(opt, "found_inf")  # the flag does not outlive the call
