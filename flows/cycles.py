"""Iterative alignment flows: ``iterative_dpo`` and ``raft``, N cycles each, every cycle versioned.

One cycle: sample n completions per prompt from the current policy -> score them (reward
model or rule) -> keep the best (RAFT) and best-vs-worst pairs (DPO) -> validate them with
Great Expectations -> version them (``dvc add``, a git commit naming the flow run and cycle,
``dvc push``) -> train the next policy (DPO with the current policy as reference, or SFT on
the kept samples) -> evaluate -> register it as ``candidate``, and as ``champion`` if it
beats the current one. ``iterative_dpo`` can also retrain the reward model on all pairs so
far each cycle (versioned the same way).

MLflow: one parent run per flow run, one nested run per cycle (tags ``alignflow.cycle`` and
``alignflow.parent_cycle_run_id``), and the stage runs nested under their cycle.

Run: ``alignflow flow iterative_dpo`` / ``alignflow flow raft`` (section ``cycles`` of
params.yaml, with the ``rejection``, ``dpo``, ``raft`` and ``reward`` sections for each step).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from prefect import flow, get_run_logger
from prefect.runtime import flow_run

from rlhf_core.config import ConfigError, CyclesConfig, config_to_dict
from rlhf_core.data.validate import prompts_kind, require_eval_labels
from rlhf_core.promotion.guards import fired_guards
from rlhf_core.tracking.lineage import dvc_md5, use_hash_cache
from rlhf_core.common.redact import redact_secrets
from rlhf_core.tracking.lineage import lineage_tags
from rlhf_core.embedded.tasks import write_jsonl
from rlhf_core.tracking.mlflow_runs import Tracker, resolve_tracking_uri, start_run
from flows.align import _run, data_fields, load_all, one_flow_at_a_time
from flows.gpu_limit import gpu_limit_tags, gpu_stages
from tasks.data import sample_best_of_n, validate_data
from tasks.registry import register_model
from tasks.training import train_dpo, train_raft, train_reward
from tasks.versioning import version_outputs

FLOWS = ("iterative_dpo", "raft")


class PairPool:
    """Every distinct preference pair seen so far (the reward model's training set when it is retrained).

    Rows are copied in as each cycle produces them: a cycle's pairs file is overwritten by the
    next cycle, so keeping paths would lose earlier cycles and repeat the latest.
    """

    def __init__(self, fields: dict[str, Any]):
        self.keys = (fields["prompt_field"], fields["chosen_field"], fields["rejected_field"])
        self.rows: dict[tuple[str, ...], dict[str, Any]] = {}

    def add(self, path: str) -> None:
        for line in Path(path).read_text(encoding="utf-8").splitlines():
            if line.strip():
                row = json.loads(line)
                self.rows.setdefault(tuple(str(row.get(k)) for k in self.keys), row)

    def write(self, out: Path) -> str:
        return str(write_jsonl(list(self.rows.values()), out))


@dataclass(frozen=True)
class CyclePlan:
    """What every cycle of one ``iterative_dpo`` / ``raft`` flow run shares."""

    kind: str
    cfg: dict[str, Any]
    n_cycles: int
    run_label: str
    tags: dict[str, str]

    @property
    def cyc(self) -> CyclesConfig:
        return self.cfg["cycles"]

    @property
    def tracking_d(self) -> dict[str, Any]:
        return config_to_dict(self.cfg["tracking"])

    @property
    def fields(self) -> dict[str, Any]:
        return data_fields(self.cfg)

    @property
    def prompts_file(self) -> str:
        return self.cfg["rejection"].prompts_file

    @property
    def eval_file(self) -> str:
        return self.cfg["dpo"].eval_file

    @property
    def data_dir(self) -> Path:
        return Path(self.cyc.data_dir) / self.kind

    @property
    def models_dir(self) -> Path:
        return Path(self.cyc.models_dir) / self.kind

    @property
    def consumed(self) -> str:
        """The sampled file the next policy trains on: best-vs-worst pairs (DPO) or kept samples (RAFT)."""
        return "pairs" if self.kind == "iterative_dpo" else "kept"


def plan_cycles(kind: str, cfg: dict[str, Any], cycles: int | None) -> CyclePlan:
    """Check the configs and fix what the cycles share; ``cycles`` overrides ``cycles.cycles``."""
    cyc: CyclesConfig = cfg["cycles"]
    if cyc.scorer == "reward_model" and not Path(cyc.reward_model_path).exists():
        raise ConfigError(f"cycles.reward_model_path: no reward model at {cyc.reward_model_path} "
                          "(train one with `alignflow reward`, or set cycles.scorer: rule)")
    run_label = str(flow_run.get_name() or "local")
    tags = {"prefect.flow_run_id": str(flow_run.get_id() or ""), "prefect.flow_run_name": run_label,
            "alignflow.flow": kind}
    return CyclePlan(kind, cfg, cycles or cyc.cycles, run_label, tags)


def log_and_validate_inputs(plan: CyclePlan, parent: Tracker) -> dict[str, str]:
    """Log the params and ``reproduce.json``, validate the prompts and eval sets; returns their md5s."""
    cfg, kind = plan.cfg, plan.kind
    parent.log_dict({"flow": kind, "params": {name: config_to_dict(c) for name, c in cfg.items()},
                     "inputs": {"cycles": plan.n_cycles}}, "reproduce.json")
    parent.log_params({"cycles": config_to_dict(plan.cyc), "rejection": config_to_dict(cfg["rejection"]),
                       "train": config_to_dict(cfg["dpo"] if kind == "iterative_dpo" else cfg["raft"])})
    prompts_file, eval_file = plan.prompts_file, plan.eval_file
    require_eval_labels(eval_file, plan.fields["label_field"], kind)  # each cycle's accuracy needs labels
    md5 = {"prompts": dvc_md5(prompts_file), "eval": dvc_md5(eval_file)}
    # The sampled prompts need labels only for the rule scorer; the eval set always (exact match).
    kinds = {"prompts": prompts_kind(plan.cyc.scorer == "rule"), "eval": "prompts"}
    for name, path in (("prompts", prompts_file), ("eval", eval_file)):
        validate_data(path=path, md5=md5[name], kind=kinds[name], name=name, fields=plan.fields,
                      tracking=plan.tracking_d, parent_run_id=parent.run_id)
    parent.set_tags(lineage_tags({"prompts": prompts_file, "eval": eval_file, "start_model": plan.cyc.start_model},
                                 kind))
    return md5


def sample_and_score(plan: CyclePlan, k: int, policy: str, policy_md5: str, rm_path: str, md5: dict[str, str],
                     common: dict[str, Any]) -> dict[str, Any]:
    """n completions per prompt from the current policy, scored; the kept samples and pairs."""
    cyc = plan.cyc
    params = {**config_to_dict(plan.cfg["rejection"]), **plan.fields, "policy_path": policy,
              "prompts_file": plan.prompts_file, "scorer": cyc.scorer, "reward_model_path": rm_path,
              "n_samples": cyc.n_samples, "temperature": cyc.temperature, "max_prompts": cyc.max_prompts,
              "seed": cyc.seed + k, "output_file": str(plan.data_dir / "kept.jsonl"),
              "pairs_file": str(plan.data_dir / "pairs.jsonl")}
    input_md5 = {"policy": policy_md5, "prompts": md5["prompts"]}
    if cyc.scorer == "reward_model":
        input_md5["reward_model"] = dvc_md5(rm_path)
    return _run(sample_best_of_n, plan.cfg["flow"], params=params, input_md5=input_md5, **common)


def retrain_reward_model(plan: CyclePlan, sampled: dict[str, Any], pair_pool: PairPool,
                         common: dict[str, Any]) -> tuple[str, list[str]]:
    """Retrain the reward model on every pair so far; returns its path and the files to version."""
    reward = plan.cfg["reward"]
    pair_pool.add(sampled["outputs"]["pairs"])
    accumulated = pair_pool.write(plan.data_dir / "reward_pairs.jsonl")
    rm = _run(train_reward, plan.cfg["flow"], **common,
              params={**config_to_dict(reward), **plan.fields, "train_file": accumulated,
                      "output_dir": str(plan.models_dir / "reward")},
              input_md5={"model": dvc_md5(reward.model_path), "train": dvc_md5(accumulated)})
    rm_path = rm["outputs"]["model"]
    return rm_path, [accumulated, rm_path]


def version_cycle(plan: CyclePlan, k: int, sampled: dict[str, Any], to_version: list[str],
                  cycle_run: Tracker) -> dict[str, Any] | None:
    """``dvc add`` + a git commit naming the flow run and cycle (+ ``dvc push``), if ``cycles.version``."""
    if not plan.cyc.version:
        return None
    consumed = plan.consumed
    message = (f"{plan.kind} {plan.run_label} cycle {k}/{plan.n_cycles}: {consumed} "
               f"{sampled['md5'][consumed]} (flow run {plan.tags['prefect.flow_run_id'] or '-'})")
    versioned = version_outputs(paths=to_version, message=message, push=plan.cyc.push)
    cycle_run.set_tags({"git.version_commit": versioned["commit"],
                        **{f"dvc.md5.versioned.{Path(p).name}": m for p, m in versioned["md5"].items()}})
    return versioned


def train_next_policy(plan: CyclePlan, k: int, policy: str, policy_md5: str, sampled: dict[str, Any],
                      md5: dict[str, str], common: dict[str, Any], rm_path: str = "") -> dict[str, Any]:
    """DPO on the pairs with the current policy as reference, or SFT on the kept samples (RAFT); the new
    policy's guards are checked against ``policy``, held-out answers scored by the cycle's reward model."""
    kind, cfg = plan.kind, plan.cfg
    guards = config_to_dict(cfg["guards"])
    if plan.cyc.scorer == "reward_model" and rm_path:
        guards["reward_model_path"] = rm_path
    common = {**common, "guards": guards}
    out_dir = str(plan.models_dir / f"cycle_{k}")
    checkpoint_dir = str(Path("checkpoints") / kind / f"cycle_{k}")
    if kind == "iterative_dpo":
        return _run(train_dpo, cfg["flow"], **common,
                    params={**config_to_dict(cfg["dpo"]), **plan.fields, "model_path": policy,
                            "ref_model_path": policy, "train_file": sampled["outputs"]["pairs"],
                            "eval_file": plan.eval_file, "output_dir": out_dir, "checkpoint_dir": checkpoint_dir},
                    input_md5={"model": policy_md5, "train": sampled["md5"]["pairs"], "eval": md5["eval"]})
    return _run(train_raft, cfg["flow"], **common,
                params={**config_to_dict(cfg["raft"]), **plan.fields, "model_path": policy,
                        "train_file": sampled["outputs"]["kept"], "eval_file": plan.eval_file,
                        "output_dir": out_dir, "checkpoint_dir": checkpoint_dir},
                input_md5={"model": policy_md5, "train": sampled["md5"]["kept"], "eval": md5["eval"]})


def register_and_record(plan: CyclePlan, k: int, policy: str, sampled: dict[str, Any], trained: dict[str, Any],
                        versioned: dict[str, Any] | None, cycle_run: Tracker, parent: Tracker) -> dict[str, Any]:
    """Register the trained policy (``champion`` if it beats the current one; nothing with
    ``tracking.log_model: false``), log the cycle's metrics and tags; returns the cycle's history entry."""
    accuracy = trained["metrics"]["eval/accuracy"]
    if plan.cfg["tracking"].log_model:
        registry = register_model(model_dir=trained["outputs"]["model"], run_id=trained["run_id"],
                                  accuracy=accuracy, registered_name=plan.cyc.registered_model,
                                  tracking=plan.tracking_d, guards=config_to_dict(plan.cfg["guards"]))
    else:  # tracking.log_model: false (a reproduction among others) registers nothing and moves no alias
        registry = {"version": "", "verdict": "not registered (tracking.log_model: false)"}
    metrics = {"cycle/accuracy": accuracy, "cycle/accuracy_stderr": trained["metrics"]["eval/accuracy_stderr"],
               **{f"cycle/{k2.split('/')[-1]}": v for k2, v in sampled["metrics"].items()}}
    guards = {key: v for key, v in trained["metrics"].items() if key.startswith("guard/")}
    cycle_run.log_metrics({**metrics, **guards}, k)
    parent.log_metrics({"eval/accuracy": accuracy}, k)
    fired = fired_guards(guards)
    cycle_run.set_tags({"registry.version": registry["version"], "registry.verdict": registry["verdict"],
                        "dvc.md5.output_model": trained["md5"]["model"],
                        **({"guard.fired": ",".join(fired) or "none"} if guards else {})})
    if guards:  # the flow run's view: which cycle fired which guard
        parent.set_tags({f"guard.fired.cycle_{k}": ",".join(fired) or "none"})
    get_run_logger().info("%s cycle %d/%d: accuracy %.3f ± %.3f; guards fired: %s; %s", plan.kind, k, plan.n_cycles,
                          accuracy, metrics["cycle/accuracy_stderr"], ",".join(fired) or "none", registry["verdict"])
    return {"cycle": k, "policy_in": policy, "model": trained["outputs"]["model"],
            "model_md5": trained["md5"]["model"], "accuracy": accuracy,
            "accuracy_stderr": metrics["cycle/accuracy_stderr"], "data_md5": sampled["md5"],
            "commit": versioned["commit"] if versioned else None, "run_id": cycle_run.run_id,
            "registry": registry, "guards_fired": fired}


def run_cycle(plan: CyclePlan, k: int, policy: str, rm_path: str, pair_pool: PairPool, md5: dict[str, str],
              parent: Tracker, previous_cycle_run: str | None,
              previous_stats: dict[str, float] | None = None) -> tuple[dict[str, Any], str]:
    """One cycle, a nested MLflow run: sample and score -> gate and data report -> version -> train -> register.
    Returns the cycle's history entry and the reward model the next cycle scores with.
    ``previous_stats``: the previous cycle's data-report statistics, for its drift checks."""
    kind = plan.kind
    cycle_tags = {"alignflow.cycle": str(k), "alignflow.flow": kind,
                  "alignflow.parent_cycle_run_id": previous_cycle_run or "",
                  **lineage_tags({"policy": policy}, f"{kind}-cycle")}
    with start_run(plan.cfg["tracking"], f"cycle-{k}", parent.run_id, cycle_tags) as cycle_run:
        common = dict(tracking=plan.tracking_d, parent_run_id=cycle_run.run_id)
        policy_md5 = dvc_md5(policy)
        sampled = sample_and_score(plan, k, policy, policy_md5, rm_path, md5, common)
        # The gate: generated data passes the same checks as any dataset before training on it.
        # The data report too (near-duplicates, eval contamination, drift against the previous cycle): its
        # page is an artifact of this cycle's run, and a check over its threshold stops the cycle here.
        consumed = plan.consumed
        gate = validate_data(path=sampled["outputs"][consumed], md5=sampled["md5"][consumed],
                             kind="preference" if consumed == "pairs" else "sft", name=f"cycle-{k}-{consumed}",
                             fields=plan.fields, data_report=config_to_dict(plan.cfg["data_report"]),
                             eval_file=plan.eval_file, previous=previous_stats, report_to_parent=True, **common)
        data_stats = {name: v for name, v in gate["metrics"].items() if name.startswith("data/")}
        cycle_run.log_metrics(data_stats, k)
        to_version = [sampled["outputs"]["pairs"], sampled["outputs"]["kept"]]
        if kind == "iterative_dpo" and plan.cyc.retrain_reward:
            rm_path, reward_files = retrain_reward_model(plan, sampled, pair_pool, common)
            to_version += reward_files
        versioned = version_cycle(plan, k, sampled, to_version, cycle_run)
        trained = train_next_policy(plan, k, policy, policy_md5, sampled, md5, common, rm_path)
        entry = register_and_record(plan, k, policy, sampled, trained, versioned, cycle_run, parent)
    return {**entry, "data_report": data_stats}, rm_path


def run_cycles(kind: str, params_file: str | None, overrides: dict[str, dict[str, Any]] | None,
               cycles: int | None, private_overrides: str | None = None) -> dict[str, Any]:
    """The body both flows share; ``kind`` is ``iterative_dpo`` or ``raft``."""
    cfg = load_all(params_file, overrides, private_overrides)
    use_hash_cache(cfg["tracking"].hash_cache)
    plan = plan_cycles(kind, cfg, cycles)
    tracking, cyc = cfg["tracking"], plan.cyc
    with one_flow_at_a_time(kind), start_run(tracking, kind, tags=plan.tags) as parent:
        md5 = log_and_validate_inputs(plan, parent)
        policy, rm_path = cyc.start_model, cyc.reward_model_path
        pair_pool = PairPool(plan.fields)
        if cyc.retrain_reward:
            pair_pool.add(cfg["reward"].train_file)
        history: list[dict[str, Any]] = []
        previous_cycle_run: str | None = None
        with gpu_stages(cfg["flow"]) as waited:  # the GPU limit, shared by every project on the Prefect server
            parent.set_tags(gpu_limit_tags(cfg["flow"], waited))
            for k in range(1, plan.n_cycles + 1):
                entry, rm_path = run_cycle(plan, k, policy, rm_path, pair_pool, md5, parent, previous_cycle_run,
                                           history[-1]["data_report"] if history else None)
                history.append(entry)
                policy, previous_cycle_run = entry["model"], entry["run_id"]

        summary = {"flow": kind, "parent_run_id": parent.run_id,
                   "tracking_uri": redact_secrets(resolve_tracking_uri(tracking)),  # no user:pass@ in summaries
                   "registered_model": cyc.registered_model, "cycles": history, "final_model": policy}
        print(f"{kind}: " + " -> ".join(f"cycle {h['cycle']} {h['accuracy']:.3f}" for h in history))
        return summary


@flow(name="iterative_dpo", log_prints=True)
def iterative_dpo(params_file: str | None = "params.yaml", overrides: dict[str, dict[str, Any]] | None = None,
                  cycles: int | None = None, private_overrides: str | None = None) -> dict[str, Any]:
    """N cycles of on-policy preference pairs (best vs worst of n) -> DPO; returns per-cycle results.
    ``private_overrides``: a file of overrides that carry secrets (flows.align.write_private_overrides)."""
    return run_cycles("iterative_dpo", params_file, overrides, cycles, private_overrides)


@flow(name="raft", log_prints=True)
def raft(params_file: str | None = "params.yaml", overrides: dict[str, dict[str, Any]] | None = None,
         cycles: int | None = None, private_overrides: str | None = None) -> dict[str, Any]:
    """N cycles of best-of-n sampling -> SFT on the kept samples (RAFT); returns per-cycle results.
    ``private_overrides``: a file of overrides that carry secrets (flows.align.write_private_overrides)."""
    return run_cycles("raft", params_file, overrides, cycles, private_overrides)
