"""Stage entry points: config in, files out, with validation, tracking and lineage around the core.

Each function here is what one pipeline stage *is*, called identically by the CLI (and so
by ``dvc repro``) and by the Prefect tasks of ``tasks/``. A stage reads its typed config,
writes its outputs atomically, opens an MLflow run (nested under ``parent_run_id`` when a
flow runs it), tags it with the git commit and the DVC md5 of every input, and returns
paths and hashes — never tensors or models — so orchestration layers stay thin.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

from rlhf_core.common.atomic_io import write_text_atomic
from rlhf_core.config import (
    DataFields,
    DataReportConfig,
    DistillConfig,
    DPOConfig,
    EvalConfig,
    GenerateConfig,
    GuardsConfig,
    KTOConfig,
    ModelConfig,
    RaftConfig,
    RejectionConfig,
    RewardConfig,
    RLConfig,
    SFTConfig,
    TrackingConfig,
    config_to_dict,
)
from rlhf_core.tracking.lineage import dvc_md5, git_commit, git_untracked, package_version, untracked_note

RENDERED_EXAMPLES = "samples/rendered_examples.json"
"""A training stage's first sequences as its model saw them (chat template and all), with the spans that
carry loss: the artifact a reviewer opens to check the rendering (:mod:`rlhf_core.data.sequences`)."""


@dataclass
class StageResult:
    """What a stage hands to the next: output paths with their md5s, metrics, its run id."""

    outputs: dict[str, str]
    md5: dict[str, str]
    metrics: dict[str, float] = field(default_factory=dict)
    run_id: str | None = None
    model_uri: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


def _write_json_atomic(obj: Any, path: str | Path) -> Path:
    return write_text_atomic(path, json.dumps(obj, indent=2, sort_keys=True) + "\n")


@contextmanager
def _maybe_run(tracking: TrackingConfig | None, name: str, parent_run_id: str | None,
               tags: dict[str, str]) -> Iterator[Any]:
    """An MLflow run when ``tracking`` is given (flows want a run per stage), else ``None``."""
    if tracking is None:
        yield None
        return
    from rlhf_core.tracking.mlflow_runs import start_run

    with start_run(tracking, name, parent_run_id, tags) as run:
        yield run


def lineage_tags(inputs: dict[str, str | Path], stage: str) -> dict[str, str]:
    """``git.commit``, ``alignflow.stage``, ``alignflow.version``, ``dvc.md5.<name>`` for each existing input, and
    ``git.untracked`` when the project holds files git does not track.

    The version is the installed alignflow's: a project made by ``alignflow init`` has no
    alignflow source in its commit, so the commit alone does not say which trainer ran."""
    tags = {"git.commit": git_commit(), "alignflow.stage": stage, "alignflow.version": package_version()}
    untracked = git_untracked()
    if untracked:  # a dirty tree shows in git.commit's -dirty; files git does not know show here
        tags["git.untracked"] = untracked_note(untracked)
    for name, path in inputs.items():
        if Path(path).exists():
            tags[f"dvc.md5.{name}"] = dvc_md5(path)
            tags[f"input.{name}"] = str(path)
    return tags


# --------------------------------------------------------------------------------------
# generate
# --------------------------------------------------------------------------------------


def generate(cfg: GenerateConfig, tracking: TrackingConfig | None = None,
             parent_run_id: str | None = None) -> StageResult:
    """Write the embedded task's datasets (deterministic in ``cfg.seed``)."""
    from rlhf_core.embedded.tasks import ProblemSpace, generate_datasets

    # The config carries every ProblemSpace field under the same name (plus sizes and seed).
    space = ProblemSpace(**{name: getattr(cfg, name) for name in ProblemSpace.__dataclass_fields__})
    paths = generate_datasets(Path(cfg.out_dir), seed=cfg.seed, n_sft=cfg.n_sft, n_preference=cfg.n_preference,
                              n_prompts=cfg.n_prompts, n_eval=cfg.n_eval, sft_noise=cfg.sft_noise,
                              sft_flaw=cfg.sft_flaw, flaw_min_len=cfg.flaw_min_len, space=space)
    outputs = {k: str(v) for k, v in paths.items()}
    result = StageResult(outputs, {k: dvc_md5(v) for k, v in outputs.items()})
    with _maybe_run(tracking, "generate", parent_run_id, lineage_tags({}, "generate")) as run:
        if run is not None:
            run.log_params(config_to_dict(cfg))
            run.set_tags({f"dvc.md5.output_{k}": v for k, v in result.md5.items()})
    return result


# --------------------------------------------------------------------------------------
# init-model
# --------------------------------------------------------------------------------------


def init_model(cfg: ModelConfig, tracking: TrackingConfig | None = None,
               parent_run_id: str | None = None) -> StageResult:
    """Train the tokenizer on the task corpus and build the tiny model from a config.

    The model is built in a unique temp folder beside ``out_dir`` and renamed into place, the
    previous model moved aside and removed only after (``checkpoint.replace_dir``): a crash at
    any point leaves the old model or the new one, never none and never half of one.
    """
    import tempfile

    from rlhf_core.tracking.checkpoint import fsync_tree, replace_dir, storage_guard, sweep_temps, temp_sibling
    from rlhf_core.data.io import read_records
    from rlhf_core.embedded.tiny_model import build_tiny_model, count_parameters, train_tokenizer

    from rlhf_core.data.formats import plain_text

    # A conversational file's words, not the reprs of its message lists.
    texts = [plain_text(r.get("prompt")) + plain_text(r.get("completion")) + plain_text(r.get("messages"))
             for r in read_records(cfg.corpus_file)]
    out = Path(cfg.out_dir)
    staging = temp_sibling(out)
    with tempfile.TemporaryDirectory() as tmp:
        tok_dir = train_tokenizer(texts, Path(tmp) / "tokenizer", vocab_size=cfg.vocab_size)
        try:
            with storage_guard(out, "cannot write the base model to"):
                out.parent.mkdir(parents=True, exist_ok=True)
                sweep_temps(out.parent, lambda name: name == out.name)  # left by killed writers
                build_tiny_model(tok_dir, staging, arch=cfg.arch, hidden_size=cfg.hidden_size,
                                 num_layers=cfg.num_layers, num_heads=cfg.num_heads, num_kv_heads=cfg.num_kv_heads,
                                 intermediate_size=cfg.intermediate_size, max_positions=cfg.max_positions,
                                 seed=cfg.seed, added_tokens=cfg.added_tokens)
                fsync_tree(staging)
                replace_dir(staging, out)
        finally:
            shutil.rmtree(staging, ignore_errors=True)  # only still there if something above failed
    result = StageResult({"model": str(out)}, {"model": dvc_md5(out)},
                         {"model/n_parameters": float(count_parameters(out))})
    with _maybe_run(tracking, "build-model", parent_run_id, lineage_tags({"corpus": cfg.corpus_file}, "init_model")) as run:
        if run is not None:
            run.log_params(config_to_dict(cfg))
            run.log_metrics(result.metrics, 0)
            run.set_tags({"dvc.md5.output_model": result.md5["model"]})
    return result


# --------------------------------------------------------------------------------------
# validate
# --------------------------------------------------------------------------------------


def validate(path: str | Path, kind: str, fields: DataFields | None = None,
             report_file: str | Path | None = None, tracking: TrackingConfig | None = None,
             parent_run_id: str | None = None, name: str | None = None,
             desirable_field: str | None = None, data_report: DataReportConfig | None = None,
             eval_file: str | None = None, previous: dict[str, float] | None = None,
             report_to_parent: bool = False) -> StageResult:
    """Run the Great Expectations gate; raise ``ValidationFailed`` (writing no file) on failure.

    On success, and only then, the report is written to ``report_file`` if given (DVC's
    validation stages depend on it, so SFT cannot run on an unvalidated file). Under a flow
    the report is logged to a nested run either way, so the UI shows what failed.
    ``desirable_field`` names the unpaired (KTO) kind's boolean field.

    With ``data_report`` (the flows give it for every dataset they train on) the data report
    follows a passed gate (:mod:`rlhf_core.data.report`: near-duplicates, contamination against
    ``eval_file``, statistics, drift against ``previous``, a former result's ``data/mean_*``
    metrics); its HTML page goes to the stage's run as ``data_report/<name>.html`` (and to the
    parent run too with ``report_to_parent``, a cycle's own run), and a failed check raises
    ``ValidationFailed`` with its report. ``report_file`` keeps the gate's report alone.
    """
    from rlhf_core.data.validate import ValidationFailed, validate_dataset

    with _maybe_run(tracking, f"validate-{name or kind}", parent_run_id,
                    lineage_tags({"dataset": path}, "validate")) as run:
        report = validate_dataset(path, kind, fields, desirable_field=desirable_field)
        if run is not None:
            run.log_dict(report.to_dict(), "validation_report.json")
            run.log_metrics({"data/n_rows": float(report.n_rows),
                             "data/failed_expectations": float(len(report.failures))}, 0)
            run.set_tags({"alignflow.data.form": report.form})
        if not report.success:
            raise ValidationFailed(report)
        stats = _data_report(path, kind, fields, data_report, eval_file, previous, run,
                             parent_run_id if report_to_parent else None, name or kind) if data_report else {}
    _remember_pass(path, kind, fields or DataFields(), report.n_rows, desirable_field)
    outputs: dict[str, str] = {"dataset": str(path)}
    if report_file is not None:
        outputs["report"] = str(_write_json_atomic(report.to_dict(), report_file))
    return StageResult(outputs, {"dataset": dvc_md5(path)}, {"data/n_rows": float(report.n_rows), **stats})


def _data_report(path: str | Path, kind: str, fields: DataFields | None, cfg: DataReportConfig,
                 eval_file: str | None, previous: dict[str, float] | None, run: Any, parent_run_id: str | None,
                 name: str) -> dict[str, float]:
    """Run the data report, log its page, JSON and rates; raise ``ValidationFailed`` if it fails."""
    from rlhf_core.data.report import data_report
    from rlhf_core.data.validate import ValidationFailed

    report = data_report(path, kind, cfg, fields, eval_file, previous)
    if run is not None:
        runs = [run] + ([type(run)(run.client, parent_run_id)] if parent_run_id and hasattr(run, "client") else [])
        for target in runs:
            _log_report_files(target, name, report.html, report.to_dict())
        run.log_metrics({**report.stats, "data/report_failed_expectations": float(len(report.failures))}, 0)
    if not report.success:
        raise ValidationFailed(report)
    return report.stats


def _log_report_files(run: Any, name: str, html: str, report: dict[str, Any]) -> None:
    """The data report's page (secrets redacted) and JSON, as ``data_report/<name>.html`` / ``.json``."""
    from rlhf_core.common.redact import redact_secrets

    run.log_text(redact_secrets(html), f"data_report/{name}.html")
    run.log_dict(report, f"data_report/{name}.json")


# --------------------------------------------------------------------------------------
# sft
# --------------------------------------------------------------------------------------


# The Great Expectations suite each named stage input must pass (a stage may override one: RL's prompts
# are ``prompt-only`` when its reward never reads labels, see :func:`rl`).
_GATE_KINDS = {"sft_train": "sft", "distill_train": "sft", "kept_samples": "sft", "preferences": "preference",
               "eval_preferences": "preference", "kto_train": "unpaired", "prompts": "prompts", "eval": "prompts"}


def _gate_key(path: str | Path, kind: str, fields: DataFields, desirable_field: str | None = None) -> str:
    """What a passed validation depends on: the file's content, the kind, the field names, the size
    limits and the validator's own code (a changed suite must not trust old passes)."""
    import hashlib

    from rlhf_core.data import io, streaming
    from rlhf_core.data import validate as validator

    limits = ("max_field_chars", "max_line_bytes")
    names = {f: getattr(fields, f) for f in DataFields.__dataclass_fields__ if f not in limits}
    if kind == "unpaired":  # only this kind reads it; other kinds keep their keys
        names["desirable_field"] = desirable_field or getattr(fields, "desirable_field", validator.DESIRABLE_FIELD)
    code = [hashlib.sha256(Path(m.__file__).read_bytes()).hexdigest() for m in (validator, streaming, io)]
    blob = json.dumps({"md5": dvc_md5(path), "kind": kind, "fields": names, "max_chars": fields.max_field_chars,
                       "max_line_bytes": fields.max_line_bytes, "validator": code}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()


def _gate_record(path: str | Path, kind: str, fields: DataFields, desirable_field: str | None = None) -> Path:
    from rlhf_core.tracking.mlflow_runs import project_root

    return project_root() / ".alignflow" / "validated" / f"{_gate_key(path, kind, fields, desirable_field)}.json"


def _remember_pass(path: str | Path, kind: str, fields: DataFields, n_rows: int,
                   desirable_field: str | None = None) -> None:
    _write_json_atomic({"path": str(path), "kind": kind, "n_rows": n_rows},
                       _gate_record(path, kind, fields, desirable_field))


def gate_datasets(fields: DataFields, datasets: dict[str, tuple[str, str]],
                  kinds: dict[str, str] | None = None) -> None:
    """Validate a training stage's datasets before anything is loaded or opened: the command-line
    stages get the same gate as the flows, so bad rows never reach a model (``ValidationFailed``).

    A file that already passed — same content, kind, fields and validator code, recorded under
    ``.alignflow/validated/`` by :func:`validate` or an earlier gate — is not validated again (in
    a flow or ``dvc repro`` the validate step just did it). ``kinds`` overrides :data:`_GATE_KINDS` by name."""
    from rlhf_core.data.validate import ValidationFailed, validate_dataset

    for name, (path, _) in datasets.items():
        kind = (kinds or {}).get(name) or _GATE_KINDS.get(name)
        if kind is None or not path or _gate_record(path, kind, fields).exists():
            continue
        report = validate_dataset(path, kind, fields)
        if not report.success:
            raise ValidationFailed(report)
        _remember_pass(path, kind, fields, report.n_rows)


def _report_key(path: str | Path, kind: str, fields: DataFields, cfg: DataReportConfig, eval_file: str) -> str:
    """What a passed data report depends on: the gate's key (file content, kind, fields, validator code),
    the thresholds, the eval set's content and the report's own code (changed checks must not trust old passes)."""
    import hashlib

    from rlhf_core.data import quality
    from rlhf_core.data import report as reporter

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
    from rlhf_core.data.report import data_report
    from rlhf_core.data.validate import ValidationFailed
    from rlhf_core.tracking.mlflow_runs import project_root

    out: dict[str, dict[str, Any]] = {}
    for name, (path, context) in datasets.items():
        kind = (kinds or {}).get(name) or _GATE_KINDS.get(name)
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


def _launcher(train_fn: Any, cfg: Any) -> Any:
    """``train_fn`` itself, or the Ray launcher that runs it on several workers / role actors."""
    if getattr(cfg, "placement", "none") != "none":
        from rlhf_core.trainers.rl_on_ray import train_rl_on_ray

        return train_rl_on_ray
    if cfg.num_workers > 1:
        import functools

        from rlhf_core.trainers.ray_launcher import train_data_parallel

        return functools.partial(train_data_parallel, train_fn)
    return train_fn


def _train_stage(name: str, cfg: Any, tracking: TrackingConfig, parent_run_id: str | None, *,
                 train_fn: Any, datasets: dict[str, tuple[str, str]], metrics_file: str | Path | None,
                 register_as: str | None = None, show_progress: bool = True,
                 extra_inputs: dict[str, str] | None = None, gate_kinds: dict[str, str] | None = None,
                 guards: GuardsConfig | None = None, data_report: DataReportConfig | None = None) -> StageResult:
    """Run a trainer inside one (nested) MLflow run: params, lineage tags, inputs, metrics, model.

    ``datasets`` maps a dataset name to ``(path, context)``; ``train_fn(cfg, sink=, show_progress=)``
    returns an object with ``output_dir`` and ``metrics`` (and optionally ``eval_samples`` and
    ``rendered_examples``, logged as ``eval_samples.json`` and :data:`RENDERED_EXAMPLES`).
    ``metrics_file`` receives deterministic metrics only (eval/*, train/loss*), since DVC hashes it.
    ``guards``: a policy stage's guards against its parent model (:func:`check_stage_guards`), logged to the run.
    The ``eval`` dataset is gated as ``prompts`` when every item has a label and ``prompt-only`` when none has
    (:func:`rlhf_core.data.validate.eval_kind`; a mix is a ``DataError`` naming file, line and field).
    ``data_report``: run the data report on the training datasets against ``cfg.eval_file`` before training
    (:func:`report_datasets`; the stage commands give it, the flows ran it in their validate step); its page,
    JSON and ``data/*`` metrics go to the run, never to ``metrics_file`` (the report does not change training).

    The trainer's checkpoints and its finished record are cleared last, once the model is tracked and
    registered: a stage that fails before that (the tracking server went away) and is retried reuses the
    saved output instead of training again (:func:`rlhf_core.trainers.loop.run_checkpointed`), and the
    retry continues the same MLflow run, which registers one model version.
    """
    from rlhf_core.tracking.checkpoint import clear_checkpoints
    from rlhf_core.trainers.loop import inject_fault
    from rlhf_core.tracking.mlflow_runs import start_run

    kinds = dict(gate_kinds or {})
    if datasets.get("eval", ("", ""))[0] and "eval" not in kinds:  # labelled, or not at all (a mix: DataError)
        from rlhf_core.data.validate import eval_kind

        kinds["eval"] = eval_kind(datasets["eval"][0], cfg.label_field)
    gate_datasets(cfg, datasets, kinds)
    reports = (report_datasets(cfg, datasets, kinds, data_report, getattr(cfg, "eval_file", "") or "")
               if data_report is not None else {})
    inputs = {"model": cfg.model_path, **{k: path for k, (path, _) in datasets.items()}}
    if getattr(cfg, "ref_model_path", ""):
        inputs["reference"] = cfg.ref_model_path
    inputs.update(extra_inputs or {})
    with start_run(tracking, name, parent_run_id, lineage_tags(inputs, name)) as run:
        run.log_params(config_to_dict(cfg))
        for ds_name, (path, context) in datasets.items():
            run.log_input(path, ds_name, dvc_md5(path), context)
        for ds_name, report in reports.items():
            _log_report_files(run, ds_name, report["html"], report["report"])
            run.log_metrics({**report["stats"], "data/report_failed_expectations": 0.0}, 0)
        from rlhf_core.tracking.plots import RecordingSink, curves_figure

        sink = RecordingSink(run)
        result = _launcher(train_fn, cfg)(cfg, sink=sink, show_progress=show_progress)
        figure = curves_figure(sink.history, f"{name}: {cfg.output_dir}")
        if figure is not None and hasattr(run, "log_figure"):
            run.log_figure(figure, "curves.png")
            import matplotlib.pyplot as plt

            plt.close(figure)
        if getattr(result, "eval_samples", None):
            run.log_dict(result.eval_samples, "eval_samples.json")
        if getattr(result, "rendered_examples", None):  # what the model saw: template, loss-carrying spans
            run.log_dict(result.rendered_examples, RENDERED_EXAMPLES)
        out_md5 = dvc_md5(result.output_dir)
        run.set_tags({"dvc.md5.output_model": out_md5})
        if guards is not None and guards.enabled and getattr(cfg, "eval_file", ""):
            result.metrics.update(check_stage_guards(name, cfg, Path(result.output_dir), guards, run,
                                                     getattr(result, "eval_answers", None)))
        inject_fault(name, "tracking")  # test hook (ALIGNFLOW_FAULT=<stage>:tracking): saved, not yet registered
        model_uri = run.log_hf_model(result.output_dir, register_as) if register_as else None
        if metrics_file is not None:
            _write_json_atomic({k: round(v, 6) for k, v in result.metrics.items()
                                if k.startswith(("eval/", "train/loss"))}, metrics_file)
        clear_checkpoints(cfg.checkpoint_dir)  # only now: a retry before this point reuses the saved output
        return StageResult({"model": str(result.output_dir)}, {"model": out_md5}, result.metrics,
                           run.run_id, model_uri)


# --------------------------------------------------------------------------------------
# guards: the trained model against the model it was trained from, on the held-out items
# --------------------------------------------------------------------------------------


def _reward_for_guards(stage: str, cfg: Any, guards: GuardsConfig, device: Any) -> tuple[Any, Any]:
    """The held-out reward and its identity (a cache key part; None: never cache): rl's own reward (model,
    function or server), else the reward model of ``guards.reward_model_path`` when that folder exists."""
    from rlhf_core.rewards.sources import RewardKind, build_reward_source, resolve_reward_file

    if stage == "rl":
        kind = RewardKind(cfg.reward_kind)
        if kind is RewardKind.MODEL:
            ident: Any = {"model": dvc_md5(cfg.reward_model_path)}
        elif kind is RewardKind.FUNCTION:
            file, fn = cfg.reward_function.rsplit(":", 1)
            ident = {"function": dvc_md5(resolve_reward_file(file)), "name": fn}
        else:
            ident = None  # a server's answers may change: never cache them
        from rlhf_core.trainers.rl import _build_reward_source

        return _build_reward_source(cfg, kind, device), ident
    if guards.reward_model_path and Path(guards.reward_model_path).is_dir():
        return (build_reward_source("model", path=guards.reward_model_path, device=device),
                {"model": dvc_md5(guards.reward_model_path)})
    return None, {"reward": None}


def check_stage_guards(stage: str, cfg: Any, child_dir: Path, guards: GuardsConfig, run: Any,
                       eval_answers: dict[str, Any] | None = None) -> dict[str, float]:
    """Answer the stage's eval items with its parent (``cfg.model_path``, cached) and the trained model, check every
    guard (:func:`rlhf_core.promotion.guards.check_guards`) and the gate, and log them to ``run``: ``guard/*`` metrics,
    ``guard.*`` tags (``guard.fired``, ``guard.gate``, ...), ``guards/report.json`` and ``guards/per_item.json``
    (both models' per-item results on the same items: what a paired comparison needs). Returns the metrics.

    ``eval_answers``: the stage's final eval's greedy answers (:class:`rlhf_core.rollout.evaluate.GreedyAnswers`), reused
    for the child when their settings are the probe's (:func:`rlhf_core.promotion.probe.reusable_answers`). A stage with
    an environment (``rl.environment``) is probed multi-turn with it, as its own eval answers
    (:func:`_probe_environment`; tag ``guard.probe``). With ``guards.gate_metric: command`` the user's metric command scores both models first
    (:func:`_metric_command_scores`); any fault there fails the stage before its model is registered."""
    from rlhf_core.promotion.probe import read_eval_items
    from rlhf_core.promotion.guards import check_guards, gate
    from rlhf_core.models.loading import load_tokenizer, pick_device
    from rlhf_core.common.redact import redact_secrets

    metric = _metric_command_scores(cfg, guards, child_dir, run) if guards.gate_metric == "command" else None
    device = pick_device()
    tokenizer = load_tokenizer(child_dir)
    items = read_eval_items(cfg.eval_file, tokenizer, prompt_field=cfg.prompt_field, label_field=cfg.label_field,
                            slice_field=guards.slice_field, max_items=getattr(cfg, "eval_items", 1000))
    reward_fn, reward_id = _reward_for_guards(stage, cfg, guards, device)
    env = _probe_environment(stage, cfg)
    run.set_tags({"guard.probe": "single-turn" if env is None else
                  f"multi-turn with the environment {redact_secrets(cfg.environment)} (max_turns {env.max_turns}, "
                  f"max_trajectory_tokens {env.max_trajectory_tokens}, max_new_tokens {env.max_new_tokens})"})
    parent, parent_answers = _probe_parent(cfg, guards, items, reward_fn, reward_id, device, env)
    child, child_answers = _probe_child(cfg, child_dir, tokenizer, items, reward_fn, device, eval_answers, run, env)
    report = check_guards(parent, child, guards, metric)
    decision = gate(report, guards)
    metrics = report.metrics()
    metrics["guard/gate_passed"] = float(decision.passed)
    parent_dir = Path(cfg.model_path)
    run.log_metrics(metrics, 0)
    run.set_tags({**report.tags(), "guard.gate": decision.text()[:4900], "guard.gate_metric": decision.metric,
                  "guard.gate_passed": str(decision.passed).lower(), "guard.parent_model": str(parent_dir),
                  "guard.parent_md5": dvc_md5(parent_dir)})
    run.log_dict({**report.to_dict(), "gate": decision.__dict__}, "guards/report.json")
    run.log_dict({"eval_file": str(cfg.eval_file), "eval_md5": dvc_md5(cfg.eval_file), "parent": str(parent_dir),
                  "child": str(child_dir), "items": [
                      {"i": i, "prompt": p, "label": None if y is None else str(y), "slice": sl,
                       "parent_answer": pa, "child_answer": ca,
                       "parent_correct": None if parent.correct is None else parent.correct[i],
                       "child_correct": None if child.correct is None else child.correct[i],
                       "parent_reward": None if parent.reward is None else parent.reward[i],
                       "child_reward": None if child.reward is None else child.reward[i]}
                      for i, (p, y, sl, pa, ca) in enumerate(zip(items.prompts, items.labels, items.slices,
                                                                 parent_answers, child_answers))]},
                 "guards/per_item.json")
    return metrics


def _probe_environment(stage: str, cfg: Any) -> Any:
    """The multi-turn probe setting of an rl stage with an environment (the environment, turn limit and token
    budgets of its own eval, :func:`rlhf_core.rollout.environments.evaluate_with_environment`), else None (single-turn)."""
    from rlhf_core.rollout.environments import environment_factory
    from rlhf_core.promotion.probe import ProbeEnvironment
    from rlhf_core.rewards.sources import resolve_reward_file

    if stage != "rl" or not getattr(cfg, "environment", ""):
        return None
    spec = cfg.environment
    make_env = environment_factory(spec, stop_tokens=cfg.environment_stop_tokens, timeout_s=cfg.reward_timeout_s,
                                   retries=cfg.reward_retries, backoff_cap_s=cfg.reward_backoff_cap_s,
                                   deadline_s=cfg.reward_deadline_s, token_env=cfg.environment_token_env,
                                   max_response_bytes=cfg.reward_max_response_bytes)
    limits = {"max_turns": cfg.max_turns, "max_trajectory_tokens": cfg.max_trajectory_tokens,
              "max_new_tokens": cfg.max_new_tokens, "tool_messages": cfg.tool_messages}
    identity = None  # a server's replies may change: never cache them
    if not spec.startswith(("http://", "https://")):
        file, fn = spec.rsplit(":", 1)
        identity = {"file": dvc_md5(resolve_reward_file(file)), "name": fn, **limits}
    return ProbeEnvironment(make_env, identity, **limits, prompt_field=cfg.prompt_field)


def _probe_settings(cfg: Any, guards: GuardsConfig, reward_id: Any, env: Any = None) -> dict[str, Any]:
    """What the parent's probe depends on besides the model and the eval file (its cache key's settings); a
    multi-turn probe adds its environment's identity, so it never reads a single-turn record (and single-turn keys
    stay what they were)."""
    settings = {"max_items": getattr(cfg, "eval_items", 1000), "max_new_tokens": getattr(cfg, "max_new_tokens", 12),
                "reward": reward_id, "fields": [cfg.prompt_field, cfg.label_field, guards.slice_field], "probe": 1}
    if env is not None:
        settings["environment"] = env.identity
    return settings


def _probe_parent(cfg: Any, guards: GuardsConfig, items: Any, reward_fn: Any, reward_id: Any,
                  device: Any, env: Any = None) -> tuple[Any, list[str]]:
    """The parent's probe record and answers: from the cache under ``.alignflow/probes/`` when there (never for a
    reward or an environment without an identity, a server), else answered now (multi-turn with ``env`` when
    given) and cached."""
    from rlhf_core.promotion.probe import load_cached, probe, probe_key, probe_with_environment, save_cached
    from rlhf_core.models.loading import load_causal_lm, load_tokenizer
    from rlhf_core.tracking.mlflow_runs import project_root

    parent_dir = Path(cfg.model_path)
    settings = _probe_settings(cfg, guards, reward_id, env)
    cacheable = reward_id and (env is None or env.identity is not None)
    cache = (project_root() / ".alignflow" / "probes" /
             f"{probe_key(dvc_md5(parent_dir), dvc_md5(cfg.eval_file), settings)}.json") if cacheable else None
    cached = load_cached(cache) if cache is not None else None
    if cached is None:
        parent_model = load_causal_lm(parent_dir, device)
        if env is not None:
            cached = probe_with_environment(parent_model, load_tokenizer(parent_dir), items, env, reward_fn=reward_fn)
        else:
            cached = probe(parent_model, load_tokenizer(parent_dir), items, reward_fn=reward_fn,
                           max_new_tokens=settings["max_new_tokens"])
        del parent_model
        if cache is not None:
            save_cached(cache, *cached)
    return cached


def _probe_child(cfg: Any, child_dir: Path, tokenizer: Any, items: Any, reward_fn: Any, device: Any,
                 eval_answers: dict[str, Any] | None, run: Any, env: Any = None) -> tuple[Any, list[str]]:
    """The trained model's probe record (KL against ``cfg.ref_model_path``, else the parent) and answers; the
    stage's final-eval answers stand in for generating them again when they match (tag ``guard.child_answers``).
    With ``env`` the child answers multi-turn, afresh (the stage's eval keeps only its first trajectories)."""
    from rlhf_core.promotion.probe import probe, probe_with_environment, reusable_answers
    from rlhf_core.models.loading import load_causal_lm

    reference_dir = Path(getattr(cfg, "ref_model_path", "") or cfg.model_path)
    child_model = load_causal_lm(child_dir, device)
    if env is not None:
        run.set_tags({"guard.child_answers": "generated by the probe (multi-turn, with the environment)"})
        reference = load_causal_lm(reference_dir, device)
        out = probe_with_environment(child_model, tokenizer, items, env, reward_fn=reward_fn, reference=reference)
        del child_model, reference
        return out
    answers = reusable_answers(eval_answers, child_model, eval_file=cfg.eval_file,
                               max_items=getattr(cfg, "eval_items", 1000),
                               max_new_tokens=getattr(cfg, "max_new_tokens", 12), prompt_field=cfg.prompt_field,
                               n_items=len(items.prompts))
    run.set_tags({"guard.child_answers": "reused from the stage's final eval" if answers is not None
                  else "generated by the probe"})
    reference = load_causal_lm(reference_dir, device)
    out = probe(child_model, tokenizer, items, reward_fn=reward_fn, reference=reference,
                max_new_tokens=getattr(cfg, "max_new_tokens", 12), answers=answers)
    del child_model, reference
    return out


def _metric_command_scores(cfg: Any, guards: GuardsConfig, child_dir: Path,
                           run: Any) -> tuple[list[float], list[float]]:
    """``guards.metric_command``'s per-item scores of the parent (cached on its md5, the eval file's, the command
    and the md5 of each existing file the command names) and of the child, paired by id
    (:mod:`rlhf_core.promotion.metric_command`); the pairs go to the run as ``guards/metric_scores.json``."""
    import shlex

    from rlhf_core.promotion.probe import probe_key
    from rlhf_core.promotion.metric_command import pair_scores, read_scores, run_metric_command
    from rlhf_core.tracking.mlflow_runs import project_root

    root, parent_dir = project_root(), Path(cfg.model_path)
    named = sorted({t for t in shlex.split(guards.metric_command) if "{" not in t and (root / t).is_file()})
    key = probe_key(dvc_md5(parent_dir), dvc_md5(cfg.eval_file),
                    {"command": guards.metric_command, "files": {t: dvc_md5(root / t) for t in named}})
    cache = root / ".alignflow" / "probes" / f"{key}.metric.jsonl"
    common = dict(eval_file=cfg.eval_file, cwd=root, timeout_s=guards.metric_command_timeout_s)
    if cache.exists():
        parent = read_scores(cache)
    else:
        parent = run_metric_command(guards.metric_command, model=parent_dir, out=cache.with_suffix(".tmp"), **common)
        os.replace(cache.with_suffix(".tmp"), cache)
    child_file = root / ".alignflow" / "metric" / f"{getattr(run, 'run_id', None) or 'stage'}-child.jsonl"
    child = run_metric_command(guards.metric_command, model=child_dir, out=child_file, **common)
    ids, parent_scores, child_scores = pair_scores(parent, child)
    run.log_dict({"command": guards.metric_command, "parent": str(parent_dir), "child": str(child_dir),
                  "items": [{"id": i, "parent": p, "child": c} for i, p, c in zip(ids, parent_scores, child_scores)]},
                 "guards/metric_scores.json")
    return parent_scores, child_scores



def sft(cfg: SFTConfig, tracking: TrackingConfig, parent_run_id: str | None = None,
        metrics_file: str | Path | None = None, show_progress: bool = True,
        data_report: DataReportConfig | None = None) -> StageResult:
    """Supervised fine-tuning, tracked with lineage; the model is logged and registered."""
    from rlhf_core.trainers.sft import train_sft

    return _train_stage("sft", cfg, tracking, parent_run_id, train_fn=train_sft,
                        datasets={"sft_train": (cfg.train_file, "training"), "eval": (cfg.eval_file, "evaluation")},
                        metrics_file=metrics_file, show_progress=show_progress, data_report=data_report,
                        register_as=tracking.registered_model if tracking.log_model else None)


def dpo(cfg: DPOConfig, tracking: TrackingConfig, parent_run_id: str | None = None,
        metrics_file: str | Path | None = None, show_progress: bool = True,
        guards: GuardsConfig | None = None,
        data_report: DataReportConfig | None = None) -> StageResult:
    """DPO/IPO/cDPO on preference pairs, tracked with lineage."""
    from rlhf_core.trainers.dpo import train_dpo

    return _train_stage("dpo", cfg, tracking, parent_run_id, train_fn=train_dpo,
                        datasets={"preferences": (cfg.train_file, "training"),
                                  "eval": (cfg.eval_file, "evaluation")},
                        metrics_file=metrics_file, show_progress=show_progress, data_report=data_report, guards=guards)


def reward(cfg: RewardConfig, tracking: TrackingConfig, parent_run_id: str | None = None,
           metrics_file: str | Path | None = None, show_progress: bool = True,
        data_report: DataReportConfig | None = None) -> StageResult:
    """Reward-model training, tracked with lineage; held-out pairwise accuracy and margin."""
    from rlhf_core.trainers.reward import train_reward_model

    datasets = {"preferences": (cfg.train_file, "training")}
    if cfg.eval_file:
        datasets["eval_preferences"] = (cfg.eval_file, "evaluation")
    return _train_stage("reward", cfg, tracking, parent_run_id, train_fn=train_reward_model, datasets=datasets,
                        metrics_file=metrics_file, show_progress=show_progress, data_report=data_report)


def kto(cfg: KTOConfig, tracking: TrackingConfig, parent_run_id: str | None = None,
        metrics_file: str | Path | None = None, show_progress: bool = True,
        guards: GuardsConfig | None = None,
        data_report: DataReportConfig | None = None) -> StageResult:
    """KTO on unpaired (or split preference) examples, tracked with lineage."""
    from rlhf_core.trainers.kto import train_kto

    return _train_stage("kto", cfg, tracking, parent_run_id, train_fn=train_kto,
                        datasets={"kto_train": (cfg.train_file, "training"), "eval": (cfg.eval_file, "evaluation")},
                        metrics_file=metrics_file, show_progress=show_progress, data_report=data_report, guards=guards)


def distill(cfg: DistillConfig, tracking: TrackingConfig, parent_run_id: str | None = None,
            metrics_file: str | Path | None = None, show_progress: bool = True,
        guards: GuardsConfig | None = None,
        data_report: DataReportConfig | None = None) -> StageResult:
    """Knowledge distillation from ``cfg.teacher_path``, tracked with lineage (the teacher is an input)."""
    from rlhf_core.trainers.distill import train_distill

    return _train_stage("distill", cfg, tracking, parent_run_id, train_fn=train_distill,
                        datasets={"distill_train": (cfg.train_file, "training"),
                                  "eval": (cfg.eval_file, "evaluation")},
                        metrics_file=metrics_file, show_progress=show_progress, data_report=data_report, guards=guards,
                        extra_inputs={"teacher": cfg.teacher_path})


def raft(cfg: RaftConfig, tracking: TrackingConfig, parent_run_id: str | None = None,
         metrics_file: str | Path | None = None, show_progress: bool = True,
        guards: GuardsConfig | None = None,
        data_report: DataReportConfig | None = None) -> StageResult:
    """SFT of the policy on its own kept best-of-n samples (one RAFT round), tracked with lineage."""
    from rlhf_core.trainers.sft import train_sft

    return _train_stage("raft", cfg, tracking, parent_run_id, train_fn=train_sft,
                        datasets={"kept_samples": (cfg.train_file, "training"),
                                  "eval": (cfg.eval_file, "evaluation")},
                        metrics_file=metrics_file, show_progress=show_progress, data_report=data_report, guards=guards)


def rl(cfg: RLConfig, tracking: TrackingConfig, parent_run_id: str | None = None,
       metrics_file: str | Path | None = None, show_progress: bool = True,
        guards: GuardsConfig | None = None,
        data_report: DataReportConfig | None = None) -> StageResult:
    """Online RL (PPO, REINFORCE++, RLOO, GRPO, Dr.GRPO) from the policy's own samples, tracked with lineage.

    The reward model (reward_kind model) and a critic start other than the policy are lineage inputs;
    a reward function file is recorded by path in the params. The prompts need labels only for a reward
    that reads them (:attr:`RewardKind.reads_labels`); the eval file has a label on every item (exact match) or
    on none (no accuracy: ``eval/reward_model_score`` and the guards' reward gate, see :func:`_train_stage`).
    """
    from rlhf_core.data.validate import prompts_kind
    from rlhf_core.rewards.sources import RewardKind
    from rlhf_core.trainers.rl import train_rl

    extra: dict[str, str] = {}
    if RewardKind(cfg.reward_kind) is RewardKind.MODEL:
        extra["reward_model"] = cfg.reward_model_path
    if cfg.critic_model_path:
        extra["critic"] = cfg.critic_model_path
    if cfg.teacher_model_path:
        extra["teacher"] = cfg.teacher_model_path
    return _train_stage("rl", cfg, tracking, parent_run_id, train_fn=train_rl,
                        datasets={"prompts": (cfg.prompts_file, "training"),
                                  "eval": (cfg.eval_file, "evaluation")},
                        metrics_file=metrics_file, show_progress=show_progress, data_report=data_report, guards=guards, extra_inputs=extra,
                        gate_kinds={"prompts": prompts_kind(RewardKind(cfg.reward_kind).reads_labels)})


# --------------------------------------------------------------------------------------
# rejection sampling
# --------------------------------------------------------------------------------------


def rejection(cfg: RejectionConfig, tracking: TrackingConfig, parent_run_id: str | None = None,
              metrics_file: str | Path | None = None, show_progress: bool = True) -> StageResult:
    """Best-of-n sampling scored by the reward model or the rule; writes kept samples and pairs."""
    from rlhf_core.rollout.rejection import rejection_sample
    from rlhf_core.tracking.mlflow_runs import start_run

    inputs = {"policy": cfg.policy_path, "prompts": cfg.prompts_file}
    if cfg.scorer == "reward_model":
        inputs["reward_model"] = cfg.reward_model_path
    with start_run(tracking, "rejection", parent_run_id, lineage_tags(inputs, "rejection")) as run:
        run.log_params(config_to_dict(cfg))
        run.log_input(cfg.prompts_file, "prompts", dvc_md5(cfg.prompts_file), "sampling")
        result = rejection_sample(cfg, show_progress=show_progress)
        outputs = {"kept": str(result.output_file), "pairs": str(result.pairs_file)}
        md5 = {k: dvc_md5(v) for k, v in outputs.items()}
        run.set_tags({f"dvc.md5.output_{k}": v for k, v in md5.items()})
        run.log_metrics(result.metrics, 0)
        if metrics_file is not None:
            _write_json_atomic({k: round(v, 6) for k, v in result.metrics.items()}, metrics_file)
        return StageResult(outputs, md5, result.metrics, run.run_id)


# --------------------------------------------------------------------------------------
# evaluate
# --------------------------------------------------------------------------------------


def evaluate(cfg: EvalConfig, tracking: TrackingConfig, parent_run_id: str | None = None,
             run_name: str = "evaluate") -> StageResult:
    """Greedy exact-match accuracy of ``cfg.model_path``; writes ``cfg.output_file``."""
    import torch

    from rlhf_core.rollout.evaluate import evaluate_exact_match
    from rlhf_core.models.loading import load_causal_lm, load_tokenizer
    from rlhf_core.tracking.mlflow_runs import start_run

    if not torch.cuda.is_available():
        torch.set_num_threads(cfg.num_threads)
    inputs = {"model": cfg.model_path, "eval": cfg.eval_file}
    with start_run(tracking, run_name, parent_run_id, lineage_tags(inputs, "evaluate")) as run:
        run.log_params(config_to_dict(cfg))
        run.log_input(cfg.eval_file, "eval", dvc_md5(cfg.eval_file), "evaluation")
        started = time.perf_counter()
        model = load_causal_lm(cfg.model_path)
        tokenizer = load_tokenizer(cfg.model_path)
        result = evaluate_exact_match(model, tokenizer, cfg.eval_file, prompt_field=cfg.prompt_field,
                                      label_field=cfg.label_field, max_items=cfg.max_items,
                                      max_new_tokens=cfg.max_new_tokens, batch_size=cfg.batch_size,
                                      show_progress=True)
        metrics = result.metrics("eval")
        run.log_metrics({**metrics, "perf/eval_seconds": time.perf_counter() - started}, 0)
        run.log_dict(result.samples, "eval_samples.json")
        out = _write_json_atomic({k: round(v, 6) for k, v in metrics.items()}, cfg.output_file)
        return StageResult({"metrics": str(out)}, {"metrics": dvc_md5(out)}, metrics, run.run_id)

