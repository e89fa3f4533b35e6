"""The pieces of a LoRA policy's adapter-only sync that need no engine: a policy's adapter names as a PEFT adapter
file spells them, the folder vLLM loads, and the bytes a sync reports (``perf/weight_sync_bytes``)."""

from __future__ import annotations

import json

import torch
from safetensors.torch import load_file

from rlhf_core.rollout.engine import tensor_bytes
from rlhf_core.rollout.vllm import is_adapter_state, peft_adapter_name, write_peft_adapter
from rlhf_core.trainers.rl_parts import PhaseTimes


def test_a_policy_adapter_name_becomes_peft_s_file_name():
    """peft injected into the model itself names ``<module>.lora_A.default.weight``; its saved adapters (what vLLM
    reads) drop the adapter name and sit under ``base_model.model.``."""
    assert (peft_adapter_name("model.layers.0.self_attn.q_proj.lora_A.default.weight")
            == "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight")
    assert (peft_adapter_name("base_model.model.model.layers.1.mlp.down_proj.lora_B.default.weight")
            == "base_model.model.model.layers.1.mlp.down_proj.lora_B.weight")
    assert is_adapter_state({"m.q_proj.lora_A.default.weight": torch.zeros(1)})
    assert not is_adapter_state({"m.q_proj.lora_A.default.weight": torch.zeros(1), "m.q_proj.weight": torch.zeros(1)})
    assert not is_adapter_state({})


def test_the_adapter_folder_holds_the_tensors_rank_alpha_and_modules(tmp_path):
    """Rank 4 adapters on q_proj and down_proj (A: ``(r, in)``, B: ``(out, r)``): the folder's config names rank 4,
    the given alpha and both modules, its tensors are the policy's under PEFT's names, and the bytes returned are
    theirs: 4 tensors x 4 x 8 fp32 values x 4 bytes = 512."""
    weights = {f"model.layers.0.{m}.lora_{ab}.default.weight": torch.randn(4, 8) if ab == "A" else torch.randn(8, 4)
               for m in ("self_attn.q_proj", "mlp.down_proj") for ab in "AB"}
    moved = write_peft_adapter(weights, tmp_path / "adapter", lora_alpha=8.0)
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert (config["r"], config["lora_alpha"], config["target_modules"]) == (4, 8.0, ["down_proj", "q_proj"])
    saved = load_file(str(tmp_path / "adapter" / "adapter_model.safetensors"))
    assert saved.keys() == {peft_adapter_name(k) for k in weights}
    assert all(torch.equal(saved[peft_adapter_name(k)], v) for k, v in weights.items())
    assert moved == tensor_bytes(weights) == 512


def test_sync_bytes_are_tallied_beside_the_phase_seconds():
    """Two syncs in one iteration (asynchronous training can push twice): their bytes add up, under their own name."""
    perf = PhaseTimes()
    perf.tally("perf/weight_sync_bytes", 512)
    perf.tally("perf/weight_sync_bytes", 256)
    assert perf.tallies == {"perf/weight_sync_bytes": 768.0}
    assert "perf/weight_sync_bytes" not in perf.seconds
    assert tensor_bytes({"a": torch.zeros(3, dtype=torch.bfloat16), "b": "not a tensor"}) == 6
