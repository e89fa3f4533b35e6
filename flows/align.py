"""The main alignment flow: generate -> validate -> build model -> SFT -> alignment -> register.

After SFT the flow runs the alignment stages named in ``flow.stages`` (params.yaml; the stage
registry's chain, rlhf_core/config/stage_registry.py), in order, each starting from the SFT model: a reward
model, DPO, unpaired preference optimisation, rejection sampling
scored by the reward model (its kept samples and pairs pass the same Great Expectations
gate as any dataset), one RAFT round of SFT on the kept samples, and distillation of the
DPO model back into the SFT model, and online RL (GRPO with the rule reward by default;
PPO with the reward model by config). Every model is evaluated by greedy exact match on the
held-out set, so the summary compares base, SFT and each aligned model. The last policy
stage's model (GRPO's by default) is registered as ``candidate`` of the policy registry and
promoted to ``champion`` only if it beats the current champion.

One Prefect flow run = one parent MLflow run; every stage is a Prefect task and a nested
MLflow run. User data and models replace the embedded default stage by stage: give
``sft_file`` and the generator is not needed for it, give ``base_model`` and no tiny model
is built. Every dataset is validated before any training starts, so bad input stops the
flow with the Great Expectations report and nothing downstream runs; every dataset trained on
also gets the data report (near-duplicates, eval contamination: ``data_report`` in params.yaml).

Run: ``alignflow flow align`` (or ``python -m flows.align``).
"""

from __future__ import annotations

import inspect
from contextlib import contextmanager
from dataclasses import dataclass
from dataclasses import field as dataclass_field
from pathlib import Path
from typing import Any, Callable, Iterator

from filelock import FileLock, Timeout
from prefect import flow, get_run_logger
from prefect.runtime import flow_run

from flows.gpu_limit import gpu_limit_tags, gpu_stages
from flows.params import load_all
from rlhf_core.common.offline import child_env
from rlhf_core.config import ConfigError, DataFields, FlowConfig, TrackingConfig, config_to_dict
from rlhf_core.data.validate import prompts_kind, require_eval_labels
from rlhf_core.promotion.guards import fired_guards
from rlhf_core.tracking.lineage import dvc_md5, project_relative, use_hash_cache
from rlhf_core.common.redact import redact_secrets
from rlhf_core.rewards.sources import RewardKind, resolve_reward_file
from rlhf_core.config import stage_registry as registry
from rlhf_core.config.stage_registry import Stage
from rlhf_core.tracking.lineage import lineage_tags
from rlhf_core.common.project import flow_lock_path, project_root
from rlhf_core.tracking.mlflow_runs import Tracker, resolve_tracking_uri, start_run
from tasks.data import generate_data, sample_best_of_n, validate_data
from tasks.evaluation import evaluate_model
from tasks.base_model import build_base_model
from tasks.registry import register_model
from tasks.training import train_sft, training_task

DATASET_KINDS = {"sft": "sft", "preferences": "preference", "prompts": "prompts", "eval": "prompts"}
"""The flow's datasets and the kind the gate checks each as, unless the chosen stages read it otherwise."""


def dataset_kinds(cfg: dict[str, Any]) -> dict[str, str]:
    """The gate's kind per dataset: a dataset that the stages of ``flow.stages`` all read as one kind is checked
    as that kind (the preference file as ``unpaired`` when only a stage of unpaired examples reads it), as
    :data:`DATASET_KINDS` says otherwise; the prompts file as ``prompt-only`` (labels optional) when it feeds RL
    or rejection sampling and neither reads labels (a reward model), as ``prompts`` otherwise."""
    chosen = [registry.get(s) for s in cfg["flow"].stages]
    kinds = dict(DATASET_KINDS)
    for name in kinds:
        read_as = {r.kind for stage in chosen for r in stage.reads if r.dataset == name}
        if len(read_as) == 1:
            kinds[name] = read_as.pop()
    readers = {"rl": RewardKind(cfg["rl"].reward.kind).reads_labels,
               "rejection": cfg["rejection"].scorer == "rule"}
    used = [needs for stage, needs in readers.items() if stage in cfg["flow"].stages]
    if used:  # no stage reading the prompts: keep the label-required kind
        kinds["prompts"] = prompts_kind(any(used))
    return kinds


def unpaired_field(cfg: dict[str, Any]) -> str | None:
    """The boolean field of the ``unpaired`` kind, from the config of the stage that reads that kind."""
    return next((getattr(cfg[s.section], "desirable_field") for s in registry.STAGES.values()
                 if any(r.kind == "unpaired" for r in s.reads)), None)


@contextmanager
def one_flow_at_a_time(name: str) -> Iterator[None]:
    """Hold the project's flow lock (``.alignflow/flow.lock``) for the whole flow run.

    Flows of one project write the same paths (data/, models/, metrics/, the DVC cache and
    git), so a second flow started while one runs waits here — and says so — then runs, its
    unchanged stages coming from the cache. Flows that must run side by side use separate
    project folders (clones). The lock is released by the OS if the process dies.
    """
    path = flow_lock_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    lock = FileLock(str(path))
    try:
        lock.acquire(timeout=0)
    except Timeout:
        get_run_logger().warning("%s: another flow is running in %s; waiting for it to finish (%s)",
                                 name, project_root(), path)
        lock.acquire()
    try:
        yield
    finally:
        lock.release()


def _intact(result: dict[str, Any]) -> bool:
    """True when every output a (possibly cached) task result names still has its md5."""
    return all(Path(result["outputs"][k]).exists() and dvc_md5(result["outputs"][k]) == md5
               for k, md5 in result["md5"].items() if k in result["outputs"])


def _run(task_fn: Any, flow_cfg: FlowConfig, **kwargs: Any) -> dict[str, Any]:
    """Run a task with the flow's cache, retry and isolation settings; a cache hit whose outputs
    were deleted or changed is recomputed. With ``flow.ray_address`` a training task is submitted
    to that Ray cluster (prefect-ray) and runs in a Ray worker there."""
    on_ray = bool(flow_cfg.ray_address) and "isolation" in inspect.signature(task_fn.fn).parameters
    if "isolation" in inspect.signature(task_fn.fn).parameters:
        # a Ray worker is already a process of its own: the stage runs in it
        kwargs["isolation"] = "inline" if on_ray else flow_cfg.isolation
    task_fn = task_fn.with_options(retries=flow_cfg.retries, retry_delay_seconds=flow_cfg.retry_delay_s)

    def call(fn: Any) -> dict[str, Any]:
        return _submit_to_ray(fn, kwargs, flow_cfg.ray_address) if on_ray else fn(**kwargs)

    if not flow_cfg.use_cache:
        return call(task_fn.with_options(refresh_cache=True))
    result = call(task_fn)
    if not _intact(result):
        result = call(task_fn.with_options(refresh_cache=True))
    return result


def _submit_to_ray(task_fn: Any, parameters: dict[str, Any], address: str) -> dict[str, Any]:
    """Run one task on the Ray cluster at ``address`` through prefect-ray's task runner; wait for it."""
    from prefect_ray import RayTaskRunner  # lazy: prefect_ray (Ray-submitted tasks only)

    runner = RayTaskRunner(address=address, init_kwargs={"runtime_env": {"env_vars": child_env()}})
    with runner:
        return runner.submit(task_fn, parameters=parameters).result()


@dataclass
class ChainContext:
    """What every post-SFT stage of the align flow starts from: the flow's config, datasets and their md5s, the
    SFT model, and the results of the stages run before it."""

    cfg: dict[str, Any]
    files: dict[str, str]
    md5: dict[str, str]
    sft_model: str
    sft_md5: str
    fields: dict[str, Any]
    common: dict[str, Any]
    cache: FlowConfig
    done: dict[str, dict[str, Any]] = dataclass_field(default_factory=dict)

    @property
    def data(self) -> dict[str, Any]:
        """The dataset field names and the eval file: what an evaluating stage reads besides its own data."""
        return {**self.fields, "eval_file": self.files["eval"]}

    def guarded(self) -> dict[str, Any]:
        """The stage's guards: the flow's own reward model (once trained) scores the held-out answers."""
        guards = config_to_dict(self.cfg["guards"])
        if "reward" in self.done:
            guards["reward_model_path"] = self.done["reward"]["outputs"]["model"]
        return {**self.common, "guards": guards}

    def reward_model(self, fallback: str) -> str:
        """The flow's reward model when it trained one, else ``fallback`` (the stage's own setting)."""
        return self.done["reward"]["outputs"]["model"] if "reward" in self.done else fallback


def _from_sft(ctx: ChainContext, stage: Stage) -> dict[str, Any]:
    """A stage of the usual shape: the SFT model trained on the flow datasets it reads, evaluated on the eval set."""
    params = {**config_to_dict(ctx.cfg[stage.section]), **ctx.data, "model_path": ctx.sft_model,
              **{r.field: ctx.files[r.dataset] for r in stage.reads}}
    input_md5 = {"model": ctx.sft_md5, **{"train" if r.field == "train_file" else r.dataset: ctx.md5[r.dataset]
                                          for r in stage.reads}, "eval": ctx.md5["eval"]}
    return _run(training_task(stage.name), ctx.cache, **(ctx.guarded() if stage.guarded else ctx.common),
                params=params, input_md5=input_md5)


def _reward(ctx: ChainContext, stage: Stage) -> dict[str, Any]:
    """The reward model: no eval set (its held-out pairs are its own setting)."""
    return _run(training_task(stage.name), ctx.cache, **ctx.common,
                params={**config_to_dict(ctx.cfg["reward"]), **ctx.fields, "model_path": ctx.sft_model,
                        "train_file": ctx.files["preferences"]},
                input_md5={"model": ctx.sft_md5, "train": ctx.md5["preferences"]})


def _rejection(ctx: ChainContext, stage: Stage) -> dict[str, Any]:
    """Best-of-n samples of the SFT model, scored by the flow's reward model or the rule; then the gate on them."""
    rej = ctx.cfg["rejection"]
    params = {**config_to_dict(rej), **ctx.fields, "policy_path": ctx.sft_model, "prompts_file": ctx.files["prompts"]}
    input_md5 = {"policy": ctx.sft_md5, "prompts": ctx.md5["prompts"]}
    if rej.scorer == "reward_model":
        rm_path = ctx.reward_model(rej.reward_model_path)
        if not Path(rm_path).exists():
            raise ConfigError(f"rejection.scorer=reward_model but no reward model at {rm_path}: "
                              "add 'reward' to flow.stages before 'rejection', or set scorer: rule")
        params["reward_model_path"] = rm_path
        input_md5["reward_model"] = dvc_md5(rm_path)
    result = _run(sample_best_of_n, ctx.cache, **ctx.common, params=params, input_md5=input_md5)
    # The gate: generated data passes the same checks as any dataset before training on it.
    for name, kind in stage.gates:
        if name == "pairs" and not Path(result["outputs"][name]).read_text().strip():
            get_run_logger().warning("rejection: every prompt's candidates tied; no preference pairs")
            continue  # nothing in this flow trains on the pairs; an empty file is a result
        validate_data(path=result["outputs"][name], md5=result["md5"][name], kind=kind,
                      name=f"rejection-{name}", fields=ctx.fields, data_report=config_to_dict(ctx.cfg["data_report"]),
                      eval_file=ctx.files["eval"], **ctx.common)
    return result


def _raft(ctx: ChainContext, stage: Stage) -> dict[str, Any]:
    """SFT of the SFT model on the rejection stage's kept samples."""
    kept = ctx.done["rejection"]
    return _run(training_task(stage.name), ctx.cache, **ctx.guarded(),
                params={**config_to_dict(ctx.cfg["raft"]), **ctx.data, "model_path": ctx.sft_model,
                        "train_file": kept["outputs"]["kept"]},
                input_md5={"model": ctx.sft_md5, "train": kept["md5"]["kept"], "eval": ctx.md5["eval"]})


def _distill(ctx: ChainContext, stage: Stage) -> dict[str, Any]:
    """The flow's DPO model (else ``distill.teacher_path``) distilled into the SFT model."""
    teacher = ctx.done["dpo"]["outputs"]["model"] if "dpo" in ctx.done else ctx.cfg["distill"].teacher_path
    return _run(training_task(stage.name), ctx.cache, **ctx.guarded(),
                params={**config_to_dict(ctx.cfg["distill"]), **ctx.data, "model_path": ctx.sft_model,
                        "teacher_path": teacher, "train_file": ctx.files["sft"]},
                input_md5={"model": ctx.sft_md5, "teacher": dvc_md5(teacher), "train": ctx.md5["sft"],
                           "eval": ctx.md5["eval"]})


def _rl(ctx: ChainContext, stage: Stage) -> dict[str, Any]:
    """Online RL from the SFT model; the flow's reward model with ``reward.kind: model``."""
    rl = ctx.cfg["rl"]
    params = {**config_to_dict(rl), **ctx.data, "model_path": ctx.sft_model, "prompts_file": ctx.files["prompts"]}
    input_md5 = {"model": ctx.sft_md5, "prompts": ctx.md5["prompts"], "eval": ctx.md5["eval"]}
    if rl.reward.kind == "model":
        rm_path = ctx.reward_model(rl.reward.model_path)
        params["reward"] = {**params["reward"], "model_path": rm_path}
        input_md5["reward_model"] = dvc_md5(rm_path)
    elif rl.reward.kind == "function":
        input_md5["reward_function"] = dvc_md5(resolve_reward_file(rl.reward.function.rsplit(":", 1)[0]))
    return _run(training_task(stage.name), ctx.cache, **ctx.guarded(), params=params, input_md5=input_md5)


CHAIN_STEPS: dict[str, Callable[[ChainContext, Stage], dict[str, Any]]] = {
    "reward": _reward, "rejection": _rejection, "raft": _raft, "distill": _distill, "rl": _rl}
"""Stages whose inputs come from other stages' outputs or their own settings; every other stage of the chain
runs as :func:`_from_sft`."""


def alignment_chain(stages: list[str]) -> list[tuple[Stage, Callable[[ChainContext, Stage], dict[str, Any]]]]:
    """What the flow runs after SFT for ``flow.stages``: each stage of the registry with the step that runs it."""
    return [(registry.get(name), CHAIN_STEPS.get(name, _from_sft)) for name in stages]


def run_alignment_stages(cfg: dict[str, Any], files: dict[str, str], md5: dict[str, str], sft: dict[str, Any],
                         fields: dict[str, Any], tracking_d: dict[str, Any], parent_run_id: str,
                         cache: FlowConfig) -> dict[str, dict[str, Any]]:
    """The post-SFT stages of ``flow.stages``, each from the SFT model; returns their task results."""
    ctx = ChainContext(cfg, files, md5, sft["outputs"]["model"], sft["md5"]["model"], fields,
                       dict(tracking=tracking_d, parent_run_id=parent_run_id), cache)
    for stage, step in alignment_chain(cfg["flow"].stages):
        ctx.done[stage.name] = step(ctx, stage)
    return ctx.done


def data_fields(cfg: dict[str, Any]) -> dict[str, Any]:
    """The dataset field names (``prompt_field``, ...) every task reads, from the ``sft`` section."""
    return {f: getattr(cfg["sft"], f) for f in DataFields.__dataclass_fields__}


def log_align_inputs(parent: Tracker, cfg: dict[str, Any], given: dict[str, str | None],
                     base_model: str | None) -> None:
    """Log every section's params, and ``reproduce.json``: the exact, typed params and inputs of
    this run, what ``alignflow reproduce`` reruns with."""
    parent.log_params({name: config_to_dict(c) for name, c in cfg.items()})
    parent.log_dict({"flow": "align", "params": {name: config_to_dict(c) for name, c in cfg.items()},
                     "inputs": {"sft_file": given["sft"], "preference_file": given["preferences"],
                                "prompts_file": given["prompts"], "eval_file": given["eval"],
                                "base_model": base_model}},
                    "reproduce.json")


def resolve_datasets(cfg: dict[str, Any], given: dict[str, str | None], parent_run_id: str) -> dict[str, str]:
    """The four datasets: the user's files where given, the embedded task's (generated) for the rest."""
    generated: dict[str, str] = {}
    if any(path is None for path in given.values()):
        generated = _run(generate_data, cfg["flow"], params=config_to_dict(cfg["generate"]),
                         tracking=config_to_dict(cfg["tracking"]), parent_run_id=parent_run_id)["outputs"]
    return {name: path or generated[name] for name, path in given.items()}


def validate_datasets(cfg: dict[str, Any], files: dict[str, str], parent_run_id: str) -> dict[str, str]:
    """The gate: every dataset validated before anything trains; returns their DVC md5s."""
    md5 = {name: dvc_md5(path) for name, path in files.items()}
    kinds = dataset_kinds(cfg)
    for name, path in files.items():
        # Every dataset trained on also gets the data report, contamination checked against the eval set.
        trained_on = name != "eval"
        report = validate_data(path=str(path), md5=md5[name], kind=kinds[name], name=name,
                               fields=data_fields(cfg), tracking=config_to_dict(cfg["tracking"]),
                               parent_run_id=parent_run_id, desirable_field=unpaired_field(cfg),
                               data_report=config_to_dict(cfg["data_report"]) if trained_on else None,
                               eval_file=str(files["eval"]) if trained_on else None)
        get_run_logger().info("validated %s: %s rows", path, int(report["metrics"]["data/n_rows"]))
    return md5


def build_base(cfg: dict[str, Any], files: dict[str, str], md5: dict[str, str], parent_run_id: str) -> str:
    """Build the tiny base model on the SFT corpus (when the user gave none); returns its path."""
    m = cfg["model"]
    get_run_logger().info("no --base-model given: building alignflow's embedded tiny %s model (model section: %d "
                          "layers, hidden size %d) in %s, its tokenizer trained on %s; --base-model PATH trains a "
                          "Hugging Face model of yours instead", m.arch, m.num_layers, m.hidden_size, m.out_dir,
                          files["sft"])
    base = _run(build_base_model, cfg["flow"],
                params={**config_to_dict(cfg["model"]), "corpus_file": files["sft"]}, corpus_md5=md5["sft"],
                tracking=config_to_dict(cfg["tracking"]), parent_run_id=parent_run_id)
    return base["outputs"]["model"]


def run_sft_between_evaluations(
    cfg: dict[str, Any], files: dict[str, str], md5: dict[str, str], base_model: str, base_md5: str,
    parent_run_id: str,
) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    """Evaluate the base model, train SFT from it, evaluate the SFT model; returns the three task results.

    The flow's metrics go to metrics/flow/: metrics/*.json belong to `dvc repro`.
    """
    cache, tracking_d = cfg["flow"], config_to_dict(cfg["tracking"])
    eval_params = {**config_to_dict(cfg["evaluate"]), **data_fields(cfg), "eval_file": files["eval"]}
    before = _run(evaluate_model, cache,
                  params={**eval_params, "model_path": base_model, "output_file": "metrics/flow/eval_base.json"},
                  tracking=tracking_d, input_md5={"model": base_md5, "eval": md5["eval"]}, label="base",
                  parent_run_id=parent_run_id)
    sft_params = {**config_to_dict(cfg["sft"]), "model_path": base_model, "train_file": files["sft"],
                  "eval_file": files["eval"]}
    sft = _run(train_sft, cache, params=sft_params, tracking=tracking_d,
               input_md5={"model": base_md5, "train": md5["sft"], "eval": md5["eval"]},
               parent_run_id=parent_run_id)
    after = _run(evaluate_model, cache,
                 params={**eval_params, "model_path": sft["outputs"]["model"],
                         "output_file": "metrics/flow/eval_sft.json"},
                 tracking=tracking_d, input_md5={"model": sft["md5"]["model"], "eval": md5["eval"]},
                 label="sft", parent_run_id=parent_run_id)
    return before, sft, after


def register_final_policy(cfg: dict[str, Any], aligned: dict[str, dict[str, Any]],
                          parent: Tracker) -> dict[str, Any] | None:
    """Register the pipeline's end product, the last policy stage's model, if models are logged.

    It becomes `candidate` of the policy registry, and `champion` only if it passes the promotion
    gate (its guards against the SFT model, ``guards`` section) and its held-out accuracy beats the
    current champion's (tasks/registry.py). Returns the stage and the
    registry's answer, or None when nothing was registered.
    """
    policy_stages = [st for st in aligned if "model" in aligned[st]["outputs"] and st != "reward"
                     and "eval/accuracy" in aligned[st]["metrics"]]
    if not (policy_stages and cfg["tracking"].log_model):
        return None
    final = aligned[policy_stages[-1]]
    promotion = {"stage": policy_stages[-1], "registered_model": cfg["cycles"].registered_model, **register_model(
        model_dir=final["outputs"]["model"], run_id=final["run_id"],
        accuracy=final["metrics"]["eval/accuracy"], registered_name=cfg["cycles"].registered_model,
        tracking=config_to_dict(cfg["tracking"]), guards=config_to_dict(cfg["guards"]))}
    parent.set_tags({"registry.version": promotion["version"], "registry.verdict": promotion["verdict"]})
    return promotion


def headline_metrics(before: dict[str, Any], after: dict[str, Any],
                     aligned: dict[str, dict[str, Any]]) -> dict[str, float]:
    """The parent run's metrics: base and SFT accuracy, and each aligned stage's headline numbers."""
    metrics = {
        "eval/accuracy_base": before["metrics"]["eval/accuracy"],
        "eval/accuracy_sft": after["metrics"]["eval/accuracy"],
        "eval/accuracy_stderr_sft": after["metrics"]["eval/accuracy_stderr"],
    }
    for stage, result in aligned.items():
        for key in ("eval/accuracy", "eval/accuracy_stderr", "eval/reward_accuracy", "eval/reward_margin",
                    "rejection/kept_accuracy"):
            if key in result["metrics"]:
                metrics[f"{key}_{stage}"] = result["metrics"][key]
    return metrics


def model_lineage_tags(base_md5: str, sft: dict[str, Any], aligned: dict[str, dict[str, Any]]) -> dict[str, str]:
    """The parent run's tags naming every model's md5 and every stage's MLflow run, and each policy stage's
    fired guards (``guard.fired.<stage>``)."""
    return {**{f"guard.fired.{stage}": ",".join(fired_guards(r["metrics"])) or "none"
               for stage, r in aligned.items() if any(k.startswith("guard/") for k in r["metrics"])},
            "dvc.md5.model_base": base_md5, "dvc.md5.model_sft": sft["md5"]["model"],
            "alignflow.sft_run_id": str(sft.get("run_id")),
            **{f"dvc.md5.{stage}_{k}": v for stage, r in aligned.items() for k, v in r["md5"].items()},
            **{f"alignflow.{stage}_run_id": str(r.get("run_id")) for stage, r in aligned.items()}}


def align_summary(cfg: dict[str, Any], parent_run_id: str, files: dict[str, str], md5: dict[str, str],
                  base_md5: str, sft: dict[str, Any], aligned: dict[str, dict[str, Any]],
                  promotion: dict[str, Any] | None, metrics: dict[str, float]) -> dict[str, Any]:
    """What ``align`` returns: paths, md5s, run ids and the headline metrics."""
    tracking: TrackingConfig = cfg["tracking"]
    return {
        "parent_run_id": parent_run_id,
        # printed by the CLI and written to metrics/*_summary.json: never a server's user:pass@ or ?token=
        "tracking_uri": redact_secrets(resolve_tracking_uri(tracking)),
        "registered_model": tracking.registered_model if tracking.log_model else None,
        "model_uri": sft.get("model_uri"),
        "datasets": {k: str(v) for k, v in files.items()},
        "md5": {**md5, "model_base": base_md5, "model_sft": sft["md5"]["model"],
                **{f"{stage}_{k}": v for stage, r in aligned.items() for k, v in r["md5"].items()}},
        "sft_model": sft["outputs"]["model"],
        "stages": {stage: {"outputs": r["outputs"], "run_id": r.get("run_id")} for stage, r in aligned.items()},
        "rejection_n": cfg["rejection"].n_samples,
        "promotion": promotion,
        "metrics": metrics,
        "sft_train_seconds": sft["metrics"].get("perf/train_seconds"),
    }


def headline(metrics: dict[str, float], aligned: dict[str, dict[str, Any]]) -> str:
    """One line: base -> SFT accuracy, then each aligned stage's."""
    return (f"align: base accuracy {metrics['eval/accuracy_base']:.3f} -> "
            f"SFT accuracy {metrics['eval/accuracy_sft']:.3f} "
            f"(± {metrics['eval/accuracy_stderr_sft']:.3f})"
            + "".join(f"; {stage} {metrics[f'eval/accuracy_{stage}']:.3f}"
                      for stage in aligned if f"eval/accuracy_{stage}" in metrics))


@flow(name="align", log_prints=True)
def align(
    params_file: str | None = "params.yaml",
    overrides: dict[str, dict[str, Any]] | None = None,
    sft_file: str | None = None,
    preference_file: str | None = None,
    prompts_file: str | None = None,
    eval_file: str | None = None,
    base_model: str | None = None,
    private_overrides: str | None = None,
) -> dict[str, Any]:
    """Run the alignment pipeline; returns paths, md5s, run ids and the headline metrics.
    ``private_overrides``: a file of overrides that carry secrets (:func:`write_private_overrides`)."""
    cfg = load_all(params_file, overrides, private_overrides)
    use_hash_cache(cfg["tracking"].hash_cache)
    # Recorded as project-relative where inside the project (reproduce.json, alignflow.json, input.* tags), so
    # a rerun of the commit in another folder records the same paths (rlhf_core.tracking.lineage.project_relative).
    given = {name: project_relative(path) if path else None for name, path in
             {"sft": sft_file, "preferences": preference_file, "prompts": prompts_file, "eval": eval_file}.items()}
    base_model = project_relative(base_model) if base_model else None
    tags = {"prefect.flow_run_id": str(flow_run.get_id() or ""), "prefect.flow_run_name": str(flow_run.get_name() or "")}
    with one_flow_at_a_time("align"), start_run(cfg["tracking"], "align", tags=tags) as parent:
        log_align_inputs(parent, cfg, given, base_model)
        files = resolve_datasets(cfg, given, parent.run_id)
        require_eval_labels(files["eval"], cfg["sft"].label_field, "align")  # before anything trains
        md5 = validate_datasets(cfg, files, parent.run_id)
        parent.set_tags(lineage_tags(files, "align"))
        with gpu_stages(cfg["flow"]) as waited:  # the GPU limit, shared by every project on the Prefect server
            parent.set_tags(gpu_limit_tags(cfg["flow"], waited))
            if base_model is None:
                base_model = build_base(cfg, files, md5, parent.run_id)
            base_md5 = dvc_md5(base_model)
            before, sft, after = run_sft_between_evaluations(cfg, files, md5, base_model, base_md5, parent.run_id)
            # offline alignment and online RL, each from the SFT model
            aligned = run_alignment_stages(cfg, {k: str(v) for k, v in files.items()}, md5, sft, data_fields(cfg),
                                           config_to_dict(cfg["tracking"]), parent.run_id, cfg["flow"])
        promotion = register_final_policy(cfg, aligned, parent)
        metrics = headline_metrics(before, after, aligned)
        parent.log_metrics(metrics, 0)
        parent.set_tags(model_lineage_tags(base_md5, sft, aligned))
        summary = align_summary(cfg, parent.run_id, files, md5, base_md5, sft, aligned, promotion, metrics)
        print(headline(metrics, aligned))
        return summary


if __name__ == "__main__":
    align()
