"""flows/errors.py: which exceptions are the project's own, how a long message is cut, which Prefect records go.

The exit-code table names error classes by ``module.Class`` (importing them would load torch for every
command), so a renamed or moved class must fail here rather than turn a user's mistake back into a
traceback.
"""

from __future__ import annotations

import importlib
import logging
from pathlib import Path

import pytest

from flows import errors


@pytest.mark.parametrize("name", [*errors.EXIT_CODES, errors.INTERRUPTED])
def test_every_named_error_class_exists(name):
    module, _, cls = name.rpartition(".")
    assert isinstance(getattr(importlib.import_module(module), cls), type), name


def test_exit_codes_follow_the_class_and_its_subclasses():
    from rlhf_core.tracking.checkpoint import StorageError
    from rlhf_core.config import ConfigError
    from rlhf_core.data.io import DataError

    class Narrower(ConfigError):
        pass

    assert errors.exit_code(ConfigError("x")) == 2 and errors.exit_code(Narrower("x")) == 2
    assert errors.exit_code(DataError("data.jsonl", 3, "bad")) == 1
    assert errors.exit_code(StorageError("disk full")) == 1
    assert errors.exit_code(ValueError("a bug")) is None and errors.exit_code(FileNotFoundError("x")) is None


def test_a_long_message_is_cut_to_five_lines_and_400_characters():
    """Eight lines of 120 characters: four kept whole or clipped while they fit, then one line saying how many
    are left out and where the rest is; 'error: ' counted in the 400."""
    lines = [f"line {i}: " + "x" * 110 for i in range(8)]
    cut = errors.bounded(lines, more="see the report")
    shown = cut.splitlines()
    assert len(shown) <= 5 and len("error: " + cut) <= 400, cut
    assert shown[0] == lines[0] and shown[-1].endswith("more line(s); see the report)")
    assert errors.bounded(["short", "message"]) == "short\nmessage"  # what fits is left alone


def test_a_cut_validation_report_keeps_each_failures_location_first(tmp_path, monkeypatch):
    """Five failed expectations, three lines each: the header and the first failures' ``file:line: field``
    lines survive the cut, their details go first, and the last line names the command that prints it all."""
    from rlhf_core.data.validate import ValidationFailed, validate_dataset

    monkeypatch.chdir(tmp_path)
    Path("p.jsonl").write_text('{"prompt": "1+1=", "chosen": "2", "rejected": "2"}\n{"prompt": "", "chosen": "3"}\n'
                               '{"prompt": "2+2=", "chosen": 4, "rejected": "5"}\n')
    report = validate_dataset("p.jsonl", "preference")
    text = errors.message(ValidationFailed(report))
    shown = text.splitlines()
    assert len(shown) == 5 and len("error: " + text) <= 400, text
    assert shown[0] == "p.jsonl: INVALID preference dataset, standard form (5 of 15 expectations failed)"
    assert shown[1:4] == [f.render("p.jsonl").splitlines()[0] for f in report.failures[:3]]
    assert shown[4] == "... (12 more line(s); alignflow validate --kind preference p.jsonl prints the whole report)"


def test_prefect_records_of_the_projects_errors_are_dropped_and_others_kept():
    from rlhf_core.config import ConfigError

    quiet = errors._ProjectFailureFilter()

    def record(name: str, msg: str, exc: BaseException | None = None) -> logging.LogRecord:
        info = (type(exc), exc, None) if exc is not None else None
        return logging.LogRecord(name, logging.ERROR, __file__, 1, msg, None, info)

    bad = ConfigError("params.yaml: sft.lr: must be > 0")
    assert not quiet.filter(record("prefect.task_runs", "Task run failed with exception: ...", bad))
    assert not quiet.filter(record("prefect.flow_runs", "Finished in state Failed('Flow run encountered an "
                                                        "exception: ConfigError: params.yaml: ...')"))
    assert not quiet.filter(record("prefect.task_runs", "Finished in state Failed(\"Task run encountered an "
                                                        "exception ValidationFailed: data.jsonl: ...\")"))
    assert quiet.filter(record("prefect.task_runs", "Task run failed with exception: ...", KeyError("a bug")))
    assert quiet.filter(record("prefect.flow_runs", "Beginning flow run 'x' for flow 'align'"))
    assert quiet.filter(record("rlhf_core.stages.wrappers", "anything", bad))  # not Prefect's: kept
