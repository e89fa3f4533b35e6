"""docs/configuration.md is generated from the config dataclasses (scripts/config_reference.py) and committed:
this fails when the two differ, i.e. when a field, type, default or field docstring changed without the
reference being regenerated."""

from __future__ import annotations

import dataclasses
import importlib.util
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def _generator():
    spec = importlib.util.spec_from_file_location("config_reference", REPO / "scripts" / "config_reference.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_committed_reference_equals_the_generated_one():
    generator = _generator()
    committed = (REPO / "docs" / "configuration.md").read_text(encoding="utf-8")
    assert committed == generator.render(), (
        f"docs/configuration.md differs from the config dataclasses; regenerate it: {generator.REGENERATE}")


def test_every_section_and_field_is_in_the_reference():
    from rlhf_core.config import SECTIONS, section_fields

    text = _generator().render()
    for section, cls in SECTIONS.items():
        assert f"\n## {section}\n" in text, section
    for cls in set(SECTIONS.values()):
        inner = section_fields(cls)
        for field in dataclasses.fields(cls):
            if field.init and field.name not in inner:
                assert f"| `{field.name}` |" in text, (cls.__name__, field.name)
        for name, section in inner.items():  # rl's sections: a table each, fields dotted (kl.coef)
            assert f"\n### {name}\n" in text, (cls.__name__, name)
            for field in dataclasses.fields(section):
                assert f"| `{name}.{field.name}` |" in text, (cls.__name__, name, field.name)
