"""The decode step's Triton attention kernel (rlhf_core/models/decode_attention.py) against its torch contract.

The kernel runs here under Triton's interpreter (``TRITON_INTERPRET=1``: the same kernel code, its tile ops
executed with numpy on CPU tensors) where Triton is installed; the CPU install does not carry Triton (it comes
with torch's CUDA wheels), so these tests skip there and bench/gpu_engine.py makes the comparison on a GPU in bf16
(the interpreter does not model bf16: fp32 and fp16 here). The reference itself is checked against the engine's
flash-layout reference (``rlhf_core.rollout.decode.attention.flash_layout_attention`` on a CPU) without Triton.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from rlhf_core.models import decode_attention as da
from rlhf_core.rollout.decode.attention import flash_layout_attention

# (cache rows B, query rows a cache row Q, query heads H_q, KV heads H_kv, head size D, cache width W):
# grouped heads folded into rows (Q = G, H_q = H_kv), one row a cache row with grouped heads, plain multi-head,
# and more keys than one block
SHAPES = [(5, 7, 2, 2, 64, 40), (4, 1, 14, 2, 64, 70), (3, 1, 4, 4, 32, 17), (6, 2, 4, 2, 16, 130)]


def _case(B, Q, Hq, Hkv, D, W, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B * Q, Hq, D, generator=g).to(dtype)
    k = torch.randn(B * W, Hkv, D, generator=g).to(dtype)
    v = torch.randn(B * W, Hkv, D, generator=g).to(dtype)
    start = torch.randint(0, W // 2, (B,), generator=g)
    used = torch.minimum(torch.randint(1, W // 2 + 1, (B,), generator=g), W - start)
    cu_k = torch.cat([torch.arange(B) * W + start, torch.tensor([B * W])]).int()
    return q, k, v, cu_k, used.int()


def _interpreted_errors() -> dict:
    """Run in a child process with ``TRITON_INTERPRET=1`` (Triton reads it when ``triton.language`` is first
    imported, which the test session may have done already): per case, the kernel's largest error against the
    reference, and against its own output with every key outside the rows' used spans poisoned."""
    out = {}
    for i, shape in enumerate(SHAPES):
        for block_n in (16, 64):
            q, k, v, cu_k, used = _case(*shape)
            got = da.decode_attention(q, k, v, cu_k, used, 0.125, block_n=block_n)
            ref = da.decode_attention_reference(q, k, v, cu_k, used, shape[5], 0.125)
            W, poisoned = shape[5], k.clone()
            for b in range(shape[0]):
                outside = torch.ones(W, dtype=torch.bool)
                lo = int(cu_k[b]) - b * W
                outside[lo:lo + int(used[b])] = False
                poisoned[b * W:(b + 1) * W][outside] = 1e4
            again = da.decode_attention(q, poisoned, v, cu_k, used, 0.125, block_n=block_n)
            out[f"{i}-{block_n}"] = {"vs_reference": (got - ref).abs().max().item(),
                                     "poisoned": (again - got).abs().max().item()}
    q, k, v, cu_k, used = _case(*SHAPES[1])  # queries as a view of wider rows: heads contiguous, rows strided
    wide = torch.cat([q, torch.randn_like(q)], dim=-1)[..., :q.shape[-1]]
    got = da.decode_attention(wide, k, v, cu_k, used, 0.125)
    out["strided"] = {"contiguous": got.is_contiguous(), "vs_reference": (got - da.decode_attention_reference(
        q, k, v, cu_k, used, SHAPES[1][5], 0.125)).abs().max().item()}
    q, k, v, cu_k, used = _case(*SHAPES[1], dtype=torch.float16)
    got = da.decode_attention(q, k, v, cu_k, used, 0.125)
    ref = da.decode_attention_reference(q, k, v, cu_k, used, SHAPES[1][5], 0.125)
    out["fp16"] = {"dtype": str(got.dtype), "vs_reference": (got.float() - ref.float()).abs().max().item()}
    out["available"] = da.available()
    return out


@pytest.fixture(scope="module")
def interpreted() -> dict:
    pytest.importorskip("triton")
    root = str(Path(__file__).resolve().parents[2])
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")])}
    res = subprocess.run([sys.executable, __file__], env=env, capture_output=True, text=True, timeout=300, cwd=root)
    assert res.returncode == 0, res.stderr[-3000:]
    return json.loads(res.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("case", range(len(SHAPES)))
@pytest.mark.parametrize("block_n", [16, 64])
def test_the_kernel_equals_the_reference(case, block_n, interpreted):
    """fp32 to 2e-6, and keys past ``used[b]`` or of other rows never leak in (poisoning them changes nothing)."""
    assert interpreted["available"]
    errors = interpreted[f"{case}-{block_n}"]
    assert errors["vs_reference"] < 2e-6 and errors["poisoned"] == 0.0, errors


def test_strided_queries_give_a_contiguous_output(interpreted):
    assert interpreted["strided"]["contiguous"] and interpreted["strided"]["vs_reference"] < 2e-6


def test_the_kernel_in_half_precision(interpreted):
    assert interpreted["fp16"]["dtype"] == "torch.float16" and interpreted["fp16"]["vs_reference"] < 2e-3


def test_bad_layouts_are_refused():
    q, k, v, cu_k, used = _case(2, 1, 4, 2, 24, 10)  # head size 24: not a power of two
    with pytest.raises(ValueError, match="head size 24"):
        da.decode_attention(q, k, v, cu_k, used, 0.1)


if __name__ == "__main__":  # the interpreted child of the ``interpreted`` fixture
    print(json.dumps(_interpreted_errors()))
