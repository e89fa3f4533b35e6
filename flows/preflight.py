"""What a command checks before it loads anything: the files and model folders it reads exist.

A project made by ``alignflow init`` has no data and no model yet, and its ``params.yaml`` points every
stage at the embedded default's paths (``data/embedded/...``, ``models/base``). A stage run there must
not end in a traceback from deep inside the gate: it says which setting names the missing path, where
that value came from (``--set``, the params file, or the default), which command writes that path, and
how to point the setting elsewhere.

A flow also needs the Prefect server it is pointed at (:func:`check_prefect_server`): one that does not answer is one
line naming it, not Prefect's traceback.

Run by :mod:`flows.cli` (stage commands and ``flow``); imports only the config module and the stage registry.
"""

from __future__ import annotations

import dataclasses
import os
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from rlhf_core.common.redact import redact_secrets
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


GATEWAY_DOWN = (502, 503, 504)
"""A gateway's answer for a server behind it that is down."""


def check_prefect_server() -> None:
    """The Prefect server ``PREFECT_API_URL`` names (the team profile sets it) answers: else a ConfigError naming it,
    as :class:`rlhf_core.tracking.mlflow_runs.TrackingUnavailable` does for MLflow's, before Prefect's client meets
    it with a traceback. Any HTTP answer but a gateway's counts (a 401 or 404 too: this asks whether a server is
    there). Without ``PREFECT_API_URL`` a flow starts an ephemeral Prefect of its own: nothing to ask."""
    url = os.environ.get("PREFECT_API_URL", "").rstrip("/")
    if not url:
        return
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=5):  # noqa: S310 - the user's own server
            return
    except urllib.error.HTTPError as exc:
        if exc.code not in GATEWAY_DOWN:
            return
        problem = f"HTTP {exc.code} from a gateway"
    except (urllib.error.URLError, OSError, ValueError) as exc:
        problem = str(getattr(exc, "reason", exc))
    raise ConfigError(redact_secrets(
        f"Prefect server {url} (PREFECT_API_URL) did not answer ({problem}): start it (the team profile's: "
        "alignflow services up; alignflow services status says which service is down), or unset PREFECT_API_URL "
        "to run the flow on an ephemeral Prefect of its own."))
