"""alignflow's own environment variables are the project folder, the profile (where runs are tracked, not how they
compute), the nightly alerts' webhook URL (a credential, like PGPASSWORD: never a params field, which every run logs)
and the test-only fault hooks: every other choice
of how a run computes is a config field, recorded in the run's lineage. Every ``ALIGNFLOW_*`` name in the sources
of ``rlhf_core/``, ``flows/`` and ``tasks/`` must be one of those, and listed in docs/operations.md's
"Environment variables" section."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
NAME = re.compile(r"\bALIGNFLOW_[A-Z_]+\b")
ALLOWED = {"ALIGNFLOW_HOME", "ALIGNFLOW_PROFILE", "ALIGNFLOW_NOTIFY_WEBHOOK", "ALIGNFLOW_FAULT", "ALIGNFLOW_FAULT_RANK",
           "ALIGNFLOW_FAULT_SIGNAL"}


def _names_in_sources() -> dict[str, list[str]]:
    found: dict[str, list[str]] = {}
    for package in ("rlhf_core", "flows", "tasks"):
        for path in sorted((ROOT / package).rglob("*.py")):
            for name in set(NAME.findall(path.read_text(encoding="utf-8"))):
                found.setdefault(name, []).append(str(path.relative_to(ROOT)))
    return found


def _doc_section() -> str:
    text = (ROOT / "docs" / "operations.md").read_text(encoding="utf-8")
    start = text.index("\n## Environment variables\n")
    end = text.find("\n## ", start + 1)
    return text[start:end if end != -1 else len(text)]


def test_only_the_allowed_variables_are_read():
    found = _names_in_sources()
    unknown = {name: where for name, where in found.items() if name not in ALLOWED}
    assert not unknown, (f"environment switches {unknown}: make each a config field (so it is in the run's "
                         f"lineage) or remove it; alignflow's own variables are only {sorted(ALLOWED)}")
    assert ALLOWED <= set(found), f"not read any more: {sorted(ALLOWED - set(found))} (update ALLOWED and the doc)"


def test_every_variable_is_documented_in_one_place():
    section = _doc_section()
    missing = sorted(name for name in ALLOWED if f"`{name}`" not in section)
    assert not missing, f"docs/operations.md, Environment variables: {missing} not listed"
    documented = set(NAME.findall(section))
    assert documented <= ALLOWED, f"listed but not alignflow's: {sorted(documented - ALLOWED)}"
