"""A user's own metric for the promotion gate: a command that scores a model per item (``guards.metric_command``).

When eval data has no checkable labels and no reward model fits, the user names a command; the guards run it
once for the parent model (cached like the parent's probe) and once for the child, and the gate compares the
two paired by item id (:func:`rlhf_core.promotion.guards.paired_delta`). Config (``params.yaml``)::

    guards:
      gate_metric: command
      metric_command: "python my_eval.py --model {model} --out {out}"

Placeholders: ``{model}`` (the model folder), ``{out}`` (the score file to write; its folder exists),
``{eval_file}`` (the stage's eval file). The command line is split like a shell would (``shlex``) *before*
the placeholders are filled, so paths with spaces stay one argument; it runs without a shell, in the project
root, and must exit 0.

The score file is JSON lines, one object per scored item::

    {"id": "q-0001", "score": 0.75}

``id``: a string or an integer, unique in the file (the pairing key: parent and child must score the same
ids); ``score``: a finite number (not a boolean), higher is better. Other keys are ignored. Blank lines are
skipped. Every fault (a failed command, a missing file, a bad line, ids that differ between the two models)
is a :class:`MetricCommandError` naming the command or the file, line and field: the stage fails before its
model is registered.

Run: called by :func:`rlhf_core.stages.guard.check_stage_guards`; no torch, MLflow or Prefect here.
"""

from __future__ import annotations

import json
import math
import shlex
import subprocess
from pathlib import Path

STDERR_TAIL = 2000
"""Characters of a failed command's stderr quoted in the error."""


class MetricCommandError(RuntimeError):
    """The metric command failed or its score file is not what :mod:`rlhf_core.promotion.metric_command` defines."""


def command_args(template: str, *, model: str | Path, out: str | Path, eval_file: str | Path) -> list[str]:
    """``template`` split into arguments (``shlex``), then each argument's placeholders filled."""
    try:
        parts = shlex.split(template)
    except ValueError as exc:
        raise MetricCommandError(f"guards.metric_command {template!r}: cannot split it into arguments: {exc}") from None
    try:
        return [part.format(model=str(model), out=str(out), eval_file=str(eval_file)) for part in parts]
    except (KeyError, IndexError, ValueError) as exc:
        raise MetricCommandError(f"guards.metric_command {template!r}: unknown or malformed placeholder {exc}; "
                                 "the placeholders are {model}, {out} and {eval_file}") from None


def run_metric_command(template: str, *, model: str | Path, out: Path, eval_file: str | Path,
                       cwd: str | Path, timeout_s: float | None = None) -> dict[str, float]:
    """Run the command for ``model``, writing ``out``; returns its per-item scores (:func:`read_scores`)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    out.unlink(missing_ok=True)  # a file left by an earlier run must not pass for this one's
    args = command_args(template, model=model, out=out, eval_file=eval_file)
    try:
        done = subprocess.run(args, cwd=str(cwd), capture_output=True, text=True, timeout=timeout_s)
    except FileNotFoundError:
        raise MetricCommandError(f"guards.metric_command: {args[0]!r} not found (command: {shlex.join(args)})") from None
    except subprocess.TimeoutExpired:
        raise MetricCommandError(f"guards.metric_command ran past {timeout_s} s: {shlex.join(args)}") from None
    if done.returncode != 0:
        raise MetricCommandError(f"guards.metric_command failed for model {model} (exit code {done.returncode}): "
                                 f"{shlex.join(args)}\nstderr (last {STDERR_TAIL} characters):\n"
                                 f"{done.stderr[-STDERR_TAIL:]}")
    if not out.exists():
        raise MetricCommandError(f"guards.metric_command exited 0 but wrote no score file {out} (pass {{out}} to it): "
                                 f"{shlex.join(args)}")
    return read_scores(out)


def read_scores(path: Path) -> dict[str, float]:
    """``{id: score}`` from a score file (JSON lines of ``{"id": ..., "score": ...}``); ids become strings."""
    scores: dict[str, float] = {}
    for line_no, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        where = f"{path}:{line_no}"
        try:
            row = json.loads(line)
        except ValueError as exc:
            raise MetricCommandError(f"{where}: not JSON ({exc})") from None
        if not isinstance(row, dict):
            raise MetricCommandError(f"{where}: must be a JSON object with 'id' and 'score', got {type(row).__name__}")
        item, score = row.get("id"), row.get("score")
        if isinstance(item, bool) or not isinstance(item, (str, int)):
            raise MetricCommandError(f"{where}: field 'id': must be a string or an integer, got {item!r}")
        if isinstance(score, bool) or not isinstance(score, (int, float)) or not math.isfinite(score):
            raise MetricCommandError(f"{where}: field 'score': must be a finite number, got {score!r}")
        if str(item) in scores:
            raise MetricCommandError(f"{where}: field 'id': {item!r} appears twice")
        scores[str(item)] = float(score)
    if not scores:
        raise MetricCommandError(f"{path}: no scored items")
    return scores


def pair_scores(parent: dict[str, float], child: dict[str, float]) -> tuple[list[str], list[float], list[float]]:
    """Ids (sorted) and the parent's and child's ``(n,)`` scores on them, in that order; the two files must score
    the same ids (a paired difference over different items means nothing)."""
    only_parent, only_child = sorted(set(parent) - set(child)), sorted(set(child) - set(parent))
    if only_parent or only_child:
        raise MetricCommandError(
            f"guards.metric_command: the parent's and the child's score files cover different items "
            f"({len(parent)} vs {len(child)} ids; only the parent's: {only_parent[:5]}, only the child's: "
            f"{only_child[:5]}): the command must score the same items for every model")
    ids = sorted(parent)
    return ids, [parent[i] for i in ids], [child[i] for i in ids]
