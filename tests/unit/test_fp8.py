"""FP8 (e4m3) rollouts' math and switch: per-channel and per-token quantization worked by hand, the scaled product
against it, and the config's checks (rl.rollout.fp8); the device refusal's message."""

from __future__ import annotations

import pytest
import torch

from rlhf_core.config import ConfigError, RLConfig, build_config
from rlhf_core.models.fp8 import (Fp8Linear, dequantize, fp8_linear, fp8_unsupported, load_quantized,
                                  quantize_linears, quantize_rows)

W = torch.tensor([[1.0, -2.0, 4.0, 3.0], [0.5, 0.25, -0.125, 0.0]])


def test_weight_scales_per_output_channel_by_hand():
    """Row 0: max |w| = 4, scale 4/448 = 1/112, so w / s = [112, -224, 448, 336]. e4m3 keeps 3 mantissa bits: in
    [256, 512) its values are 32 apart, and 336 lies half-way between 320 and 352: round-to-nearest-even gives 320
    (1.25 x 2^8, mantissa 010), which dequantizes to 320/112 = 20/7. The rest are exact (112 = 1.75 x 2^6, 224 = 1.75 x
    2^7, 448 = 1.75 x 2^8). Row 1: max 0.5, scale 1/896: [448, 224, -112, 0], all exact."""
    q, scale = quantize_rows(W)
    assert q.dtype == torch.float8_e4m3fn and q.shape == (2, 4) and scale.shape == (2, 1)
    torch.testing.assert_close(scale, torch.tensor([[1 / 112], [1 / 896]]))
    assert q.float().tolist() == [[112.0, -224.0, 448.0, 320.0], [448.0, 224.0, -112.0, 0.0]]
    torch.testing.assert_close(dequantize(q, scale), torch.tensor([[1.0, -2.0, 4.0, 20 / 7], W[1].tolist()]))


def test_an_all_zero_row_quantizes_to_zeros():
    q, scale = quantize_rows(torch.zeros(2, 16))
    assert (q.float() == 0).all() and (scale > 0).all()


def test_fp8_linear_by_hand():
    """x = [2, 0, 0, -1]: its token scale 2/448 = 1/224 gives x_q = [448, 0, 0, -224], exact. With W above,
    y_0 = (1/224)(1/112)(448 x 112 - 224 x 320) = -21504 / 25088 = -6/7 (= 2 x 1 - 1 x 20/7) and
    y_1 = (1/224)(1/896)(448 x 448) = 1; plus the bias [0.5, -1]: [-5/14, 0]."""
    q, scale = quantize_rows(W)
    y = fp8_linear(torch.tensor([[[2.0, 0.0, 0.0, -1.0]]]), q, scale, torch.tensor([0.5, -1.0]))
    assert y.shape == (1, 1, 2)
    torch.testing.assert_close(y, torch.tensor([[[-5 / 14, 0.0]]]))


def test_fp8_linear_is_the_dequantized_product():
    """Any input: the scaled product equals dequantize(x_q) @ dequantize(W_q)^T (fp32 accumulation) to rounding."""
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(3, 5, 32, generator=g), torch.randn(16, 32, generator=g)
    q, scale = quantize_rows(w)
    x_q, x_scale = quantize_rows(x)
    ref = dequantize(x_q, x_scale) @ dequantize(q, scale).T
    torch.testing.assert_close(fp8_linear(x, q, scale), ref, atol=1e-5, rtol=1e-5)
    # and close to the unquantized product: e4m3's relative step is 2^-3, each operand off by <= 1/16 of a value
    assert (fp8_linear(x, q, scale) - x @ w.T).abs().max() < 0.1 * (x @ w.T).abs().max()


class _Tiny(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.body = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 16, bias=False))
        self.head = torch.nn.Linear(16, 8)

    def get_output_embeddings(self):
        return self.head


def test_quantize_linears_keeps_the_head_and_load_quantizes_again():
    torch.manual_seed(0)
    model = _Tiny()
    source = {k: v.clone() for k, v in model.named_parameters()}
    assert quantize_linears(model) == 2
    assert isinstance(model.body[0], Fp8Linear) and isinstance(model.body[2], Fp8Linear)
    assert type(model.head) is torch.nn.Linear and model.body[2].bias is None
    new = {k: v + 1.0 for k, v in source.items()}
    load_quantized(model, new.items())
    layer = model.body[0]
    torch.testing.assert_close(dequantize(layer.weight, layer.weight_scale), new["body.0.weight"], atol=0.1, rtol=0.07)
    torch.testing.assert_close(layer.bias, new["body.0.bias"])
    torch.testing.assert_close(model.head.weight, new["head.weight"])


def test_config_fp8_turns_tis_on_unless_a_correction_is_set():
    cfg = build_config(RLConfig, "rl", {"rollout.fp8": True})
    assert cfg.off_policy.tis_cap == 2.0
    assert build_config(RLConfig, "rl", {"rollout.fp8": True, "off_policy.tis_cap": 3.0}).off_policy.tis_cap == 3.0
    mis = build_config(RLConfig, "rl", {"rollout.fp8": True, "off_policy.mis_threshold": 2.0})
    assert mis.off_policy.tis_cap == 0.0
    assert build_config(RLConfig, "rl", {}).off_policy.tis_cap == 0.0


@pytest.mark.parametrize("setting,value,words", [
    ("rollout.engine", "vllm", "needs rollout.engine static or hf"),
    ("lora_rank", 8, "without LoRA adapters"),
    ("rollout.parity", True, "exclude each other"),
    ("off_policy.recompute_old_logprobs", False, "recompute_old_logprobs: true"),
])
def test_config_fp8_refusals_name_the_setting(setting, value, words):
    values = {"rollout.fp8": True, setting: value}
    if setting == "rollout.parity":
        values["rollout.engine"] = "hf"
    with pytest.raises(ConfigError, match=r"rl\.rollout\.fp8: .*" + words):
        build_config(RLConfig, "rl", values)


def test_devices_without_fp8_products_are_named(monkeypatch):
    assert "CUDA GPU of compute capability 8.9 or newer" in fp8_unsupported(torch.device("cpu"))
    assert fp8_unsupported(torch.device("cpu")).endswith("runs on the CPU")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100")
    assert fp8_unsupported(torch.device("cuda")).endswith("NVIDIA A100 is 8.0")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    assert fp8_unsupported(torch.device("cuda")) is None
