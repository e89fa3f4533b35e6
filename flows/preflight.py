"""What a command checks before it loads anything: the files and model folders it reads exist.

A project made by ``alignflow init`` has no data and no model yet, and its ``params.yaml`` points every
stage at the embedded default's paths (``data/embedded/...``, ``models/base``). A stage run there must
not end in a traceback from deep inside the gate: it says which setting names the missing path, where
that value came from (``--set``, the params file, or the default), which command writes that path, and
how to point the setting elsewhere.

Run by :mod:`flows.cli` (stage commands and ``flow``); imports only the config module and the stage registry.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any

from rlhf_core.config import ConfigError, read_params
from rlhf_core.config import stage_registry as registry

DATA_FIELDS = ("train_file", "prompts_file", "eval_file", "corpus_file")
"""Config fields that name a dataset a stage reads (empty: not used)."""
MODEL_FIELDS = ("model_path", "policy_path")
"""Config fields that name the model folder a stage starts from."""


def _norm(path: str) -> str:
    return os.path.normpath(path)


def makers(params: str | None) -> dict[str, str]:
    """Output path (as the params file sets it) -> what writes it: each stage command's ``Stage.writes`` (the
    generator's folder, the tiny model's folder, each trainer's ``output_dir``, rejection sampling's kept
    samples). Read from the file and the defaults without building the configs (checking some imports torch)."""
    raw = read_params(params) if params and Path(params).exists() else {}
    out: dict[str, str] = {}
    for stage in registry.commands():
        if stage.writes is None:
            continue
        section, (name, does) = stage.section, stage.writes
        what = f"`alignflow {stage.name}` {does}"
        default = next(f.default for f in dataclasses.fields(stage.config_class()) if f.name == name)
        value = (raw.get(section) or {}).get(name, default)
        if isinstance(value, str) and value:
            out.setdefault(_norm(value), what)
    return out


def _maker_of(path: str, known: dict[str, str]) -> str | None:
    """What writes ``path``: an output path itself, or a file in the generator's folder."""
    norm = _norm(path)
    return known.get(norm) or known.get(_norm(os.path.dirname(norm)))


def source_of(section: str, field: str, overrides: dict[str, Any], params: str | None) -> str:
    """Where a field's value came from: ``--set``, the params file, or the default."""
    if field in overrides:
        return "--set"
    if params and Path(params).exists() and field in (read_params(params).get(section) or {}):
        return params
    return "the default"


def check_inputs(cfg: Any, section: str, overrides: dict[str, Any], params: str | None) -> None:
    """Raise ConfigError for the first dataset or start model of ``cfg`` that does not exist, naming the
    setting, its source, what writes that path and the override that points elsewhere."""
    known: dict[str, str] | None = None
    for field in (*DATA_FIELDS, *MODEL_FIELDS):
        path = getattr(cfg, field, "") or ""
        if not path or Path(path).exists():
            continue
        known = makers(params) if known is None else known
        kind = "folder" if field in MODEL_FIELDS else "file"
        maker = _maker_of(path, known)
        point = "a Hugging Face model folder" if kind == "folder" else "your own file"
        raise ConfigError(f"{section}.{field}: {path}: {kind} not found (value from "
                          f"{source_of(section, field, overrides, params)}); "
                          + (f"{maker}, or " if maker else "")
                          + f"--set {field}=PATH names {point}")


def check_flow_inputs(given: dict[str, str | None]) -> None:
    """The flow's own inputs (``--sft-file``, ``--base-model``, ...) exist: ``given`` maps option -> path."""
    for option, path in given.items():
        if path and not Path(path).exists():
            raise ConfigError(f"{option}: {path}: not found")
