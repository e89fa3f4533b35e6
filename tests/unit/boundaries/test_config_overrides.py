"""The config boundary: ``--set`` overrides (:func:`rlhf_core.config.parse_overrides`, the CLI's section
split) and params files (:func:`rlhf_core.config.read_params`, :func:`flows.params.load_all`).

Any ``key=value`` string and any params file, text or bytes, is either accepted as typed configs or
refused with a :class:`rlhf_core.config.ConfigError` whose message starts with its source: the command
line for an override, the params file's path for the file, and names the field where one is at fault.
Nothing else is raised, every input is decided within a second (YAML alias bombs and deep nesting are
bounded), and the params file's bytes are left as they were.
"""

from __future__ import annotations

import dataclasses
import time

import pytest
import yaml
from hypothesis import example, given
from hypothesis import strategies as st

from flows.cli import _section_overrides, stage_overrides
from flows.params import load_all
from rlhf_core.config import (MAX_YAML_DEPTH, OVERRIDE_SOURCE, SECTIONS, ConfigError, SFTConfig, build_config,
                              load_config, parse_overrides, read_params, section_fields)

FIELDS = sorted({(name, f.name) for name, cls in SECTIONS.items() for f in dataclasses.fields(cls)}
                | {(name, f"{inner}.{f.name}") for name, cls in SECTIONS.items()  # rl's kl.coef ...
                   for inner, section in section_fields(cls).items() for f in dataclasses.fields(section)})
SPECIAL = ["[", "]", "{a: 1}", "{", ".inf", "-.inf", ".nan", "1e999", "-1e999", "~", "null", "", " ", "yes", "no",
           "10" * 2200, "9" * 5000, str(2 ** 63), str(-2 ** 63), "0x1F", "0o17", "1_000", "2020-13-45", "2020-01-01",
           "*a", "&a 1", "!!binary aGk=", "!!python/object:os.system", "%YAML 1.1", "- a\n- b", "a: 1\na: 2",
           "1\n---\n2", "'unterminated", "\"\\x00\"", "a\x00b", "\x00", "\ufeff1", "é", "🚀", "[" * 5000, "[1, [2, [3]]]"]


def _yaml_values():
    """Values a params file or ``--set`` may carry: every YAML type, wrong ones for any field included."""
    scalars = st.one_of(st.none(), st.booleans(), st.integers(), st.integers(min_value=2 ** 60, max_value=10 ** 30),
                        st.floats(), st.text(max_size=20), st.sampled_from(["auto", "on", "fp32", "x.py:f"]))
    return st.recursive(scalars, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(
        st.text(max_size=5), inner, max_size=3), max_leaves=8)


load_all(None, None)  # its first call imports what every section's checks need: not part of any example's time


def _refused_by(source: str, action, *args):
    """``action(*args)``'s result, or None after a ConfigError that starts with ``source``, within a second."""
    start = time.perf_counter()
    try:
        return action(*args)
    except ConfigError as exc:
        assert str(exc).startswith(source), f"{exc} does not start with {source!r}"
        return None
    finally:
        assert time.perf_counter() - start < 1.0


pair_values = st.one_of(st.sampled_from(SPECIAL), st.text(max_size=30),
                        _yaml_values().map(lambda v: yaml.safe_dump(v, default_flow_style=True).strip()))
pair_keys = st.one_of(st.sampled_from([f"{s}.{f}" for s, f in FIELDS] + [f for _, f in FIELDS]),
                      st.text(max_size=12), st.sampled_from(["", " ", "sft.", ".lr", "nope.lr", "sft.lr.x"]))


@given(pairs=st.lists(st.one_of(st.tuples(pair_keys, pair_values).map("=".join), st.text(max_size=20)), max_size=4))
@example(pairs=["lr"]).via("no '='")
@example(pairs=["lr=" + "9" * 5000]).via("an int past Python's str() digit limit: ValueError from PyYAML")
@example(pairs=["lr=a\x00b"]).via("a NUL byte: PyYAML's ReaderError")
@example(pairs=["lr=[", "max_steps=2020-13-45"]).via("broken YAML, a date PyYAML cannot build")
@example(pairs=["lr=" + str(10 ** 400)]).via("an int past float's range: OverflowError in float()")
@example(pairs=["model_path=" + "1" * 5000]).via("a str field given an int str() refuses")
def test_a_stage_commands_overrides_are_typed_or_refused_naming_the_command_line(pairs):
    overrides = _refused_by(OVERRIDE_SOURCE, lambda: stage_overrides(pairs, "sft", "sft"))
    if overrides is not None:
        config = _refused_by(OVERRIDE_SOURCE, load_config, SFTConfig, "sft", None, overrides)
        assert config is None or isinstance(config, SFTConfig)


@given(pairs=st.lists(st.tuples(pair_keys, pair_values).map("=".join), max_size=4))
@example(pairs=["x.1=2", "sft.lr=3", "sft.lr=[1, 2]"])
@example(pairs=["reward.num_workers=33"]).via("a cross-field check the override broke (batch_size >= num_workers)")
def test_a_flows_overrides_are_typed_or_refused_naming_the_command_line(pairs):
    overrides = _refused_by(OVERRIDE_SOURCE, _section_overrides, pairs)
    if overrides is not None:
        _refused_by(OVERRIDE_SOURCE, load_all, None, overrides)


@given(field=st.sampled_from(FIELDS), value=_yaml_values())
@example(field=("model", "added_tokens"), value=5).via("a list[str] field given an int: TypeError")
@example(field=("flow", "stages"), value=[1, [2]])
@example(field=("guards", "advisory_guards"), value=[["a"]]).via("an unhashable item: TypeError")
@example(field=("rl", "environment.stop_tokens"), value=None)
@example(field=("rl", "environment"), value={"path": "env.py:f"}).via("a section given a field it does not have")
@example(field=("tool_guards", "advisory_guards"), value=[0]).via("a check of guards' fields under tool_guards")
@example(field=("sft", "seed"), value=10 ** 5000).via("an int no message can print")
@example(field=("sft", "packing"), value=10 ** 5000)
@example(field=("sft", "num_workers"), value=129).via("a cross-field check naming batch_size first")
def test_a_fields_value_is_typed_or_refused_naming_the_field(field, value):
    section, name = field
    try:
        build_config(SECTIONS[section], section, {name: value}, "params.yaml")
    except ConfigError as exc:  # a cross-field check names its partner first: "sft.batch_size: must be >= num_workers"
        assert str(exc).startswith(f"params.yaml: {section}.") and name in str(exc), exc
        return
    with pytest.raises(ConfigError, match=rf"^{OVERRIDE_SOURCE.replace('(', '[(]').replace(')', '[)]')}: "):
        build_config(SECTIONS[section], section, {name: value, "no_such_field": 1}, "params.yaml",
                     overridden={"no_such_field"})


def _bomb(levels: int) -> str:
    lines = ['l0: &l0 ["x", "x", "x", "x", "x", "x", "x", "x", "x", "x"]']
    lines += [f"l{i}: &l{i} [" + ", ".join([f"*l{i - 1}"] * 10) + "]" for i in range(1, levels)]
    return "\n".join(lines).replace("l", "sft_l") + "\n"


def _params_texts():
    """Params files: typed sections of wrong values, and hostile text."""
    sections = st.dictionaries(st.sampled_from(sorted(SECTIONS)) | st.text(max_size=6),
                               st.dictionaries(st.sampled_from([f for _, f in FIELDS]) | st.text(max_size=6),
                                               _yaml_values(), max_size=3) | _yaml_values(), max_size=3)
    hostile = st.one_of(
        st.integers(1, 3 * MAX_YAML_DEPTH).map(lambda d: "sft:\n  lr: " + "[" * d + "1" + "]" * d + "\n"),
        st.integers(2, 9).map(_bomb).map(lambda t: t + "sft: {model_path: *sft_l1}\n"),
        st.sampled_from(["sft:\n  lr: 1\n  lr: 2\n", "sft: 3\n", "- sft\n", "{1: 2}\n", "sft: {1: 2}\n", "[" * 5000,
                         "sft:\n\tlr: 1\n", "sft: {lr: !!python/name:os.system }\n", "\x00", "sft: &a [*a]\n"]))
    return st.one_of(sections.map(lambda d: yaml.safe_dump(d, allow_unicode=True)), hostile, st.text(max_size=60),
                     sections.map(lambda d: yaml.safe_dump(d) + yaml.safe_dump(d)))  # keys given twice


@given(content=st.one_of(_params_texts().map(lambda t: t.encode("utf-8", "surrogatepass")), st.binary(max_size=60)))
@example(content=b"\xff\xfe\x00").via("bytes that are not UTF-8: UnicodeDecodeError")
@example(content=b"sft: 3\n").via("a section that is no mapping: TypeError in load_config")
@example(content=b"{1: 2, a: 3}\n").via("a non-string section name: TypeError sorting the unknown ones")
@example(content=b"sft: {1: 2}\n").via("a non-string field name: TypeError in difflib")
@example(content=b"[" * 5000).via("deep nesting: RecursionError in PyYAML's composer")
@example(content=(_bomb(9) + "sft: {model_path: *sft_l8}\n").encode()).via("a billion laughs")
def test_a_params_file_is_read_or_refused_naming_itself_and_left_unchanged(tmp_path_factory, content):
    path = tmp_path_factory.mktemp("params") / "params.yaml"
    path.write_bytes(content)
    raw = _refused_by(str(path), read_params, path)
    if raw is not None:
        _refused_by(str(path), load_all, str(path), None)
        _refused_by(str(path), load_config, SFTConfig, "sft", path, None)
    assert path.read_bytes() == content


def test_a_params_file_that_is_a_directory_is_refused_naming_it(tmp_path):
    with pytest.raises(ConfigError, match=f"^{tmp_path}: cannot read the params file"):
        read_params(tmp_path)


def test_anchors_and_merge_keys_still_read():
    assert parse_overrides(["lr=&a 0.5"]) == {"lr": 0.5}
    text = "sft: &d {lr: 0.5, max_steps: 3}\ntool_sft:\n  <<: *d\n  lr: 0.25\n"
    from rlhf_core.config.base import _load_yaml
    assert _load_yaml(text, "p")["tool_sft"] == {"lr": 0.25, "max_steps": 3}
