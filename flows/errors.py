"""How the command line reports a failure: one message that names its source, printed once.

A bad config key, a bad row, a missing file or model folder is the user's to fix, not a crash in
alignflow: the command prints ``error: <message>`` -- its source first (the command line, the params
file, or the data file with line and field), at most :data:`MAX_LINES` lines and :data:`MAX_CHARS`
characters -- and exits 1 (bad data, a failed training run) or 2 (a bad config, command line or model
folder). ``--debug`` adds the traceback. Any other exception is a bug or an outage and keeps its
traceback.

Prefect logs a failing task's and flow's exception, traceback included, before the flow call raises
it again: for these errors that is the same message three more times, so
:func:`quiet_prefect_failures` drops those records from the console (the Prefect UI still has them).

The error types are named here, not imported: importing them would load torch and Prefect for every
command, and an exception whose module was never imported cannot have been raised.
"""

from __future__ import annotations

import logging
import re
import sys
import traceback

from rlhf_core.common.redact import redact_secrets

MAX_LINES = 5
"""The most lines an error message takes on stderr (the traceback aside, under ``--debug``)."""
MAX_CHARS = 400
"""The most characters an error message takes on stderr."""

EXIT_CODES: dict[str, int] = {
    "rlhf_core.config.base.ConfigError": 2,
    "flows.services.processes.ServiceError": 1,
    "rlhf_core.models.loading.ModelLoadError": 2,
    "rlhf_core.data.io.DataError": 1,
    "rlhf_core.data.validate.ValidationFailed": 1,
    "tasks.errors.StageRejected": 1,
    "rlhf_core.trainers.step.NonFiniteError": 1,
    "rlhf_core.rewards.sources.RewardError": 1,
    "rlhf_core.promotion.metric_command.MetricCommandError": 1,
    "rlhf_core.tracking.checkpoint.StorageError": 1,
    "rlhf_core.tracking.artifact_push.ArtifactPushFailed": 1,
}
"""The project's own errors (``module.Class``) and the exit status each gives; subclasses count too."""

INTERRUPTED = "rlhf_core.tracking.checkpoint.TrainingInterrupted"
"""SIGTERM during training: a checkpoint was written and the same command resumes (exit 128 + 15)."""

_EXCEPTION_IN_LOG = re.compile(r"exception:? ([A-Za-z_]\w*+)")
"""Prefect's failure records name the exception class after "exception" ("... exception: ConfigError")."""

_PROJECT_CLASS_NAMES = frozenset(name.rsplit(".", 1)[1] for name in EXIT_CODES)


def _qualified(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def exit_code(exc: BaseException) -> int | None:
    """The exit status of one of the project's own errors, None for anything else."""
    for cls in type(exc).__mro__:
        code = EXIT_CODES.get(_qualified(cls))
        if code is not None:
            return code
    return None


def bounded(lines: list[str], more: str = "rerun with --debug for the whole message",
            rank: list[int] | None = None) -> str:
    """``lines`` cut to :data:`MAX_LINES` lines and :data:`MAX_CHARS` characters (the ``error: `` prefix
    included). Where something must go, lines of lower ``rank`` are kept first (default: the first lines),
    in their order; a long line is clipped; a last line says how many lines are left out and ``more``: where
    the rest is."""
    lines = [line for line in lines if line.strip()] or [""]
    whole = "\n".join(lines)
    if len(lines) <= MAX_LINES and len(whole) <= MAX_CHARS - len("error: "):
        return whole
    tail = f"... ({len(lines)} more line(s); {more})"[:MAX_CHARS // 2]
    budget = MAX_CHARS - len("error: ") - len(tail) - 1
    kept: dict[int, str] = {}
    for i in sorted(range(len(lines)), key=lambda i: ((rank or [0] * len(lines))[i], i)):
        room = budget - sum(len(k) + 1 for k in kept.values())
        if len(kept) == MAX_LINES - 1 or room < 40:
            break
        kept[i] = lines[i] if len(lines[i]) <= room else lines[i][:room - 3] + "..."
    shown = [kept[i] for i in sorted(kept)]
    return "\n".join([*shown, f"... ({len(lines) - len(shown)} more line(s); {more})"[:MAX_CHARS // 2]])


def message(exc: BaseException) -> str:
    """The bounded, redacted message of one of the project's errors. A failed validation keeps its header
    and each failure's first line (file:line, field, what is wrong) before the details, and points at
    ``alignflow validate``, which prints the whole report."""
    report = getattr(exc, "report", None)
    if report is None or not hasattr(report, "failures"):
        return bounded(redact_secrets(str(exc)).splitlines())
    lines, rank = [redact_secrets(report.render()).splitlines()[0]], [0]
    for failure in report.failures:
        rendered = redact_secrets(failure.render(report.path)).splitlines()
        lines += rendered
        rank += [1] + [2] * (len(rendered) - 1)
    path = str(report.path) if len(str(report.path)) <= 60 else "FILE"  # the header names a long one
    return bounded(lines, f"alignflow validate --kind {report.kind} {path} prints the whole report", rank)


def report(exc: BaseException, debug: bool) -> int | None:
    """Print ``exc`` as the command's one error (under ``debug`` its traceback first and the message uncut);
    returns the exit status, or None when ``exc`` is not one of the project's errors (the caller lets it propagate)."""
    if any(_qualified(cls) == INTERRUPTED for cls in type(exc).__mro__):
        print(f"stopped: {exc}", file=sys.stderr)
        return 128 + 15
    code = exit_code(exc)
    if code is None:
        return None
    if debug:  # the traceback, then the whole message; redacted like the rest (a URL's token in a message)
        sys.stderr.write(redact_secrets("".join(traceback.format_exception(exc))))
        print(f"error: {redact_secrets(str(exc))}", file=sys.stderr)
        return code
    print(f"error: {message(exc)}", file=sys.stderr)
    return code


class _ProjectFailureFilter(logging.Filter):
    """Drops Prefect's records of a task or flow failing with one of the project's errors: the command
    prints that error once itself. Every other record passes."""

    def filter(self, record: logging.LogRecord) -> bool:
        if not record.name.startswith("prefect"):
            return True
        exc = record.exc_info[1] if record.exc_info else None
        if exc is not None and exit_code(exc) is not None:
            return False
        return not any(m[1] in _PROJECT_CLASS_NAMES for m in _EXCEPTION_IN_LOG.finditer(record.getMessage()))


def quiet_prefect_failures() -> None:
    """Add :class:`_ProjectFailureFilter` to the root logger's handlers, where Prefect's console records
    go when the command configured logging before importing Prefect (Prefect keeps a user's handlers)."""
    for handler in logging.getLogger().handlers:
        if not any(isinstance(f, _ProjectFailureFilter) for f in handler.filters):
            handler.addFilter(_ProjectFailureFilter())
