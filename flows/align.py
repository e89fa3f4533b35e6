"""The main alignment flow: generate -> validate -> build model -> SFT -> evaluate.

One Prefect flow run = one parent MLflow run; every stage is a Prefect task and a nested
MLflow run. User data and models replace the embedded default stage by stage: give
``sft_file`` and the generator is not needed for it, give ``base_model`` and no tiny model
is built. Every dataset is validated before any training starts, so bad input stops the
flow with the Great Expectations report and nothing downstream runs.

Run: ``alignflow flow align`` (or ``python -m flows.align``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from prefect import flow, get_run_logger
from prefect.runtime import flow_run

from rlhf_core.config import (
    SECTIONS,
    ConfigError,
    DataFields,
    EvalConfig,
    FlowConfig,
    GenerateConfig,
    ModelConfig,
    SFTConfig,
    TrackingConfig,
    build_config,
    config_to_dict,
    read_params,
)
from rlhf_core.lineage import dvc_md5
from rlhf_core.stages import lineage_tags
from rlhf_core.tracking import resolve_tracking_uri, start_run
from tasks.data import generate_data, validate_data
from tasks.evaluation import evaluate_model
from tasks.models import build_base_model
from tasks.training import train_sft

DATASET_KINDS = {"sft": "sft", "preferences": "preference", "prompts": "prompts", "eval": "prompts"}


def load_all(params_file: str | None, overrides: dict[str, dict[str, Any]] | None) -> dict[str, Any]:
    """Every section's typed config, from ``params_file`` plus ``{section: {field: value}}`` overrides."""
    raw = read_params(params_file) if params_file and Path(params_file).exists() else {}
    overrides = overrides or {}
    unknown = set(overrides) - set(SECTIONS)
    if unknown:
        raise ConfigError(f"overrides: unknown section(s) {sorted(unknown)}; known: {sorted(SECTIONS)}")
    return {name: build_config(cls, name, {**(raw.get(name) or {}), **overrides.get(name, {})},
                               str(params_file or "<defaults>"))
            for name, cls in SECTIONS.items()}


def _intact(result: dict[str, Any]) -> bool:
    """True when every output a (possibly cached) task result names still has its md5."""
    return all(Path(result["outputs"][k]).exists() and dvc_md5(result["outputs"][k]) == md5
               for k, md5 in result["md5"].items() if k in result["outputs"])


def _run(task_fn: Any, use_cache: bool, **kwargs: Any) -> dict[str, Any]:
    """Run a task; a cache hit whose outputs were deleted or changed is recomputed."""
    if not use_cache:
        return task_fn.with_options(refresh_cache=True)(**kwargs)
    result = task_fn(**kwargs)
    if not _intact(result):
        result = task_fn.with_options(refresh_cache=True)(**kwargs)
    return result


@flow(name="align", log_prints=True)
def align(
    params_file: str | None = "params.yaml",
    overrides: dict[str, dict[str, Any]] | None = None,
    sft_file: str | None = None,
    preference_file: str | None = None,
    prompts_file: str | None = None,
    eval_file: str | None = None,
    base_model: str | None = None,
) -> dict[str, Any]:
    """Run the alignment pipeline; returns paths, md5s, run ids and the headline metrics."""
    logger = get_run_logger()
    cfg = load_all(params_file, overrides)
    gen: GenerateConfig = cfg["generate"]
    model_cfg: ModelConfig = cfg["model"]
    sft_cfg: SFTConfig = cfg["sft"]
    eval_cfg: EvalConfig = cfg["evaluate"]
    tracking: TrackingConfig = cfg["tracking"]
    flow_cfg: FlowConfig = cfg["flow"]
    tracking_d = config_to_dict(tracking)
    cache = flow_cfg.use_cache
    fields = {f: getattr(sft_cfg, f) for f in DataFields.__dataclass_fields__}

    tags = {"prefect.flow_run_id": str(flow_run.get_id() or ""), "prefect.flow_run_name": str(flow_run.get_name() or "")}
    with start_run(tracking, "align", tags=tags) as parent:
        parent.log_params({name: config_to_dict(c) for name, c in cfg.items()})

        # ---- data: user files where given, the embedded task for the rest ---------------
        given = {"sft": sft_file, "preferences": preference_file, "prompts": prompts_file, "eval": eval_file}
        generated: dict[str, str] = {}
        if any(path is None for path in given.values()):
            generated = _run(generate_data, cache, params=config_to_dict(gen), tracking=tracking_d,
                             parent_run_id=parent.run_id)["outputs"]
        files = {name: path or generated[name] for name, path in given.items()}

        # ---- gate: every dataset validated before anything trains -----------------------
        md5 = {name: dvc_md5(path) for name, path in files.items()}
        for name, path in files.items():
            report = validate_data(path=str(path), md5=md5[name], kind=DATASET_KINDS[name], name=name,
                                   fields=fields, tracking=tracking_d, parent_run_id=parent.run_id)
            logger.info("validated %s: %s rows", path, int(report["metrics"]["data/n_rows"]))
        parent.set_tags(lineage_tags(files, "align"))

        # ---- base model ------------------------------------------------------------------
        if base_model is None:
            base = _run(build_base_model, cache,
                        params={**config_to_dict(model_cfg), "corpus_file": files["sft"]}, corpus_md5=md5["sft"],
                        tracking=tracking_d, parent_run_id=parent.run_id)
            base_model = base["outputs"]["model"]
        base_md5 = dvc_md5(base_model)

        # ---- evaluate the starting point, SFT, evaluate the result -----------------------
        # The flow's metrics go to metrics/flow/: metrics/*.json belong to `dvc repro`.
        eval_params = {**config_to_dict(eval_cfg), **fields, "eval_file": files["eval"]}
        before = _run(evaluate_model, cache,
                      params={**eval_params, "model_path": base_model, "output_file": "metrics/flow/eval_base.json"},
                      tracking=tracking_d, input_md5={"model": base_md5, "eval": md5["eval"]}, label="base",
                      parent_run_id=parent.run_id)
        sft_params = {**config_to_dict(sft_cfg), "model_path": base_model, "train_file": files["sft"],
                      "eval_file": files["eval"]}
        sft = _run(train_sft, cache, params=sft_params, tracking=tracking_d,
                   input_md5={"model": base_md5, "train": md5["sft"], "eval": md5["eval"]},
                   parent_run_id=parent.run_id)
        after = _run(evaluate_model, cache,
                     params={**eval_params, "model_path": sft["outputs"]["model"],
                             "output_file": "metrics/flow/eval_sft.json"},
                     tracking=tracking_d, input_md5={"model": sft["md5"]["model"], "eval": md5["eval"]},
                     label="sft", parent_run_id=parent.run_id)

        summary_metrics = {
            "eval/accuracy_base": before["metrics"]["eval/accuracy"],
            "eval/accuracy_sft": after["metrics"]["eval/accuracy"],
            "eval/accuracy_stderr_sft": after["metrics"]["eval/accuracy_stderr"],
        }
        parent.log_metrics(summary_metrics, 0)
        parent.set_tags({"dvc.md5.model_base": base_md5, "dvc.md5.model_sft": sft["md5"]["model"],
                         "alignflow.sft_run_id": str(sft.get("run_id"))})
        summary = {
            "parent_run_id": parent.run_id,
            "tracking_uri": resolve_tracking_uri(tracking),
            "registered_model": tracking.registered_model if tracking.log_model else None,
            "model_uri": sft.get("model_uri"),
            "datasets": {k: str(v) for k, v in files.items()},
            "md5": {**md5, "model_base": base_md5, "model_sft": sft["md5"]["model"]},
            "sft_model": sft["outputs"]["model"],
            "metrics": summary_metrics,
            "sft_train_seconds": sft["metrics"].get("perf/train_seconds"),
        }
        print(f"align: base accuracy {summary_metrics['eval/accuracy_base']:.3f} -> "
              f"SFT accuracy {summary_metrics['eval/accuracy_sft']:.3f} "
              f"(± {summary_metrics['eval/accuracy_stderr_sft']:.3f})")
        return summary


if __name__ == "__main__":
    align()
