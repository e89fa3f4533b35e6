"""The flows' params: every section's typed config, from ``params.yaml`` and the command line's overrides.

Prefect keeps a flow run's parameters in its database and UI, so an override that carries a secret
travels as a private file instead (:func:`write_private_overrides`). Imports only the config module and the
stage registry, so the command line checks a flow's config before it starts Prefect (:mod:`flows.cli`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from pathlib import Path
from typing import Any

from rlhf_core.common.atomic_io import write_text_atomic
from rlhf_core.config import OVERRIDE_SOURCE, SECTIONS, ConfigError, build_config, read_params, unknown_sections
from rlhf_core.config import stage_registry as registry
from rlhf_core.tracking.mlflow_runs import project_root


def write_private_overrides(values: dict[str, dict[str, Any]]) -> str:
    """Write overrides that carry a secret to ``.alignflow/private/overrides-<sha256>.json`` (folder 0700,
    file 0600); returns its absolute path, what the flow gets as its ``private_overrides`` parameter.

    Why a file: Prefect stores a flow run's parameters in its database and shows them in its UI, so a
    ``--set rl.reward.url=https://user:pass@host/?token=...`` passed as a parameter would sit there for
    good. The name is the content's hash, so another value is another parameter, and a retry or rerun of
    the flow run finds the same file."""
    text = json.dumps(values, sort_keys=True)
    folder = project_root() / ".alignflow" / "private"
    folder.mkdir(parents=True, exist_ok=True)
    folder.chmod(0o700)  # so write_text_atomic's temporary file (default mode) is out of others' reach too
    path = folder / f"overrides-{hashlib.sha256(text.encode()).hexdigest()}.json"
    write_text_atomic(path, text)
    path.chmod(0o600)
    return str(path)


def read_private_overrides(path: str) -> dict[str, dict[str, Any]]:
    """The overrides :func:`write_private_overrides` wrote, checked against the hash in the file's name."""
    file = Path(path)
    if not file.exists():
        raise ConfigError(f"private_overrides: {file} is gone (it held this flow run's --set values that carry a "
                          "secret); run the command again")
    text = file.read_text(encoding="utf-8")
    if file.name != f"overrides-{hashlib.sha256(text.encode()).hexdigest()}.json":
        raise ConfigError(f"private_overrides: {file} does not match the hash in its name (changed since the flow "
                          "run started); run the command again")
    return json.loads(text)


def load_all(params_file: str | None, overrides: dict[str, dict[str, Any]] | None,
             private_overrides: str | None = None) -> dict[str, Any]:
    """Every section's typed config (the config module's sections, and a registered stage's own where it is not
    one of them), from ``params_file`` plus ``{section: {field: value}}`` overrides, the secret-carrying ones
    read from the ``private_overrides`` file (:func:`write_private_overrides`)."""
    sections = {**SECTIONS, **{s.section: s.config_class() for s in registry.STAGES.values()
                               if s.section not in SECTIONS}}
    raw = read_params(params_file) if params_file and Path(params_file).exists() else {}
    overrides = {section: dict(values) for section, values in (overrides or {}).items()}
    if private_overrides:  # the real values of what the flow-run parameters show as ***
        for section, values in read_private_overrides(private_overrides).items():
            overrides.setdefault(section, {}).update(values)
    unknown = set(overrides) - set(sections)
    if unknown:
        raise ConfigError(f"{OVERRIDE_SOURCE}: {unknown_sections(unknown)}")
    cfg = {name: build_config(cls, name, {**(raw.get(name) or {}), **overrides.get(name, {})},
                              str(params_file or "<defaults>"), overridden=set(overrides.get(name, {})))
           for name, cls in sections.items()}
    return with_sft_registry_name(cfg)


def with_sft_registry_name(cfg: dict[str, Any]) -> dict[str, Any]:
    """The SFT model's registry name follows a policy name of the user's own: with ``cycles.registered_model``
    set to ``my-policy`` and ``tracking.registered_model`` left at its default, SFT registers as
    ``my-policy-sft`` rather than beside every other project's ``alignflow-sft``."""
    tracking, cycles = cfg["tracking"], cfg["cycles"]
    sft_default = SECTIONS["tracking"].__dataclass_fields__["registered_model"].default
    policy_default = SECTIONS["cycles"].__dataclass_fields__["registered_model"].default
    if tracking.registered_model == sft_default and cycles.registered_model != policy_default:
        cfg = {**cfg, "tracking": dataclasses.replace(tracking, registered_model=f"{cycles.registered_model}-sft")}
    return cfg
