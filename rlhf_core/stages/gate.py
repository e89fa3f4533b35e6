"""Gate a stage's inputs: each dataset against the Great Expectations suite of its kind, and the data report
(near-duplicates, eval contamination) on what it trains on, before anything is loaded or a run is opened.

A passed gate or report is recorded under the project's ``.alignflow/`` keyed on the file's content, its kind,
the field names and the checks' own code, so a flow's validate step and the stage command after it, or a
repeated stage, do not check the same file twice. Called by :mod:`rlhf_core.stages.wrappers` (the first step of
a training stage, and ``validate``).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from rlhf_core.common.atomic_io import write_text_atomic
from rlhf_core.config import DataFields, DataReportConfig, config_to_dict
from rlhf_core.data import io, quality, report as reporter, streaming, validate as validator
from rlhf_core.data.report import data_report
from rlhf_core.data.validate import ValidationFailed, eval_kind
from rlhf_core.tracking.lineage import dvc_md5
from rlhf_core.tracking.mlflow_runs import project_root
from rlhf_core.tracking.stage_run import log_report_files


def _write_json_atomic(obj: Any, path: str | Path) -> Path:
    return write_text_atomic(path, json.dumps(obj, indent=2, sort_keys=True) + "\n")


# The Great Expectations suite each named stage input must pass; a stage names the kind of a dataset of its
# own (``gate_kinds``: unpaired examples) or overrides one (RL's prompts are ``prompt-only`` when its reward never
# reads labels, see :func:`rlhf_core.stages.wrappers.rl`).
GATE_KINDS = {"sft_train": "sft", "distill_train": "sft", "kept_samples": "sft", "preferences": "preference",
               "eval_preferences": "preference", "prompts": "prompts", "eval": "prompts"}


def _gate_key(path: str | Path, kind: str, fields: DataFields, desirable_field: str | None = None) -> str:
    """What a passed validation depends on: the file's content, the kind, the field names, the size
    limits and the validator's own code (a changed suite must not trust old passes)."""
    limits = ("max_field_chars", "max_line_bytes")
    names = {f: getattr(fields, f) for f in DataFields.__dataclass_fields__ if f not in limits}
    if kind == "unpaired":  # only this kind reads it; other kinds keep their keys
        names["desirable_field"] = desirable_field or getattr(fields, "desirable_field", validator.DESIRABLE_FIELD)
    code = [hashlib.sha256(Path(m.__file__).read_bytes()).hexdigest() for m in (validator, streaming, io)]
    blob = json.dumps({"md5": dvc_md5(path), "kind": kind, "fields": names, "max_chars": fields.max_field_chars,
                       "max_line_bytes": fields.max_line_bytes, "validator": code}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()


def _gate_record(path: str | Path, kind: str, fields: DataFields, desirable_field: str | None = None) -> Path:
    return project_root() / ".alignflow" / "validated" / f"{_gate_key(path, kind, fields, desirable_field)}.json"


def remember_pass(path: str | Path, kind: str, fields: DataFields, n_rows: int,
                   desirable_field: str | None = None) -> None:
    _write_json_atomic({"path": str(path), "kind": kind, "n_rows": n_rows},
                       _gate_record(path, kind, fields, desirable_field))


def gate_datasets(fields: DataFields, datasets: dict[str, tuple[str, str]],
                  kinds: dict[str, str] | None = None) -> None:
    """Validate a training stage's datasets before anything is loaded or opened: the command-line
    stages get the same gate as the flows, so bad rows never reach a model (``ValidationFailed``).

    A file that already passed — same content, kind, fields and validator code, recorded under
    ``.alignflow/validated/`` by :func:`rlhf_core.stages.wrappers.validate` or an earlier gate — is not validated again (in
    a flow or ``dvc repro`` the validate step just did it). ``kinds`` overrides :data:`GATE_KINDS` by name."""
    for name, (path, _) in datasets.items():
        kind = (kinds or {}).get(name) or GATE_KINDS.get(name)
        if kind is None or not path or _gate_record(path, kind, fields).exists():
            continue
        report = validator.validate_dataset(path, kind, fields)  # looked up per call: a test wraps it
        if not report.success:
            raise ValidationFailed(report)
        remember_pass(path, kind, fields, report.n_rows)


def _report_key(path: str | Path, kind: str, fields: DataFields, cfg: DataReportConfig, eval_file: str) -> str:
    """What a passed data report depends on: the gate's key (file content, kind, fields, validator code),
    the thresholds, the eval set's content and the report's own code (changed checks must not trust old passes)."""
    code = [hashlib.sha256(Path(m.__file__).read_bytes()).hexdigest() for m in (reporter, quality)]
    blob = json.dumps({"gate": _gate_key(path, kind, fields), "thresholds": config_to_dict(cfg),
                       "eval_md5": dvc_md5(eval_file) if eval_file else None, "report": code}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()


def report_datasets(fields: DataFields, datasets: dict[str, tuple[str, str]], kinds: dict[str, str] | None,
                    cfg: DataReportConfig, eval_file: str) -> dict[str, dict[str, Any]]:
    """The data report (:mod:`rlhf_core.data.report`) of a stage's training datasets -- those whose context is
    ``training`` -- against ``eval_file`` (``""``: no contamination check), before anything trains: what the
    flows run after their gate, so ``dvc repro``'s stage commands refuse the same data (``ValidationFailed``
    with file, line and field). Returns ``name -> {"stats", "report", "html"}`` for the stage's run to log.

    A passed report is kept under ``.alignflow/data_reports/`` keyed on :func:`_report_key` (as the gate's
    passes are), so a repeated stage reads it instead of running the report again. No drift check here:
    a stage command has no previous cycle to compare with."""
    out: dict[str, dict[str, Any]] = {}
    for name, (path, context) in datasets.items():
        kind = (kinds or {}).get(name) or GATE_KINDS.get(name)
        if context != "training" or kind is None or not path:
            continue
        record = (project_root() / ".alignflow" / "data_reports" /
                  f"{_report_key(path, kind, fields, cfg, eval_file)}.json")
        if record.exists():
            out[name] = json.loads(record.read_text())
            continue
        report = data_report(path, kind, cfg, fields, eval_file or None)
        if not report.success:
            raise ValidationFailed(report)
        out[name] = {"stats": report.stats, "report": report.to_dict(), "html": report.html}
        _write_json_atomic(out[name], record)
    return out


def data_report_of(path: str | Path, kind: str, fields: DataFields | None, cfg: DataReportConfig,
                 eval_file: str | None, previous: dict[str, float] | None, run: Any, parent_run_id: str | None,
                 name: str) -> dict[str, float]:
    """Run the data report, log its page, JSON and rates; raise ``ValidationFailed`` if it fails."""
    report = data_report(path, kind, cfg, fields, eval_file, previous)
    if run is not None:
        runs = [run] + ([type(run)(run.client, parent_run_id)] if parent_run_id and hasattr(run, "client") else [])
        for target in runs:
            log_report_files(target, name, report.html, report.to_dict())
        run.log_metrics({**report.stats, "data/report_failed_expectations": float(len(report.failures))}, 0)
    if not report.success:
        raise ValidationFailed(report)
    return report.stats


def gate_inputs(cfg: Any, datasets: dict[str, tuple[str, str]], gate_kinds: dict[str, str] | None,
                data_report: DataReportConfig | None) -> dict[str, dict[str, Any]]:
    """A training stage's first step: gate its ``datasets`` (``name -> (path, context)``) and, with ``data_report``,
    run the data report on its training data; returns the reports for its run to log.

    The ``eval`` dataset is gated as ``prompts`` when every item has a label and ``prompt-only`` when none has
    (:func:`rlhf_core.data.validate.eval_kind`; a mix is a ``DataError`` naming file, line and field)."""
    kinds = dict(gate_kinds or {})
    if datasets.get("eval", ("", ""))[0] and "eval" not in kinds:  # labelled, or not at all (a mix: DataError)
        kinds["eval"] = eval_kind(datasets["eval"][0], cfg.label_field)
    gate_datasets(cfg, datasets, kinds)
    return (report_datasets(cfg, datasets, kinds, data_report, getattr(cfg, "eval_file", "") or "")
            if data_report is not None else {})
