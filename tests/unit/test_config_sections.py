"""rl's fields in sections (``rl.kl.coef``): the old flat names read through ``RENAMED`` with a notice, ``--set``
in either spelling, dotted MLflow params, ``alignflow diff`` across the rename, and params files that hold only
what differs from the defaults."""

from __future__ import annotations

import logging

import pytest

from conftest import REPO
from rlhf_core.config import (RENAMED, SECTIONS, ConfigError, RLConfig, build_config, config_params, load_config,
                              read_params, section_fields)

PARAMS_FILES = [REPO / "params.yaml", REPO / "flows" / "project_template" / "params.yaml"]


def _flat(cls: type, values: dict) -> dict:
    """A section's values, a section within it (``kl: {coef: ..}``) as dotted keys."""
    inner = section_fields(cls)
    out = {}
    for key, value in values.items():
        if key in inner and isinstance(value, dict):
            out.update({f"{key}.{k}": v for k, v in value.items()})
        else:
            out[key] = value
    return out


@pytest.mark.parametrize("path", PARAMS_FILES, ids=lambda p: str(p.relative_to(REPO)))
def test_shipped_params_files_hold_only_what_differs_from_the_defaults(path):
    for section, values in read_params(path).items():
        cls = SECTIONS[section]
        defaults = config_params(cls())
        ran = config_params(build_config(cls, section, values or {}))  # whole: fields may bound each other
        for key, value in _flat(cls, values or {}).items():
            renamed = getattr(cls, "renamed", {})
            assert key not in renamed, f"{path.name}: {section}.{key} is an old name; write {section}.{renamed[key]}"
            assert ran[key] != defaults[key], (f"{path.name}: {section}.{key}: {value!r} is the default; "
                                               "leave it out (params.yaml holds only what differs)")


def test_an_old_flat_key_is_read_as_its_new_one_with_a_notice(tmp_path, caplog):
    params = tmp_path / "params.yaml"
    params.write_text("rl:\n  kl_coef: 0.2\n  rollout_engine: hf\n  environment: env.py:make_env\n")
    with caplog.at_level(logging.WARNING, logger="rlhf_core.config.base"):
        cfg = load_config(RLConfig, "rl", params)
    assert (cfg.kl.coef, cfg.rollout.engine, cfg.environment.spec) == (0.2, "hf", "env.py:make_env")
    assert f"{params}: rl.kl_coef is now rl.kl.coef" in caplog.text
    assert "rl.environment is now rl.environment.spec" in caplog.text
    nested = tmp_path / "nested.yaml"
    nested.write_text("rl:\n  kl: {coef: 0.2}\n  rollout: {engine: hf}\n  environment: {spec: env.py:make_env}\n")
    assert load_config(RLConfig, "rl", nested) == cfg


def test_a_value_that_cannot_be_mapped_names_file_section_field_and_new_key(tmp_path):
    params = tmp_path / "params.yaml"
    params.write_text("rl:\n  environment: {path: env.py:make_env}\n")
    with pytest.raises(ConfigError, match=r"params.yaml: rl.environment.path: unknown field.*rl.environment.spec"):
        load_config(RLConfig, "rl", params)
    params.write_text("rl:\n  kl: 0.2\n")
    with pytest.raises(ConfigError, match=r"params.yaml: rl.kl: a section of fields \(coef, "):
        load_config(RLConfig, "rl", params)
    params.write_text("rl:\n  kl_coef: 0.2\n  kl: {coef: 0.3}\n")
    with pytest.raises(ConfigError, match=r"rl.kl.coef is given twice, as rl.kl_coef and rl.kl.coef"):
        load_config(RLConfig, "rl", params)
    with pytest.raises(ConfigError, match=r"rl.kl_coeff: unknown field; did you mean rl.kl.coef\?"):
        build_config(RLConfig, "rl", {"kl_coeff": 0.2})


def test_checks_name_the_dotted_key_and_blame_an_override(tmp_path):
    with pytest.raises(ConfigError, match=r"^<overrides>: rl.kl.coef: must be >= 0"):
        build_config(RLConfig, "rl", {"kl": {"coef": -1}})
    params = tmp_path / "params.yaml"
    params.write_text("tool_rl:\n  kl: {adaptive: true}\n")
    with pytest.raises(ConfigError, match=r"^command line \(--set\): tool_rl.kl.coef: must be > 0 with kl.adaptive"):
        load_config(RLConfig, "tool_rl", params, {"kl.coef": 0.0})


def test_set_takes_the_dotted_name_the_section_prefix_and_the_old_name(caplog):
    from flows.cli import stage_overrides

    for pairs in (["kl.coef=0.2"], ["rl.kl.coef=0.2"], ["kl_coef=0.2"]):
        overrides = stage_overrides(pairs, "rl", "rl")
        assert load_config(RLConfig, "rl", None, overrides).kl.coef == 0.2, pairs
    assert "command line (--set): rl.kl_coef is now rl.kl.coef" in caplog.text
    assert stage_overrides(["distill.reward_coef=0.5"], "rl", "rl") == {"distill.reward_coef": 0.5}
    with pytest.raises(ConfigError, match="sets fields of section 'rl'"):
        stage_overrides(["kto.beta=0.5"], "rl", "rl")


def test_mlflow_params_are_dotted_and_the_rename_table_covers_every_section_field():
    params = config_params(RLConfig())
    assert params["kl.coef"] == 0.1 and params["rollout.engine"] == "static" and "kl" not in params
    new = {f"{name}.{f}" for name, cls in section_fields(RLConfig).items() for f in cls.__dataclass_fields__}
    assert set(RENAMED.values()) == new and len(RENAMED) == len(new)


def test_diff_compares_an_old_name_with_its_new_one_row_by_row():
    from flows.diff import compare

    a = {"params": {"kl_coef": "0.1", "temperature": "1.0", "lr": "0.1"}, "tags": {}, "metrics": {}}
    b = {"params": {"kl.coef": "0.2", "rollout.temperature": "1.0", "lr": "0.1"}, "tags": {}, "metrics": {}}
    rows = {r.key: r.status for r in compare(a, b) if r.section == "params"}
    assert rows == {"kl.coef": "changed", "rollout.temperature": "same", "lr": "same"}
    # a name both runs logged stays as it is (another stage's temperature is not rl's)
    same = {"params": {"temperature": "1.0"}, "tags": {}, "metrics": {}}
    assert [r.key for r in compare(same, same) if r.section == "params"] == ["temperature"]


def test_reproduce_reviews_a_field_within_a_section_by_its_whole_name(tmp_path):
    from flows.reproduce_trust import review_config

    commit = {"rl": {"kl": {"coef": 0.1}, "reward": {"token_env": "", "function": "a.py:reward"}}}
    old_record = {"rl": {"kl_coef": 0.1, "reward_token_env": "", "reward_function": "a.py:reward"}}
    assert review_config(old_record, commit, tmp_path).differences == []  # old names read as the new ones
    stored = {"rl": {"kl": {"coef": 0.1}, "reward": {"token_env": "OTHER_TOKEN", "function": "a.py:reward"}}}
    review = review_config(stored, commit, tmp_path)
    assert review.untrusted == ['rl.reward.token_env: "OTHER_TOKEN" (stored) vs "" (commit)  '
                                '[secret (an environment variable name)]']
