"""Stage entry points: config in, files out, with validation, tracking and lineage around the core.

Each function here is what one pipeline stage *is*, called identically by the CLI (and so
by ``dvc repro``) and by the Prefect tasks of ``tasks/``. A stage reads its typed config,
writes its outputs atomically, opens an MLflow run (nested under ``parent_run_id`` when a
flow runs it), tags it with the git commit and the DVC md5 of every input, and returns
paths and hashes — never tensors or models — so orchestration layers stay thin.
"""

from __future__ import annotations

import functools
import json
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rlhf_core.common.atomic_io import write_text_atomic
from rlhf_core.common.faults import inject_fault
from rlhf_core.common.offline import arm_stack_dumps
from rlhf_core.config import (
    DataFields,
    DataReportConfig,
    DistillConfig,
    DPOConfig,
    EvalConfig,
    GenerateConfig,
    GuardsConfig,
    GymGenerateConfig,
    ImportModelConfig,
    KTOConfig,
    ModelConfig,
    RaftConfig,
    RejectionConfig,
    RewardConfig,
    RLConfig,
    SFTConfig,
    TrackingConfig,
    config_params,
)
from rlhf_core.data.formats import plain_text
from rlhf_core.data.gym_tasks import write_gym_datasets
from rlhf_core.data.io import read_records
from rlhf_core.data.validate import ValidationFailed, prompts_kind, validate_dataset
from rlhf_core.embedded.tasks import ProblemSpace, generate_datasets
from rlhf_core.embedded.tiny_model import build_tiny_model, count_parameters, train_tokenizer
from rlhf_core.stages.gate import data_report_of, gate_inputs, remember_pass
from rlhf_core.stages.guard import check_stage_guards
from rlhf_core.tracking.lineage import dvc_md5, lineage_tags, use_hash_cache
from rlhf_core.tracking.mlflow_runs import start_run
from rlhf_core.tracking.plots import RecordingSink, curves_figure
from rlhf_core.tracking.run_dashboard import DASHBOARD_ARTIFACT, DASHBOARD_TAG
from rlhf_core.tracking.stage_run import maybe_run, open_stage_run

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


def _use_tracking(tracking: TrackingConfig | None) -> None:
    """This process's md5 cache as ``tracking.hash_cache`` says, when a stage is given a tracking config."""
    if tracking is not None:
        use_hash_cache(tracking.hash_cache)


def _write_json_atomic(obj: Any, path: str | Path) -> Path:
    return write_text_atomic(path, json.dumps(obj, indent=2, sort_keys=True) + "\n")


# --------------------------------------------------------------------------------------
# generate
# --------------------------------------------------------------------------------------


def generate(cfg: GenerateConfig, tracking: TrackingConfig | None = None,
             parent_run_id: str | None = None) -> StageResult:
    """Write the embedded task's datasets (deterministic in ``cfg.seed``)."""
    _use_tracking(tracking)
    # The config carries every ProblemSpace field under the same name (plus sizes and seed).
    space = ProblemSpace(**{name: getattr(cfg, name) for name in ProblemSpace.__dataclass_fields__})
    paths = generate_datasets(Path(cfg.out_dir), seed=cfg.seed, n_sft=cfg.n_sft, n_preference=cfg.n_preference,
                              n_prompts=cfg.n_prompts, n_eval=cfg.n_eval, sft_noise=cfg.sft_noise,
                              sft_flaw=cfg.sft_flaw, flaw_min_len=cfg.flaw_min_len, space=space)
    outputs = {k: str(v) for k, v in paths.items()}
    result = StageResult(outputs, {k: dvc_md5(v) for k, v in outputs.items()})
    with maybe_run(tracking, "generate", parent_run_id, lineage_tags({}, "generate")) as run:
        if run is not None:
            run.log_params(config_params(cfg))
            run.set_tags({f"dvc.md5.output_{k}": v for k, v in result.md5.items()})
    return result


def gym_generate(cfg: GymGenerateConfig, tracking: TrackingConfig | None = None, parent_run_id: str | None = None,
                 section: str = GymGenerateConfig.section) -> StageResult:
    """Write a reasoning-gym task's datasets and their manifest (rlhf_core/data/gym_tasks.py); errors name
    ``section``'s fields."""
    _use_tracking(tracking)
    outputs = {k: str(v) for k, v in write_gym_datasets(cfg, section).items()}
    result = StageResult(outputs, {k: dvc_md5(v) for k, v in outputs.items()})
    with maybe_run(tracking, "gym-generate", parent_run_id, lineage_tags({}, "gym-generate")) as run:
        if run is not None:
            manifest = json.loads(Path(outputs["manifest"]).read_text())
            run.log_params(config_params(cfg))
            run.set_tags({"gym.task": cfg.task, "gym.version": manifest["version"],
                          **{f"dvc.md5.output_{k}": v for k, v in result.md5.items()}})
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
    from rlhf_core.tracking.checkpoint import (  # lazy: torch (light `alignflow validate`)
        fsync_tree, replace_dir, storage_guard, sweep_temps, temp_sibling)

    _use_tracking(tracking)
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
    with maybe_run(tracking, "build-model", parent_run_id, lineage_tags({"corpus": cfg.corpus_file}, "init_model")) as run:
        if run is not None:
            run.log_params(config_params(cfg))
            run.log_metrics(result.metrics, 0)
            run.set_tags({"dvc.md5.output_model": result.md5["model"]})
    return result


# --------------------------------------------------------------------------------------
# import-model
# --------------------------------------------------------------------------------------


def import_model(cfg: ImportModelConfig, tracking: TrackingConfig | None = None,
                 parent_run_id: str | None = None) -> StageResult:
    """Import a pretrained model (a package's GGUF file or a local HF folder) into ``cfg.out_dir``.

    The source is checked first (:func:`rlhf_core.models.importing.resolve_source`: package, version, file,
    sha256, GGUF header): a refusal writes nothing. The folder is written in a unique temp folder beside
    ``out_dir`` and renamed into place as ``init_model`` does, so an error leaves the previous folder or none.
    """
    from rlhf_core.models import importing  # lazy: torch (light `alignflow validate`)
    from rlhf_core.tracking.checkpoint import (  # lazy: torch (light `alignflow validate`)
        fsync_tree, replace_dir, storage_guard, sweep_temps, temp_sibling)

    _use_tracking(tracking)
    source = importing.resolve_source(cfg)
    out = Path(cfg.out_dir)
    staging = temp_sibling(out)
    try:
        with storage_guard(out, "cannot write the imported model to"):
            out.parent.mkdir(parents=True, exist_ok=True)
            sweep_temps(out.parent, lambda name: name == out.name)  # left by killed writers
            made = importing.write_model_folder(cfg, source, staging)
            fsync_tree(staging)
            replace_dir(staging, out)
    finally:
        shutil.rmtree(staging, ignore_errors=True)  # only still there if something above failed
    result = StageResult({"model": str(out)}, {"model": dvc_md5(out)},
                         {"model/n_parameters": float(made["n_parameters"])})
    source_tags = ({"import.package": cfg.package, "import.package_version": cfg.package_version,
                    "import.file": cfg.file, "import.sha256": cfg.sha256} if cfg.package
                   else {"import.source_dir": cfg.source_dir})
    inputs = {"source": cfg.source_dir} if not cfg.package else {}
    with maybe_run(tracking, "import-model", parent_run_id, lineage_tags(inputs, "import_model")) as run:
        if run is not None:
            run.log_params(config_params(cfg))
            run.log_metrics(result.metrics, 0)
            run.set_tags({**source_tags, "import.dtype": cfg.dtype, "import.architecture": made["architecture"],
                          "dvc.md5.output_model": result.md5["model"]})
            result.run_id = run.run_id
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
    _use_tracking(tracking)
    with maybe_run(tracking, f"validate-{name or kind}", parent_run_id,
                    lineage_tags({"dataset": path}, "validate")) as run:
        report = validate_dataset(path, kind, fields, desirable_field=desirable_field)
        if run is not None:
            run.log_dict(report.to_dict(), "validation_report.json")
            run.log_metrics({"data/n_rows": float(report.n_rows),
                             "data/failed_expectations": float(len(report.failures))}, 0)
            run.set_tags({"alignflow.data.form": report.form})
        if not report.success:
            raise ValidationFailed(report)
        stats = data_report_of(path, kind, fields, data_report, eval_file, previous, run,
                             parent_run_id if report_to_parent else None, name or kind) if data_report else {}
    remember_pass(path, kind, fields or DataFields(), report.n_rows, desirable_field)
    outputs: dict[str, str] = {"dataset": str(path)}
    if report_file is not None:
        outputs["report"] = str(_write_json_atomic(report.to_dict(), report_file))
    return StageResult(outputs, {"dataset": dvc_md5(path)}, {"data/n_rows": float(report.n_rows), **stats})


def _launcher(train_fn: Any, cfg: Any) -> Any:
    """``train_fn`` itself, or the Ray launcher that runs it on several workers / role actors."""
    if getattr(getattr(cfg, "distribution", None), "placement", "none") != "none":
        from rlhf_core.trainers.rl_on_ray import train_rl_on_ray  # lazy: ray (multi-worker runs only)

        return train_rl_on_ray
    if cfg.num_workers > 1:
        from rlhf_core.trainers.ray_launcher import train_data_parallel  # lazy: ray (multi-worker runs only)

        return functools.partial(train_data_parallel, train_fn)
    return train_fn


def _train_stage(name: str, cfg: Any, tracking: TrackingConfig, parent_run_id: str | None, *,
                 train_fn: Any, datasets: dict[str, tuple[str, str]], metrics_file: str | Path | None,
                 register_as: str | None = None, show_progress: bool = True,
                 extra_inputs: dict[str, str] | None = None, gate_kinds: dict[str, str] | None = None,
                 guards: GuardsConfig | None = None, data_report: DataReportConfig | None = None) -> StageResult:
    """Run a trainer as a stage: gate its inputs -> open its run with their lineage -> train -> guards -> register.

    ``datasets`` maps a dataset name to ``(path, context)``: gated by kind (``gate_kinds`` overriding the defaults),
    and with ``data_report`` reported on against ``cfg.eval_file`` before training
    (:func:`rlhf_core.stages.gate.gate_inputs`; the stage commands give it, the flows ran it in their validate step:
    its page, JSON and ``data/*`` metrics go to the run, never to ``metrics_file``). The run
    (:func:`rlhf_core.tracking.stage_run.open_stage_run`) holds the params, lineage tags and inputs (``extra_inputs``
    besides the start model, datasets and reference). ``train_fn(cfg, sink=, show_progress=)`` returns an object with
    ``output_dir`` and ``metrics`` (and optionally ``eval_samples`` and ``rendered_examples``), recorded into the run
    (:func:`_record_training`). ``guards``: a policy stage's guards against its parent
    model (:func:`rlhf_core.stages.guard.check_stage_guards`), logged to the run. ``register_as``: the registered
    model's name. ``metrics_file`` receives deterministic metrics only (eval/*, train/loss*), since DVC hashes it.

    The trainer's checkpoints and its finished record are cleared last, once the model is tracked and
    registered: a stage that fails before that (the tracking server went away) and is retried reuses the
    saved output instead of training again (:func:`rlhf_core.trainers.loop.run_checkpointed`), and the
    retry continues the same MLflow run, which registers one model version.
    """
    arm_stack_dumps(cfg.stack_dump_s)
    _use_tracking(tracking)
    reports = gate_inputs(cfg, datasets, gate_kinds, data_report)
    with open_stage_run(tracking, name, parent_run_id, cfg, datasets, extra_inputs, reports) as run:
        result, out_md5 = _train(name, cfg, train_fn, run, show_progress)
        if guards is not None and guards.enabled and getattr(cfg, "eval_file", ""):
            result.metrics.update(check_stage_guards(name, cfg, Path(result.output_dir), guards, run,
                                                     getattr(result, "eval_answers", None)))
        model_uri = _register(name, cfg, run, result, register_as, metrics_file)
        return StageResult({"model": str(result.output_dir)}, {"model": out_md5}, result.metrics,
                           run.run_id, model_uri)


def _train(name: str, cfg: Any, train_fn: Any, run: Any, show_progress: bool) -> tuple[Any, str]:
    """The trainer (in this process or through the Ray launcher), its curves and output recorded into ``run``;
    returns its result and the output model's md5."""
    sink = RecordingSink(run)
    result = _launcher(train_fn, cfg)(cfg, sink=sink, show_progress=show_progress)
    return result, _record_training(run, f"{name}: {cfg.output_dir}", result, sink.history)


def _record_training(run: Any, title: str, result: Any, history: Any) -> str:
    """Log what the trainer left to ``run``: its curves (``history``: the sink's; ``title`` above them), eval samples,
    rendered examples and an RL run's dashboard (tagged ``alignflow.dashboard``); tag and return the output model's
    md5."""
    figure = curves_figure(history, title)
    if figure is not None and hasattr(run, "log_figure"):
        run.log_figure(figure, "curves.png")
        import matplotlib.pyplot as plt  # lazy: matplotlib (only when curves are drawn)

        plt.close(figure)
    if getattr(result, "eval_samples", None):
        run.log_dict(result.eval_samples, "eval_samples.json")
    if getattr(result, "rendered_examples", None):  # what the model saw: template, loss-carrying spans
        run.log_dict(result.rendered_examples, RENDERED_EXAMPLES)
    dashboard = getattr(result, "dashboard", None)  # online RL: the run dashboard (one offline HTML page)
    if dashboard is not None and Path(dashboard).exists():
        run.log_text(Path(dashboard).read_text(encoding="utf-8"), DASHBOARD_ARTIFACT)
        run.set_tags({DASHBOARD_TAG: DASHBOARD_ARTIFACT})
    out_md5 = dvc_md5(result.output_dir)
    run.set_tags({"dvc.md5.output_model": out_md5})
    return out_md5


def _register(name: str, cfg: Any, run: Any, result: Any, register_as: str | None,
              metrics_file: str | Path | None) -> str | None:
    """The model registered (``register_as``), the metrics file written, then the checkpoints cleared; returns
    the registered model's URI."""
    from rlhf_core.tracking.checkpoint import clear_checkpoints  # lazy: torch (light `alignflow validate`)

    inject_fault(name, "tracking")  # test hook (ALIGNFLOW_FAULT=<stage>:tracking): saved, not yet registered
    model_uri = run.log_hf_model(result.output_dir, register_as) if register_as else None
    if metrics_file is not None:
        _write_json_atomic({k: round(v, 6) for k, v in result.metrics.items()
                            if k.startswith(("eval/", "train/loss"))}, metrics_file)
    clear_checkpoints(cfg.checkpoint_dir)  # only now: a retry before this point reuses the saved output
    return model_uri


# --------------------------------------------------------------------------------------
# the training stages
# --------------------------------------------------------------------------------------


def sft(cfg: SFTConfig, tracking: TrackingConfig, parent_run_id: str | None = None,
        metrics_file: str | Path | None = None, show_progress: bool = True,
        data_report: DataReportConfig | None = None) -> StageResult:
    """Supervised fine-tuning, tracked with lineage; the model is logged and registered."""
    from rlhf_core.trainers.sft import train_sft  # lazy: torch (light `alignflow validate`)

    return _train_stage("sft", cfg, tracking, parent_run_id, train_fn=train_sft,
                        datasets={"sft_train": (cfg.train_file, "training"), "eval": (cfg.eval_file, "evaluation")},
                        metrics_file=metrics_file, show_progress=show_progress, data_report=data_report,
                        register_as=tracking.registered_model if tracking.log_model else None)


def dpo(cfg: DPOConfig, tracking: TrackingConfig, parent_run_id: str | None = None,
        metrics_file: str | Path | None = None, show_progress: bool = True,
        guards: GuardsConfig | None = None,
        data_report: DataReportConfig | None = None) -> StageResult:
    """DPO/IPO/cDPO on preference pairs, tracked with lineage."""
    from rlhf_core.trainers.dpo import train_dpo  # lazy: torch (light `alignflow validate`)

    return _train_stage("dpo", cfg, tracking, parent_run_id, train_fn=train_dpo,
                        datasets={"preferences": (cfg.train_file, "training"),
                                  "eval": (cfg.eval_file, "evaluation")},
                        metrics_file=metrics_file, show_progress=show_progress, data_report=data_report, guards=guards)


def reward(cfg: RewardConfig, tracking: TrackingConfig, parent_run_id: str | None = None,
           metrics_file: str | Path | None = None, show_progress: bool = True,
        data_report: DataReportConfig | None = None) -> StageResult:
    """Reward-model training, tracked with lineage; held-out pairwise accuracy and margin."""
    from rlhf_core.trainers.reward import train_reward_model  # lazy: torch (light `alignflow validate`)

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
    from rlhf_core.trainers.kto import train_kto  # lazy: torch (light `alignflow validate`)

    return _train_stage("kto", cfg, tracking, parent_run_id, train_fn=train_kto,
                        datasets={"kto_train": (cfg.train_file, "training"), "eval": (cfg.eval_file, "evaluation")},
                        metrics_file=metrics_file, show_progress=show_progress, data_report=data_report, guards=guards,
                        gate_kinds={"kto_train": "unpaired"})


def distill(cfg: DistillConfig, tracking: TrackingConfig, parent_run_id: str | None = None,
            metrics_file: str | Path | None = None, show_progress: bool = True,
        guards: GuardsConfig | None = None,
        data_report: DataReportConfig | None = None) -> StageResult:
    """Knowledge distillation from ``cfg.teacher_path``, tracked with lineage (the teacher is an input)."""
    from rlhf_core.trainers.distill import train_distill  # lazy: torch (light `alignflow validate`)

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
    from rlhf_core.trainers.sft import train_sft  # lazy: torch (light `alignflow validate`)

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
    from rlhf_core.rewards.sources import RewardKind  # lazy: torch (light `alignflow validate`)
    from rlhf_core.trainers.rl import train_rl  # lazy: torch (light `alignflow validate`)

    extra: dict[str, str] = {}
    if RewardKind(cfg.reward.kind) is RewardKind.MODEL:
        extra["reward_model"] = cfg.reward.model_path
    if cfg.critic_model_path:
        extra["critic"] = cfg.critic_model_path
    if cfg.distill.teacher_model_path:
        extra["teacher"] = cfg.distill.teacher_model_path
    return _train_stage("rl", cfg, tracking, parent_run_id, train_fn=train_rl,
                        datasets={"prompts": (cfg.prompts_file, "training"),
                                  "eval": (cfg.eval_file, "evaluation")},
                        metrics_file=metrics_file, show_progress=show_progress, data_report=data_report, guards=guards, extra_inputs=extra,
                        gate_kinds={"prompts": prompts_kind(RewardKind(cfg.reward.kind).reads_labels)})


# --------------------------------------------------------------------------------------
# rejection sampling
# --------------------------------------------------------------------------------------


def rejection(cfg: RejectionConfig, tracking: TrackingConfig, parent_run_id: str | None = None,
              metrics_file: str | Path | None = None, show_progress: bool = True) -> StageResult:
    """Best-of-n sampling scored by the reward model or the rule; writes kept samples and pairs."""
    from rlhf_core.rollout.rejection import rejection_sample  # lazy: torch (light `alignflow validate`)

    _use_tracking(tracking)
    inputs = {"policy": cfg.policy_path, "prompts": cfg.prompts_file}
    if cfg.scorer == "reward_model":
        inputs["reward_model"] = cfg.reward_model_path
    with start_run(tracking, "rejection", parent_run_id, lineage_tags(inputs, "rejection")) as run:
        run.log_params(config_params(cfg))
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
    """Greedy accuracy of ``cfg.model_path`` (exact match, or ``cfg.label_check``; ``cfg.format_check`` adds the
    format rate); writes ``cfg.output_file``."""
    import torch  # lazy: torch (light `alignflow validate`)

    from rlhf_core.rollout.evaluate import eval_options, evaluate_exact_match  # lazy: torch (light `alignflow validate`)
    from rlhf_core.models.loading import load_causal_lm, load_tokenizer  # lazy: torch (light `alignflow validate`)

    _use_tracking(tracking)
    if not torch.cuda.is_available():
        torch.set_num_threads(cfg.num_threads)
    inputs = {"model": cfg.model_path, "eval": cfg.eval_file}
    with start_run(tracking, run_name, parent_run_id, lineage_tags(inputs, "evaluate")) as run:
        run.log_params(config_params(cfg))
        run.log_input(cfg.eval_file, "eval", dvc_md5(cfg.eval_file), "evaluation")
        started = time.perf_counter()
        model = load_causal_lm(cfg.model_path)
        tokenizer = load_tokenizer(cfg.model_path)
        result = evaluate_exact_match(model, tokenizer, cfg.eval_file, max_items=cfg.max_items,
                                      max_new_tokens=cfg.max_new_tokens, batch_size=cfg.batch_size,
                                      show_progress=True, **eval_options(cfg))
        metrics = result.metrics("eval")
        run.log_metrics({**metrics, "perf/eval_seconds": time.perf_counter() - started}, 0)
        run.log_dict(result.samples, "eval_samples.json")
        out = _write_json_atomic({k: round(v, 6) for k, v in metrics.items()}, cfg.output_file)
        return StageResult({"metrics": str(out)}, {"metrics": dvc_md5(out)}, metrics, run.run_id)

