"""What ``alignflow reproduce RUN_ID`` may take from the tracking store: the stored params against the commit's.

A run id's record (``reproduce.json``, the ``git.commit`` tag) comes from the MLflow store, and
anyone who can write to that store can edit it. The rerun executes the commit's code with the
stored params, so the params decide what runs, what is written and what is contacted.
:func:`review_config` compares the stored params with the commit's own ``params.yaml`` (its
defaults filled in) field by field; :func:`enforce` refuses, before anything runs:

* without ``--trust``, a difference in a field that names code (``file.py:fn``), an output path,
  a URL or network address, a secret's variable name or a tracking setting (the ``tracking``
  section);
* even with ``--trust``, an output path that resolves outside the rerun's worktree.

One relaxation: a **naming setting** (an experiment or registered-model name) that differs only
by a plain name (letters, digits, ``_ . -`` and spaces: never a path, code or URL) is allowed
without ``--trust`` when the store is a local SQLite file inside the project, where nobody but
the project's own user writes the record. (A rerun registers nothing either way.)

Used by :mod:`flows.reproduce`; imports nothing of it.
"""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path
from typing import Any

from rlhf_core.common.redact import redact_secrets
from rlhf_core.config import SECTIONS, section_fields

ABSENT = object()  # a field on one side only (not a string: a stored "<absent>" is just a value)
SECRET_WORDS = {"token", "secret", "password", "passwd", "apikey", "credential", "credentials"}
URL = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://|^[^/\s:@]+@[^/\s:]+:")  # scheme://... or scp-like user@host:path
PYTHON_FILE = re.compile(r"\.py(:[A-Za-z_][A-Za-z0-9_.]*)?$")  # a python file, or a function spec file.py:fn
NETWORK_FIELD = re.compile(r"(url|uri|address|host|endpoint)$")
OUTPUT_FIELD = re.compile(r"^(out|output|checkpoint)(_|$)|_dir$|^(pairs|metrics|summary|report)_file$")
# artifact_dir names an MLflow artifact store, often a shared absolute folder; MLflow only adds
# files under <artifact_dir>/<experiment>/<run>, and a change to it is a tracking setting (refused
# without --trust), so it is not confined to the worktree. team.data_dir is where `alignflow services up` keeps
# the team services' data, often an absolute folder; a rerun starts no service and never writes there.
UNCONFINED_OUTPUTS = {("tracking", "artifact_dir"), ("team", "data_dir")}
NAMING_FIELDS = {("tracking", "experiment"), ("tracking", "registered_model"), ("cycles", "registered_model")}
"""Settings that only name where runs and versions are filed."""
PLAIN_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9 _.-]{0,199}$")
NAMING = "naming setting"
PROTECTS = ("the stored params come from the tracking store, which anyone who can write to it can edit, and "
            "these fields decide what the rerun executes, writes, contacts or records to")
"""What the trust check protects against, in one sentence (printed with every refusal)."""


@dataclasses.dataclass
class ConfigReview:
    """Every stored-vs-commit difference, those refused without ``--trust``, the naming differences
    allowed for a local store, and the output paths refused even with ``--trust``."""

    differences: list[str]
    untrusted: list[str]
    escapes: list[str]
    relaxed: list[str] = dataclasses.field(default_factory=list)


def strings_in(value: Any) -> list[str]:
    if isinstance(value, str):
        return [value]
    if isinstance(value, dict):
        return [s for v in value.values() for s in strings_in(v)]
    if isinstance(value, (list, tuple)):
        return [s for v in value for s in strings_in(v)]
    return []


def inside(worktree: Path, value: str) -> bool:
    """Whether ``value``, relative to the worktree unless absolute, resolves (symlinks followed)
    to the worktree or below it."""
    path = Path(value).expanduser()
    resolved = (path if path.is_absolute() else worktree / path).resolve()
    root = worktree.resolve()
    return resolved == root or root in resolved.parents


def local_store(tracking_uri: str, project: Path) -> bool:
    """Whether ``tracking_uri`` is a SQLite file inside ``project`` (the scaffold's ``mlflow.db``)."""
    if not tracking_uri.startswith("sqlite:///") or ":memory:" in tracking_uri:
        return False
    return inside(project, tracking_uri[len("sqlite:///"):].split("?", 1)[0])


def is_output_field(section: str, field: str) -> bool:
    return bool(OUTPUT_FIELD.search(field)) and (section, field) not in UNCONFINED_OUTPUTS


def why_untrusted(section: str, field: str, values: list[Any], worktree: Path) -> str | None:
    """Why a difference in ``section.field`` may only come from a trusted store, or None.
    ``naming setting`` only for a plain name on both sides (:data:`PLAIN_NAME`)."""
    strings = [s for v in values for s in strings_in(v)]
    field = field.replace(".", "_")  # a field within a section by its whole name: reward.token_env -> reward_token_env
    if (section, field) in NAMING_FIELDS:
        plain = all(v is ABSENT or (isinstance(v, str) and PLAIN_NAME.match(v)) for v in values)
        return NAMING if plain else "tracking setting"
    if section == "tracking" or field in ("experiment", "registered_model"):
        return "tracking setting"
    if field.endswith("_function") or any(PYTHON_FILE.search(s.strip()) for s in strings):
        return "code: a python file that would be executed"
    if NETWORK_FIELD.search(field) or any(URL.search(s.strip()) for s in strings):
        return "URL / network address"
    if field.endswith("_env") or SECRET_WORDS & set(field.split("_")):  # not max_new_tokens
        return "secret (an environment variable name)"
    if is_output_field(section, field) and strings:
        return "output path"
    looks_like_path = field.endswith(("_path", "_file", "_model")) or any("/" in s or s.startswith(("~", "."))
                                                                         for s in strings)
    if looks_like_path and any(s and not inside(worktree, s) for s in strings):
        return "path outside the worktree"
    return None


def _flat(section: str, values: dict[str, Any]) -> dict[str, Any]:
    """A section's fields field by field: a section within it (rl's ``kl: {coef: ..}``) as dotted names (``kl.coef``),
    the flat name of such a field as its dotted one (``kl_coef``, the class's ``renamed``), so a record and a commit
    that spell a field differently compare field by field."""
    cls = SECTIONS.get(section)
    inner, renamed = section_fields(cls) if cls else {}, getattr(cls, "renamed", {})
    out: dict[str, Any] = {}
    for key, value in values.items():
        if key in inner and isinstance(value, dict):
            out.update({f"{key}.{k}": v for k, v in value.items()})
        else:
            out[renamed.get(key, key)] = value
    return out


def review_config(stored: dict[str, Any], commit: dict[str, Any], worktree: Path,
                  store_is_local: bool = False) -> ConfigReview:
    """Compare the stored params (``reproduce.json``) with the commit's ``params.yaml`` plus its
    defaults, field by field; check that every output path of the effective config stays in the
    worktree. ``store_is_local``: the store is this project's SQLite file (:func:`local_store`), so a
    naming difference is allowed."""
    review = ConfigReview([], [], [])
    stored = {section: _flat(section, values) for section, values in stored.items()}
    commit = {section: _flat(section, values) for section, values in commit.items()}
    for section in sorted(set(stored) | set(commit)):
        ours, theirs = stored.get(section, {}), commit.get(section, {})
        for field in sorted(set(ours) | set(theirs)):
            a, b = ours.get(field, ABSENT), theirs.get(field, ABSENT)
            if a == b:
                continue
            shown = ["<absent>" if v is ABSENT else json.dumps(redact_secrets(v, field))  # never a ?token=
                     for v in (a, b)]
            line = f"{section}.{field}: {shown[0]} (stored) vs {shown[1]} (commit)"
            reason = why_untrusted(section, field, [a, b], worktree)
            if reason == NAMING and store_is_local:
                reason = f"{NAMING}: allowed, the store is this project's own SQLite file"
                review.relaxed.append(f"{line}  [{reason}]")
            elif reason:
                review.untrusted.append(f"{line}  [{reason}]")
            review.differences.append(line + (f"  [{reason}]" if reason else ""))
    for section in sorted(set(stored) | set(commit)):
        effective = {**commit.get(section, {}), **stored.get(section, {})}
        for field, value in sorted(effective.items()):
            if is_output_field(section, field) and isinstance(value, str) and value and not inside(worktree, value):
                target = (worktree / Path(value).expanduser()).resolve()
                review.escapes.append(f"{section}.{field}: {json.dumps(redact_secrets(value, field))} "
                                      f"resolves to {redact_secrets(str(target))}")
    return review


def enforce(review: ConfigReview, trust: bool, worktree: Path) -> None:
    """Refuse (SystemExit, listing each field) what the review found: untrusted differences unless
    ``trust``, escaping output paths always."""
    parts = []
    if review.untrusted and not trust:
        parts.append(f"{PROTECTS}; they differ from the commit's params.yaml, so check them and pass --trust if "
                     "you trust everyone who can write to this tracking store:\n"
                     + "\n".join(f"  {line}" for line in review.untrusted))
    if review.escapes:
        parts.append(f"output paths outside the worktree {worktree} (refused even with --trust: a rerun "
                     "writes, and may remove, only inside its own worktree):\n"
                     + "\n".join(f"  {line}" for line in review.escapes))
    if parts:
        raise SystemExit("reproduce: refusing to rerun: " + "\n\nreproduce: refusing to rerun: ".join(parts))
