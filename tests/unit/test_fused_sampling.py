"""The decode step's Triton sampler (rlhf_core/models/fused_sampling.py) against torch's ``sample`` and a float64
inverse CDF, and the choice of sampler (``SETTINGS.sampler``).

The kernel runs here under Triton's interpreter (``TRITON_INTERPRET=1``, in a child process: Triton reads it when
``triton.language`` is first imported) where Triton is installed, and the tests that need it skip elsewhere; the
interpreter does not model bf16, so fp32 and fp16 logits here (bench/gpu_engine.py runs the kernel on a GPU in bf16).

Torch's ``sample`` and the kernel add the same weights in different orders (a sequential ``cumsum`` against chunked
sums), so their running sums differ by float rounding, and a row whose target ``u S`` lies within that rounding of a
boundary between two tokens may go either way. The tests therefore locate every row's target in the float64 running
sum: where it is clear of every boundary by ``1e-5 S`` the kernel's token must be exactly the float64 one (and
torch's); where it is not, the kernel's token must be one of the tokens within that distance.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from rlhf_core.models import fused_sampling as fs
from rlhf_core.rollout.decode import sampling
from rlhf_core.rollout.decode.settings import SETTINGS
from rlhf_core.rollout.engine import SamplingParams

# (rows, vocabulary): V a multiple of the 1024-wide chunk or not, one chunk or many
SHAPES = [(1, 1000), (64, 1000), (9, 32000)]
TOL = 1e-5  # of S: the float64 distance from a boundary under which a row may go either way


def _case(rows: int, V: int, seed: int, dtype=torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(rows, V, generator=g) * 3).to(dtype), torch.rand(rows, 1, generator=g)


def _float64_check(logits: torch.Tensor, uniform: torch.Tensor, T: float, token: torch.Tensor) -> dict:
    """Rows whose target is clear of every boundary, and whether the kernel's ``token`` is the float64 inverse CDF's
    there and, in every row, a token whose span reaches within ``TOL S`` of the target."""
    x = logits.double() / T
    cdf = (x - x.amax(-1, keepdim=True)).exp().cumsum(-1)
    S = cdf[:, -1:]
    target = uniform.double() * S
    exact = torch.searchsorted(cdf, target, right=True).squeeze(-1).clamp(max=cdf.shape[-1] - 1)
    clear = ((cdf - target).abs() > TOL * S).all(-1)
    lo = torch.cat([torch.zeros_like(S), cdf[:, :-1]], -1).gather(-1, token[:, None])
    hi = cdf.gather(-1, token[:, None])
    near = ((lo - TOL * S <= target) & (target < hi + TOL * S)).squeeze(-1)
    return {"clear": clear, "exact": exact, "near": near}


def _parity(logits: torch.Tensor, uniform: torch.Tensor, T: float) -> dict:
    token, logp = fs.fused_sample(logits, uniform, T)
    ref_token, ref_logp = sampling.sample(logits, SamplingParams(temperature=T), uniform=uniform)
    f64 = _float64_check(logits, uniform, T, token)
    clear = f64["clear"]
    return {"rows": len(token), "clear": int(clear.sum()), "dtypes": [str(token.dtype), str(logp.dtype)],
            "vs_torch_clear": int((token != ref_token)[clear].sum()),
            "vs_float64_clear": int((token != f64["exact"])[clear].sum()), "all_near": bool(f64["near"].all()),
            "logp_vs_torch": (logp - ref_logp).abs().max().item()}


def _invariance() -> dict:
    """Row 5 sampled alone, inside its batch of 64 and beside 3 other rows: bit for bit the same."""
    logits, uniform = _case(64, 1000, seed=3, dtype=torch.float16)
    whole = fs.fused_sample(logits, uniform, 0.7)
    alone = fs.fused_sample(logits[5:6], uniform[5:6], 0.7)
    others, more = _case(3, 1000, seed=4, dtype=torch.float16)
    beside = fs.fused_sample(torch.cat([others[:2], logits[5:6], others[2:]]),
                             torch.cat([more[:2], uniform[5:6], more[2:]]), 0.7)
    same = [torch.equal(whole[i][5:6], alone[i]) and torch.equal(whole[i][5:6], beside[i][2:3]) for i in (0, 1)]
    return {"identical": all(same)}


def _edges() -> dict:
    """u = 0 past masked leading tokens; u just below 1 before masked trailing tokens; half the vocabulary masked."""
    V = 1000
    logits, _ = _case(4, V, seed=5)
    masked = logits.clone()
    masked[:, :7] = float("-inf")
    masked[:, -5:] = float("-inf")
    zero = fs.fused_sample(masked, torch.zeros(4, 1), 1.0)[0]
    below_one = torch.full((4, 1), 1.0 - 2.0 ** -24)
    top, top_logp = fs.fused_sample(masked, below_one, 1.0)
    flat = torch.zeros(2, V)  # equal weights: u S a hair below the end of the running sum
    flat[:, V - 3:] = float("-inf")
    flat_token = fs.fused_sample(flat, torch.full((2, 1), 1.0 - 2.0 ** -24), 1.0)[0]
    half, u = _case(256, V, seed=6)
    keep = torch.rand(256, V, generator=torch.Generator().manual_seed(7)) < 0.5
    half = half.masked_fill(~keep, float("-inf"))
    chosen = fs.fused_sample(half, u, 1.0)[0]
    return {"u_zero": zero.tolist(), "below_one": top.tolist(), "below_one_finite": bool(top_logp.isfinite().all()),
            "flat_below_one": flat_token.tolist(), "masked_chosen": int((~keep.gather(1, chosen[:, None])).sum())}


def _interpreted_results() -> dict:
    out = {}
    for i, (rows, V) in enumerate(SHAPES):
        for T in (1.0, 0.7):
            out[f"{i}-{T}"] = _parity(*_case(rows, V, seed=i), T)
    out["fp16"] = _parity(*_case(16, 1000, seed=11, dtype=torch.float16), 1.0)
    logits, uniform = _case(8, 1000, seed=12)
    wide = torch.cat([logits, torch.randn_like(logits)], -1)[:, :1000]  # rows strided by 2000
    out["strided"] = _parity(wide, uniform, 1.0)
    out["invariance"] = _invariance()
    out["edges"] = _edges()
    out["available"] = fs.available()
    return out


@pytest.fixture(scope="module")
def interpreted() -> dict:
    pytest.importorskip("triton")
    root = str(Path(__file__).resolve().parents[2])
    env = {**os.environ, "TRITON_INTERPRET": "1",
           "PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")])}
    res = subprocess.run([sys.executable, __file__], check=False, env=env, capture_output=True, text=True, timeout=300,
                         cwd=root)
    assert res.returncode == 0, res.stderr[-3000:]
    return json.loads(res.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("T", [1.0, 0.7])
@pytest.mark.parametrize("case", range(len(SHAPES)))
def test_the_kernel_samples_as_torch_and_the_float64_inverse_cdf(case, T, interpreted):
    """Rows clear of a boundary (most: at V = 32000 a sampled token's span is often under ``2 TOL S`` wide): the
    float64 token and torch's; every row: a token within rounding of the target; log-probs to 1e-5 of torch's."""
    assert interpreted["available"]
    r = interpreted[f"{case}-{T}"]
    assert r["dtypes"] == ["torch.int64", "torch.float32"]
    assert 2 * r["clear"] >= r["rows"] and r["vs_torch_clear"] == 0 and r["vs_float64_clear"] == 0, r
    assert r["all_near"] and r["logp_vs_torch"] < 1e-5, r


@pytest.mark.parametrize("case", ["fp16", "strided"])
def test_half_precision_and_strided_logits(case, interpreted):
    r = interpreted[case]
    assert r["vs_torch_clear"] == 0 and r["vs_float64_clear"] == 0 and r["all_near"] and r["logp_vs_torch"] < 1e-5, r


def test_a_row_samples_the_same_alone_in_a_batch_or_beside_others(interpreted):
    assert interpreted["invariance"]["identical"]


def test_edges_of_the_unit_interval_and_masked_tokens(interpreted):
    """u = 0: the first token of nonzero weight (7, past the masked 0..6). u = 1 - 2^-24: a valid token before the
    masked tail; with equal weights, the last unmasked token. A token of -inf logit is never chosen."""
    e = interpreted["edges"]
    assert e["u_zero"] == [7] * 4
    assert all(7 <= t < 995 for t in e["below_one"]) and e["below_one_finite"]
    assert e["flat_below_one"] == [996, 996]
    assert e["masked_chosen"] == 0


def test_bad_arguments_are_refused():
    logits, uniform = _case(2, 100, seed=0)
    with pytest.raises(ValueError, match="temperature must be > 0"):
        fs.fused_sample(logits, uniform, 0.0)
    with pytest.raises(ValueError, match="block 100"):
        fs.fused_sample(logits, uniform, 1.0, block=100)
    with pytest.raises(ValueError, match="3 uniforms for 2 rows"):
        fs.fused_sample(logits, torch.rand(3, 1), 1.0)


def test_asking_for_the_triton_sampler_where_it_cannot_run_says_so(monkeypatch):
    monkeypatch.setattr(fs, "available", lambda: False)
    monkeypatch.setattr(SETTINGS, "sampler", "triton")
    with pytest.raises(ValueError, match=r"the decode sampler triton \(SETTINGS.sampler\) needs Triton"):
        sampling.choose_sampler(torch.device("cpu"))
    monkeypatch.setattr(SETTINGS, "sampler", "fast")
    with pytest.raises(ValueError, match="must be auto, triton or torch, got 'fast'"):
        sampling.choose_sampler(torch.device("cpu"))


@pytest.mark.parametrize("device,here,built,expected", [
    ("cuda", True, True, "triton"), ("cuda", False, True, "torch"), ("cuda", True, False, "torch"),
    ("cpu", True, True, "torch")])
def test_auto_takes_the_triton_sampler_on_a_cuda_device_with_triton(device, here, built, expected, monkeypatch):
    monkeypatch.setattr(fs, "available", lambda: here)
    monkeypatch.setattr(SETTINGS, "sampler", "auto")
    assert sampling.choose_sampler(torch.device(device), triton=built) == expected
    monkeypatch.setattr(SETTINGS, "sampler", "torch")
    assert sampling.choose_sampler(torch.device(device)) == "torch"


@pytest.mark.parametrize("params", [SamplingParams(temperature=0), SamplingParams(top_k=5),
                                    SamplingParams(top_p=0.9), SamplingParams()])
def test_greedy_top_k_top_p_and_drawn_uniforms_sample_with_torch(params, monkeypatch):
    """The Triton sampler's function hands greedy, top-k, top-p, and a call without given uniforms to its torch
    fallback untouched."""
    calls = []
    monkeypatch.setattr(fs, "fused_sample", lambda *a, **k: pytest.fail("the kernel was called"))
    fn = sampling.sampling_function("triton", compiled=False)
    fn.keywords["fallback"] = lambda *a, **k: calls.append(k) or ("token", "logp")
    uniform = None if params == SamplingParams() else torch.rand(2, 1)
    assert fn(torch.randn(2, 10), params, uniform=uniform) == ("token", "logp")
    assert calls == [{"generator": None, "uniform": uniform}]
    assert sampling.sampling_function("torch", compiled=False) is sampling.sample


if __name__ == "__main__":  # the interpreted child of the ``interpreted`` fixture
    print(json.dumps(_interpreted_results()))
