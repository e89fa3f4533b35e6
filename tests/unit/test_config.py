"""Typed configs: shipped params load; bad values and keys give errors naming file, section and field."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import yaml

from conftest import REPO
from rlhf_core.config import (
    SECTIONS,
    ConfigError,
    SFTConfig,
    build_config,
    field_docs,
    load_config,
    parse_overrides,
    read_params,
)


def test_shipped_params_yaml_loads_every_section():
    raw = read_params(REPO / "params.yaml")
    assert set(raw) == set(SECTIONS)
    for section, cls in SECTIONS.items():
        cfg = load_config(cls, section, REPO / "params.yaml")
        assert isinstance(cfg, cls)


def test_every_field_has_a_docstring():
    for cls in SECTIONS.values():
        docs = field_docs(cls)
        missing = [f.name for f in dataclasses.fields(cls) if f.name not in docs]
        assert not missing, (cls.__name__, missing)


def test_overrides_parse_yaml_scalars():
    assert parse_overrides(["lr=0.5", "packing=true", "output_dir=out/x", "max_steps=10"]) == {
        "lr": 0.5, "packing": True, "output_dir": "out/x", "max_steps": 10}
    # YAML 1.1 reads 3e-4 as a string; the float field still accepts it
    assert build_config(SFTConfig, "sft", parse_overrides(["lr=3e-4"])).lr == 3e-4
    with pytest.raises(ConfigError, match="expected field=value"):
        parse_overrides(["lr"])


def test_invalid_value_names_section_and_field(tmp_path):
    params = tmp_path / "params.yaml"
    params.write_text(yaml.safe_dump({"sft": {"lr": -1.0}}))
    with pytest.raises(ConfigError, match=r"params.yaml: sft.lr: must be > 0, got -1.0"):
        load_config(SFTConfig, "sft", params)


def test_unknown_field_and_section(tmp_path):
    params = tmp_path / "params.yaml"
    params.write_text(yaml.safe_dump({"sft": {"learning_rate": 0.1}}))
    with pytest.raises(ConfigError, match=r"params.yaml: sft.learning_rate: unknown field; did you mean sft.lr\?"):
        load_config(SFTConfig, "sft", params)
    params.write_text(yaml.safe_dump({"sft": {"max_step": 10}}))  # a typo: the closest field (difflib)
    with pytest.raises(ConfigError, match=r"params.yaml: sft.max_step: unknown field; did you mean sft.max_steps\?"):
        load_config(SFTConfig, "sft", params)
    params.write_text(yaml.safe_dump({"sft": {"zzz": 1}}))  # nothing close: the known fields, clipped
    with pytest.raises(ConfigError, match=r"sft.zzz: unknown field; known fields are attention, batch_size, .*\(\d+ in all\)$"):
        load_config(SFTConfig, "sft", params)
    params.write_text(yaml.safe_dump({"sftt": {}}))
    with pytest.raises(ConfigError, match=r"unknown section\(s\) \['sftt'\]"):
        read_params(params)


def test_an_error_names_the_command_line_for_an_override_and_the_file_otherwise(tmp_path):
    """The same mistake blames where it was made: an override names the command line, a params value the file."""
    params = tmp_path / "params.yaml"
    params.write_text(yaml.safe_dump({"sft": {"max_steps": 10}}))
    with pytest.raises(ConfigError, match=r"^command line \(--set\): sft.max_step: unknown field"):
        load_config(SFTConfig, "sft", params, {"max_step": 5})
    with pytest.raises(ConfigError, match=r"^command line \(--set\): sft.lr: must be > 0"):
        load_config(SFTConfig, "sft", params, {"lr": -1.0})
    with pytest.raises(ConfigError, match=r"^command line \(--set\): sft.max_steps: expected an integer"):
        load_config(SFTConfig, "sft", params, {"max_steps": "many"})
    params.write_text(yaml.safe_dump({"sft": {"lr": -1.0}}))
    with pytest.raises(ConfigError, match=r"params.yaml: sft.lr: must be > 0"):
        load_config(SFTConfig, "sft", params, {"max_steps": 5})


def test_wrong_types_rejected():
    with pytest.raises(ConfigError, match=r"sft.max_steps: expected an integer, got 'many'"):
        build_config(SFTConfig, "sft", {"max_steps": "many"})
    with pytest.raises(ConfigError, match=r"sft.packing: expected true or false"):
        build_config(SFTConfig, "sft", {"packing": "yes please"})
    with pytest.raises(ConfigError, match=r"sft.precision: must be one of auto, fp32, mixed, bf16"):
        build_config(SFTConfig, "sft", {"precision": "fp8"})


def test_gpu_speed_switches_are_checked():
    """gradient_checkpointing reads true/false as on/off (older params files); the other switches are closed sets."""
    assert build_config(SFTConfig, "sft", {"gradient_checkpointing": True}).gradient_checkpointing == "on"
    assert build_config(SFTConfig, "sft", {"gradient_checkpointing": False}).gradient_checkpointing == "off"
    assert build_config(SFTConfig, "sft", {}).gradient_checkpointing == "auto"
    with pytest.raises(ConfigError, match=r"sft.gradient_checkpointing: must be one of auto, on, off, got 'sometimes'"):
        build_config(SFTConfig, "sft", {"gradient_checkpointing": "sometimes"})
    with pytest.raises(ConfigError, match=r"sft.lm_head: must be one of auto, chunked, liger, full"):
        build_config(SFTConfig, "sft", {"lm_head": "fused"})
    assert build_config(SFTConfig, "sft", {"fused_kernels": yaml.safe_load("off")}).fused_kernels == "off"
    with pytest.raises(ConfigError, match=r"sft.fused_kernels: must be one of auto, on, off"):
        build_config(SFTConfig, "sft", {"fused_kernels": "triton"})
    with pytest.raises(ConfigError, match=r"sft.micro_batch_tokens: a token budget needs packing: true"):
        build_config(SFTConfig, "sft", {"micro_batch_tokens": 4096})
    assert build_config(SFTConfig, "sft", {"micro_batch_tokens": 4096, "packing": True}).micro_batch_tokens == 4096
    # rl.packing also takes auto, its default, from a params file or --set (parse_overrides) as from Python
    from rlhf_core.config import RLConfig, parse_overrides

    assert build_config(RLConfig, "rl", {}).packing == "auto"
    assert build_config(RLConfig, "rl", parse_overrides(["packing=auto"])).packing == "auto"
    assert build_config(RLConfig, "rl", parse_overrides(["packing=true"])).packing is True
    assert build_config(RLConfig, "rl", {"packing": False}).packing is False
    with pytest.raises(ConfigError, match=r"rl.packing: must be auto, true or false, got 'sometimes'"):
        build_config(RLConfig, "rl", {"packing": "sometimes"})


def test_broken_yaml_names_line(tmp_path):
    params = tmp_path / "params.yaml"
    params.write_text("sft:\n  lr: [1,\n")
    with pytest.raises(ConfigError, match=r"params.yaml: line \d+: not valid YAML"):
        read_params(params)


def test_scale_out_fields_are_checked():
    """Worker counts, strategies and placements a user could mistype fail with section.field."""
    from rlhf_core.config import ConfigError, RLConfig, SFTConfig

    with pytest.raises(ConfigError, match=r"sft.parallel: must be ddp, zero2 or zero3"):
        SFTConfig(parallel="fsdp")
    with pytest.raises(ConfigError, match=r"sft.batch_size: must be >= num_workers"):
        SFTConfig(num_workers=4, batch_size=2)
    with pytest.raises(ConfigError, match=r"sft.offload_optimizer: needs parallel zero2 or zero3"):
        SFTConfig(offload_optimizer=True)
    with pytest.raises(ConfigError, match=r"rl.num_workers: 2 policy workers need Ray"):
        RLConfig(num_workers=2)
    with pytest.raises(ConfigError, match=r"rl.distribution.placement: must be none, colocated or disaggregated"):
        build_config(RLConfig, "rl", {"distribution.placement": "spread"})
    # one process's engine would sample from ZeRO-3's empty placeholders (a size-0 reshape on an H200, 2026-12-03)
    with pytest.raises(ConfigError, match=r"rl.parallel: zero3 partitions the policy's weights.*placement colocated"):
        RLConfig(parallel="zero3")
    assert build_config(RLConfig, "rl", {"parallel": "zero3",
                                         "distribution.placement": "colocated"}).parallel == "zero3"
    assert RLConfig(parallel="zero2").distribution.placement == "none"  # ZeRO-2 keeps whole weights on every rank


def test_rollout_sleep_is_checked_and_resolved_by_where_it_can_work():
    """rl.rollout.sleep is auto, on or off; on needs colocated replicas of the hf or static engine that take whole
    weights (no LoRA); auto turns it on only with GPUs and only where on would be accepted."""
    from rlhf_core.config import ConfigError, RLConfig
    from rlhf_core.trainers.rl_on_ray import resolve_rollout_sleep

    colocated = build_config(RLConfig, "rl", {"distribution.placement": "colocated", "rollout.sleep": "on"})
    assert resolve_rollout_sleep(colocated, gpus=False) and resolve_rollout_sleep(colocated, gpus=True)
    assert not resolve_rollout_sleep(build_config(RLConfig, "rl", {"distribution.placement": "colocated"}),
                                     gpus=False)  # CPUs: nothing to gain
    assert resolve_rollout_sleep(build_config(RLConfig, "rl", {"distribution.placement": "colocated"}), gpus=True)
    for kw in ({"distribution.placement": "disaggregated"}, {"distribution.placement": "colocated", "lora_rank": 4},
               {"distribution.placement": "colocated", "rollout.engine": "vllm"},
               {"distribution.placement": "colocated", "rollout.sleep": "off"}):
        assert not resolve_rollout_sleep(build_config(RLConfig, "rl", kw), gpus=True), kw
    with pytest.raises(ConfigError, match=r"rl.rollout.sleep: must be auto, on or off, got 'yes'"):
        build_config(RLConfig, "rl", {"rollout.sleep": "yes"})
    with pytest.raises(ConfigError, match=r"rl.rollout.sleep: on frees colocated Ray replicas' weights"):
        build_config(RLConfig, "rl", {"rollout.sleep": "on", "distribution.placement": "disaggregated"})
    with pytest.raises(ConfigError, match=r"rl.rollout.sleep: on needs a sync of the whole weights"):
        build_config(RLConfig, "rl", {"rollout.sleep": "on", "distribution.placement": "colocated", "lora_rank": 4})
    with pytest.raises(ConfigError, match=r"rl.rollout.sleep: on needs the hf or static engine"):
        build_config(RLConfig, "rl", {"rollout.sleep": "on", "distribution.placement": "colocated",
                                      "rollout.engine": "vllm"})


def test_rl_policy_objective_and_its_clip_fields():
    """policy_objective is one of the enum's values; GSPO's bounds are checked like PPO's; dual clip, which
    bounds PPO's unclipped branch, is refused for cispo (its clipped weight has no such branch)."""
    from rlhf_core.config import RLConfig

    assert RLConfig().algorithm.policy_objective == "ppo_clip"
    assert (RLConfig().algorithm.gspo_clip_low, RLConfig().algorithm.gspo_clip_high) == (3e-4, 4e-4)
    assert build_config(RLConfig, "rl", {"algorithm.policy_objective": "gspo",
                                         "algorithm.dual_clip": 3.0}).algorithm.policy_objective == "gspo"
    with pytest.raises(ConfigError,
                       match=r"rl.algorithm.policy_objective: must be one of \['ppo_clip', 'gspo', 'cispo'\]"):
        build_config(RLConfig, "rl", {"algorithm.policy_objective": "grpo"})
    with pytest.raises(ConfigError, match=r"rl.algorithm.gspo_clip_low: must be in \[0, 1\), got 1.0"):
        build_config(RLConfig, "rl", {"algorithm.policy_objective": "gspo", "algorithm.gspo_clip_low": 1.0})
    with pytest.raises(ConfigError, match=r"rl.algorithm.gspo_clip_high: must be >= 0"):
        build_config(RLConfig, "rl", {"algorithm.gspo_clip_high": -1e-4})
    with pytest.raises(ConfigError, match=r"rl.algorithm.dual_clip: must be 0 with algorithm.policy_objective cispo"):
        build_config(RLConfig, "rl", {"algorithm.policy_objective": "cispo", "algorithm.dual_clip": 3.0})


def test_async_training_and_sequence_masking_fields_are_checked():
    """max_staleness is an integer >= 0 (0, the default, is synchronous); k >= 1 needs pi_old recomputed from the
    policy being updated and refuses colocated placement (its roles take turns on one GPU: nothing to overlap);
    mis_threshold is 0 (off) or a band edge > 1, and needs pi_old recomputed as well."""
    from rlhf_core.config import ConfigError, RLConfig

    assert (RLConfig().off_policy.max_staleness, RLConfig().off_policy.mis_threshold) == (0, 0.0)
    assert build_config(RLConfig, "rl", {"off_policy.max_staleness": 2, "distribution.placement": "disaggregated",
                                         "off_policy.mis_threshold": 2.0}).off_policy.max_staleness == 2
    with pytest.raises(ConfigError,
                       match=r"rl.off_policy.max_staleness: must be an integer >= 0 \(0 = synchronous\), got -1"):
        build_config(RLConfig, "rl", {"off_policy.max_staleness": -1})
    with pytest.raises(ConfigError,
                       match=r"rl.off_policy.max_staleness: needs off_policy.recompute_old_logprobs: true"):
        build_config(RLConfig, "rl", {"off_policy.max_staleness": 1, "off_policy.recompute_old_logprobs": False})
    with pytest.raises(ConfigError,
                       match=r"rl.off_policy.max_staleness: overlaps generation with the update, but colocated"):
        build_config(RLConfig, "rl", {"off_policy.max_staleness": 1, "distribution.placement": "colocated"})
    with pytest.raises(ConfigError, match=r"rl.off_policy.mis_threshold: must be 0 \(off\) or > 1"):
        build_config(RLConfig, "rl", {"off_policy.mis_threshold": 0.5})
    with pytest.raises(ConfigError,
                       match=r"rl.off_policy.mis_threshold: needs off_policy.recompute_old_logprobs: true"):
        build_config(RLConfig, "rl", {"off_policy.mis_threshold": 2.0, "off_policy.recompute_old_logprobs": False})


def test_on_policy_distillation_fields_are_checked():
    """estimator distill needs teacher_model_path; the teacher's fields need distill; distill refuses
    dynamic sampling (a reward tie says nothing of the teacher's signal); it runs under Ray placement too."""
    from rlhf_core.config import ConfigError, RLConfig

    cfg = build_config(RLConfig, "rl", {"algorithm.estimator": "distill",
                                        "distill.teacher_model_path": "models/teacher", "distill.reward_coef": 0.5,
                                        "kl.in_reward": True, "kl.estimator": "k1"})
    assert cfg.distill.teacher_model_path == "models/teacher" and cfg.distill.reward_coef == 0.5
    with pytest.raises(ConfigError, match=r"rl.distill.teacher_model_path: must name the teacher's model directory"):
        build_config(RLConfig, "rl", {"algorithm.estimator": "distill"})
    with pytest.raises(ConfigError, match=r"rl.distill.teacher_model_path: is only used by estimator distill"):
        build_config(RLConfig, "rl", {"distill.teacher_model_path": "models/teacher"})
    with pytest.raises(ConfigError, match=r"rl.distill.reward_coef: is only used by estimator distill"):
        build_config(RLConfig, "rl", {"distill.reward_coef": 1.0})
    with pytest.raises(ConfigError, match=r"rl.distill.reward_coef: must be >= 0"):
        build_config(RLConfig, "rl", {"algorithm.estimator": "distill", "distill.teacher_model_path": "t",
                                      "distill.reward_coef": -1.0})
    with pytest.raises(ConfigError, match=r"rl.dapo.dynamic_sampling: drops groups"):
        build_config(RLConfig, "rl", {"algorithm.estimator": "distill", "distill.teacher_model_path": "t",
                                      "dapo.dynamic_sampling": True})
    assert build_config(RLConfig, "rl", {"algorithm.estimator": "distill", "distill.teacher_model_path": "t",
                                         "distribution.placement": "colocated"}).distribution.placement == "colocated"


def test_compile_layers_switch_reads_yaml_booleans_and_resolves_by_setting():
    """``compile_layers``: bare on/off read as on/off; auto compiles on CUDA for one process or DDP only;
    on under ZeRO-3 is an error naming the field."""
    from rlhf_core.models.layer_compile import use_compiled_layers

    assert build_config(SFTConfig, "sft", {"compile_layers": yaml.safe_load("on")}).compile_layers == "on"
    with pytest.raises(ConfigError, match=r"sft.compile_layers: must be one of auto, on, off"):
        build_config(SFTConfig, "sft", {"compile_layers": "max"})
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert use_compiled_layers("auto", cuda, parallel="none", lora=False) == (True, "on (auto: CUDA)")
    assert use_compiled_layers("auto", cuda, parallel="ddp", lora=False)[0]
    assert use_compiled_layers("auto", cpu, parallel="none", lora=False) == (False, "off (auto: no CUDA device)")
    assert use_compiled_layers("auto", cuda, parallel="zero2", lora=False) == (False, "off (auto: ZeRO-2)")
    assert use_compiled_layers("auto", cuda, parallel="zero3", lora=False) == (False, "off (auto: ZeRO-3)")
    assert use_compiled_layers("auto", cuda, parallel="none", lora=True) == (False, "off (auto: LoRA adapters)")
    assert use_compiled_layers("on", cpu, parallel="zero2", lora=True) == (True, "on")
    assert use_compiled_layers("off", cuda, parallel="none", lora=False) == (False, "off")
    with pytest.raises(RuntimeError, match="compile_layers: on does not work with parallel: zero3"):
        use_compiled_layers("on", cuda, parallel="zero3", lora=False)
