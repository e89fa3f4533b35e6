"""A project that names its policy registry gets its SFT model registered under a matching name."""

from __future__ import annotations

from flows.params import load_all


def test_sft_registry_name_follows_the_policy_name():
    cfg = load_all(None, {"cycles": {"registered_model": "my-policy"}})
    assert cfg["tracking"].registered_model == "my-policy-sft"


def test_defaults_and_an_explicit_sft_name_are_kept():
    assert load_all(None, None)["tracking"].registered_model == "alignflow-sft"
    cfg = load_all(None, {"cycles": {"registered_model": "my-policy"}, "tracking": {"registered_model": "base-sft"}})
    assert cfg["tracking"].registered_model == "base-sft"
