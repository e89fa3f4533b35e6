"""The bucket helpers of the collective weight sync (rlhf_core/distributed/weight_sync.py) on hand-made tensors, the one place
``rl.distribution.weight_sync: auto`` is decided, and the config's checks. The group itself: tests/model/test_weight_sync.py."""

from __future__ import annotations

import pytest
import torch

from rlhf_core.config import ConfigError, RLConfig, build_config
from rlhf_core.distributed.weight_sync import (SyncPath, TensorSpec, WeightSync, bucket_views, buffer_numels, flatten_bucket,
                                   plan_layout, resolve_path, unflatten_bucket)


def test_plan_layout_keeps_order_and_fits_the_byte_budget_in_the_sent_dtype():
    """Sizes 6, 4, 10, 2 elements sent as bf16 (2 bytes) under a 20-byte budget = 10 elements a bucket:
    [6, 4] (10), [10] (10), [2]; sent as fp32 (5 elements a bucket) each tensor is alone, the 6- and
    10-element ones over the budget in buckets of their own."""
    named = [("a", (2, 3), torch.float32), ("b", (4,), torch.float32), ("c", (10,), torch.float32),
             ("d", (1, 2), torch.float32)]
    bf16 = plan_layout(named, 20, torch.bfloat16)
    assert [[s.name for s in b] for b in bf16] == [["a", "b"], ["c"], ["d"]]
    assert all(s.dtype == torch.bfloat16 for b in bf16 for s in b)
    assert [[s.name for s in b] for b in plan_layout(named, 20)] == [["a"], ["b"], ["c"], ["d"]]
    assert buffer_numels(bf16) == {torch.bfloat16: 10}


def test_flatten_then_unflatten_gives_every_tensor_back_bitwise_and_casts_to_the_sent_dtype():
    """Two dtypes in one bucket: each gets one flat buffer, tensors packed in layout order (fp32 a:6 then
    c:4 -> 10 elements; fp16 b:5); the unflattened views equal the inputs exactly (cast where asked)."""
    g = torch.Generator().manual_seed(0)
    a, b, c = torch.randn(2, 3, generator=g), torch.randn(5, generator=g, dtype=torch.float64), torch.randn(4, 1, generator=g)
    bucket = [TensorSpec("a", (2, 3), torch.float32), TensorSpec("b", (5,), torch.float16),
              TensorSpec("c", (4, 1), torch.float32)]
    buffers = {torch.float32: torch.full((16,), float("nan")), torch.float16: torch.zeros(8, dtype=torch.float16)}
    flats = flatten_bucket([a, b, c], bucket, buffers)
    assert {d: f.numel() for d, f in flats.items()} == {torch.float32: 10, torch.float16: 5}
    assert torch.equal(flats[torch.float32], torch.cat([a.reshape(-1), c.reshape(-1)]))
    # a receiver fills the same prefixes of buffers of its own, then reads views of them
    received = {d: torch.empty_like(t) for d, t in buffers.items()}
    for d, view in bucket_views(bucket, received).items():
        view.copy_(flats[d])
    out = unflatten_bucket(bucket_views(bucket, received), bucket)
    assert torch.equal(out["a"], a) and torch.equal(out["c"], c)
    assert out["b"].dtype == torch.float16 and torch.equal(out["b"], b.to(torch.float16))
    assert out["a"].data_ptr() == received[torch.float32].data_ptr()  # views, no copies
    with pytest.raises(ValueError, match="a has shape"):
        flatten_bucket([a.T, b, c], bucket, buffers)


@pytest.mark.parametrize("choice, gpus, colocated, lora, engine, path", [
    ("auto", False, False, False, "static", SyncPath.OBJECT_STORE),
    ("auto", True, True, False, "static", SyncPath.BESIDE),
    ("auto", True, False, False, "static", SyncPath.COLLECTIVE),
    ("auto", True, False, True, "static", SyncPath.OBJECT_STORE),
    ("auto", True, False, False, "vllm", SyncPath.OBJECT_STORE),
    ("collective", False, False, False, "hf", SyncPath.COLLECTIVE),
    ("object_store", True, True, False, "static", SyncPath.OBJECT_STORE),
])
def test_auto_picks_ipc_beside_collective_apart_object_store_on_cpus(choice, gpus, colocated, lora, engine, path):
    assert resolve_path(WeightSync(choice), gpus=gpus, colocated=colocated, lora=lora, engine=engine) is path


def test_config_rejects_an_unknown_sync_and_collective_where_it_cannot_work():
    base = {"prompts_file": "p.jsonl", "distribution.placement": "disaggregated"}
    assert build_config(RLConfig, "rl", {**base,
                                         "distribution.weight_sync": "collective"}).distribution.weight_sync == "collective"
    with pytest.raises(ConfigError, match="rl.distribution.weight_sync: must be one of"):
        build_config(RLConfig, "rl", {**base, "distribution.weight_sync": "nccl"})
    with pytest.raises(ConfigError, match="placement none"):
        build_config(RLConfig, "rl", {"prompts_file": "p.jsonl", "distribution.weight_sync": "collective"})
    with pytest.raises(ConfigError, match="LoRA"):
        build_config(RLConfig, "rl", {**base, "distribution.weight_sync": "collective", "lora_rank": 4})
