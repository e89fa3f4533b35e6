"""The chunked LM-head log-prob function against the whole-logits formula (hand-made tensors).

Reference: ``log_softmax(h W^T / T)[y]`` over the full ``(N, V)`` logits, the formula every trainer
used before (``rlhf_core.algorithms.losses.sequence_logprobs``). The upstream gradient is non-uniform
(advantage-weighted: random signs and sizes per token), the case where a kernel that scales every
token's gradient alike would pass a mean-reduction test and still be wrong.
"""

from __future__ import annotations

import pytest
import torch

from rlhf_core.models.lm_head import (LMHead, chunked_token_logprobs, detached_entropy, head_logprobs, liger_chunk_mem_const,
                               parallel_mode, resolve_kernel, resolve_lm_head, use_fused_kernels)
from rlhf_core.algorithms.rl_math import entropy_from_logits

N, H, V = 37, 16, 50


def _setup(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    head = torch.nn.Linear(H, V, bias=False)
    with torch.no_grad():
        head.weight.copy_(torch.randn(V, H, generator=g))
    hidden = torch.randn(N, H, generator=g, requires_grad=True)
    targets = torch.randint(0, V, (N,), generator=g)
    weights = torch.randn(N, generator=g) * torch.rand(N, generator=g) * 3  # non-uniform upstream gradient
    return head, hidden, targets, weights


def _reference(head, hidden, targets, temperature):
    logits = head(hidden).float() / temperature
    return torch.log_softmax(logits, -1).gather(-1, targets[:, None]).squeeze(-1), entropy_from_logits(logits)


@pytest.mark.parametrize("chunk", [1, 8, N, 4 * N])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_chunked_logprobs_and_gradients_equal_the_whole_logits(chunk, temperature):
    head, hidden, targets, weights = _setup()
    ref_logp, _ = _reference(head, hidden, targets, temperature)
    (ref_logp * weights).sum().backward()
    ref_grads = hidden.grad.clone(), head.weight.grad.clone()
    hidden.grad = head.weight.grad = None

    logp, entropy = chunked_token_logprobs(head, hidden, targets, temperature=temperature, chunk_tokens=chunk)
    (logp * weights).sum().backward()
    assert entropy is None
    torch.testing.assert_close(logp, ref_logp, atol=1e-5, rtol=0)
    torch.testing.assert_close(hidden.grad, ref_grads[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(head.weight.grad, ref_grads[1], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("entropy_grad", [False, True])
def test_chunked_entropy_with_and_without_its_gradient(entropy_grad):
    """Entropy equals the whole-logits entropy; its gradient flows only with ``entropy_grad``."""
    head, hidden, targets, weights = _setup(1)
    ref_logp, ref_ent = _reference(head, hidden, targets, 1.0)
    loss = (ref_logp * weights).sum() + (0.3 * ref_ent.sum() if entropy_grad else 0.0)
    loss.backward()
    ref_grad = hidden.grad.clone()
    hidden.grad = head.weight.grad = None

    logp, entropy = chunked_token_logprobs(head, hidden, targets, with_entropy=True, entropy_grad=entropy_grad,
                                           chunk_tokens=5)
    torch.testing.assert_close(entropy, ref_ent, atol=1e-5, rtol=0)
    assert entropy.requires_grad == entropy_grad
    loss = (logp * weights).sum() + (0.3 * entropy.sum() if entropy_grad else 0.0)
    loss.backward()
    torch.testing.assert_close(hidden.grad, ref_grad, atol=1e-5, rtol=1e-5)


def test_chunked_keeps_no_logits_for_backward():
    """With checkpointed chunks, what forward saves for backward is the hidden input, not (N, V) logits."""
    head, hidden, targets, _ = _setup()
    saved: list[torch.Size] = []

    def pack(t):
        saved.append(t.shape)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        chunked_token_logprobs(head, hidden, targets, chunk_tokens=8)
    assert saved and all(V not in shape for shape in saved)
    saved.clear()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        _reference(head, hidden, targets, 1.0)
    assert any(V in shape for shape in saved)  # the whole-logits path does keep them


def test_no_grad_and_empty_inputs():
    head, hidden, targets, _ = _setup()
    with torch.no_grad():
        logp, _ = chunked_token_logprobs(head, hidden, targets, chunk_tokens=4)
    assert not logp.requires_grad
    empty, ent = chunked_token_logprobs(head, hidden[:0], targets[:0], with_entropy=True)
    assert empty.shape == (0,) and ent.shape == (0,)


def test_kernel_choice_on_a_cpu():
    """Without CUDA: auto never prefers liger (whole logits, else chunked); an explicit liger or fused_kernels: on
    is a clear error."""
    cpu = torch.device("cpu")
    assert use_fused_kernels("auto", cpu) is False
    assert resolve_lm_head("auto", 4096, fused=False, head_whole=True) == LMHead("auto", 4096, prefer_liger=False)
    assert resolve_lm_head("full", 64, fused=False, head_whole=True).kernel == "full"
    with pytest.raises(RuntimeError, match="fused_kernels: on needs a CUDA device"):
        use_fused_kernels("on", cpu)
    with pytest.raises(RuntimeError, match="lm_head: liger needs CUDA"):
        resolve_lm_head("liger", 4096, fused=False, head_whole=True)
    assert resolve_lm_head("auto", 4096, fused=True, head_whole=False).prefer_liger is False  # ZeRO-3
    assert resolve_lm_head("auto", 4096, fused=True, head_whole=True).prefer_liger is True


def test_zero_counts_with_one_rank():
    """DeepSpeed wraps a lone rank's model too (ZeRO-3: empty placeholders outside a forward), so one rank under
    zero2/zero3 reads as that stage, not as a plain process: the LM head is then not whole (no liger) under zero3.
    DDP with one rank is a plain process."""
    from types import SimpleNamespace as Cfg

    assert parallel_mode(Cfg(parallel="zero3", num_workers=1)) == "zero3"
    assert parallel_mode(Cfg(parallel="zero2", num_workers=1)) == "zero2"
    assert parallel_mode(Cfg(parallel="ddp", num_workers=1)) == "none"
    assert parallel_mode(Cfg(parallel="ddp", num_workers=2)) == "ddp"
    assert parallel_mode(Cfg()) == "none"  # a config without the fields (a reward scorer's)


def test_kernel_route_for_an_entropy():
    """liger (preferred by auto, or asked for) serves a logged entropy, computed beside it without a gradient;
    an entropy gradient (an entropy bonus in the loss) takes whole logits or chunks, which carry it."""
    liger_auto, plain_auto = LMHead("auto", 4096, prefer_liger=True), LMHead("auto", 4096)
    small, large = (100, 50), (600_000, 1000)  # float32 logits of 20 kB and 2.4 GB (whole_bytes: 2 GiB)
    assert resolve_kernel(liger_auto, *small, needs_entropy_grad=False) == "liger"
    assert resolve_kernel(liger_auto, *large, needs_entropy_grad=False) == "liger"
    assert resolve_kernel(liger_auto, *small, needs_entropy_grad=True) == "whole"
    assert resolve_kernel(liger_auto, *large, needs_entropy_grad=True) == "chunked"
    assert resolve_kernel(plain_auto, *small, needs_entropy_grad=False) == "whole"
    assert resolve_kernel(plain_auto, *large, needs_entropy_grad=False) == "chunked"
    assert resolve_kernel(LMHead("liger"), *small, needs_entropy_grad=False) == "liger"
    assert resolve_kernel(LMHead("liger"), *small, needs_entropy_grad=True) == "chunked"
    assert resolve_kernel(LMHead("chunked"), *small, needs_entropy_grad=False) == "chunked"


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_detached_entropy_is_the_entropy_without_a_gradient(temperature):
    """The entropy liger's path logs equals the whole logits' entropy at any chunking, and holds no graph."""
    head, hidden, targets, _ = _setup(2)
    _, ref = _reference(head, hidden, targets, temperature)
    for chunk in (1, 7, 4 * N):
        got = detached_entropy(head, hidden, temperature, chunk)
        torch.testing.assert_close(got, ref.detach(), atol=1e-5, rtol=0)
        assert not got.requires_grad and got.grad_fn is None


def test_whole_and_chunked_routes_give_the_same_logprobs_entropy_and_gradients():
    """head_logprobs with a logged entropy (RL's update) by whole logits and by chunks: equal log-probs, entropies
    and advantage-weighted gradients; the entropy carries a gradient only when asked."""
    outs = []
    for cfg in (LMHead("auto", 5), LMHead("auto", 5, whole_bytes=0), LMHead("chunked", 5)):
        head, hidden, targets, weights = _setup(3)
        logp, entropy = head_logprobs(head, hidden, targets, cfg, temperature=0.8, with_entropy=True,
                                      entropy_grad=False)
        assert not entropy.requires_grad
        (logp * weights).sum().backward()
        outs.append((logp.detach(), entropy, hidden.grad, head.weight.grad))
    for other in outs[1:]:
        for a, b in zip(outs[0], other):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def _liger_chunk_rows(rows: int, hidden: int, vocab: int, const: int) -> int:
    """liger-kernel 0.8.5's chunk size (``fused_linear_cross_entropy_forward``), written out: liger itself
    needs Triton and CUDA, so the CPU suite checks our choice of its ``chunk_mem_const`` against the formula."""
    inc = -(-vocab // (const * hidden))
    per = -(-rows // inc)
    return min(1 << (per - 1).bit_length(), rows)


@pytest.mark.parametrize("hidden,vocab", [(1536, 151_936), (896, 32_000), (3584, 151_936), (64, 1000)])
@pytest.mark.parametrize("rows", [16, 64, 1008, 5504, 16384, 40_000])
@pytest.mark.parametrize("chunk_rows", [512, 4096])
def test_liger_chunks_are_about_the_asked_rows(hidden, vocab, rows, chunk_rows):
    const = liger_chunk_mem_const(rows, hidden, vocab, chunk_rows)
    chunk = _liger_chunk_rows(rows, hidden, vocab, const)
    assert const >= 1
    assert chunk >= min(rows, -(-rows // -(-rows // chunk_rows)))  # no more chunks than asked for
    assert chunk <= max(2 * chunk_rows, _liger_chunk_rows(rows, hidden, vocab, 1))  # pow2 rounding at most doubles


def test_liger_default_chunks_are_tiny_at_a_large_vocabulary():
    """Why the constant is ours: liger's default at the 1.5B shape gives 64-row chunks for a DPO micro-batch."""
    assert _liger_chunk_rows(5504, 1536, 151_936, 1) == 64
    assert _liger_chunk_rows(5504, 1536, 151_936, liger_chunk_mem_const(5504, 1536, 151_936, 4096)) == 4096
