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
from pathlib import Path
from typing import Any

from prefect import flow, get_run_logger
from prefect.runtime import flow_run

from rlhf_core.config import ConfigError, CyclesConfig, DataFields, config_to_dict
from rlhf_core.lineage import dvc_md5
from rlhf_core.stages import lineage_tags
from rlhf_core.synthetic import write_jsonl
from rlhf_core.tracking import resolve_tracking_uri, start_run
from flows.align import _run, load_all, one_flow_at_a_time
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


def run_cycles(kind: str, params_file: str | None, overrides: dict[str, dict[str, Any]] | None,
               cycles: int | None) -> dict[str, Any]:
    """The body both flows share; ``kind`` is ``iterative_dpo`` or ``raft``."""
    logger = get_run_logger()
    cfg = load_all(params_file, overrides)
    cyc: CyclesConfig = cfg["cycles"]
    n_cycles = cycles or cyc.cycles
    tracking = cfg["tracking"]
    tracking_d = config_to_dict(tracking)
    cache = cfg["flow"]  # cache, retries and isolation of every task below
    fields = {f: getattr(cfg["sft"], f) for f in DataFields.__dataclass_fields__}
    rejection, dpo, raft, reward = cfg["rejection"], cfg["dpo"], cfg["raft"], cfg["reward"]
    prompts_file, eval_file = rejection.prompts_file, dpo.eval_file
    data_dir, models_dir = Path(cyc.data_dir) / kind, Path(cyc.models_dir) / kind
    if cyc.scorer == "reward_model" and not Path(cyc.reward_model_path).exists():
        raise ConfigError(f"cycles.reward_model_path: no reward model at {cyc.reward_model_path} "
                          "(train one with `alignflow reward`, or set cycles.scorer: rule)")
    run_label = str(flow_run.get_name() or "local")
    tags = {"prefect.flow_run_id": str(flow_run.get_id() or ""), "prefect.flow_run_name": run_label,
            "alignflow.flow": kind}

    with one_flow_at_a_time(kind), start_run(tracking, kind, tags=tags) as parent:
        parent.log_dict({"flow": kind, "params": {name: config_to_dict(c) for name, c in cfg.items()},
                         "inputs": {"cycles": n_cycles}}, "reproduce.json")
        parent.log_params({"cycles": config_to_dict(cyc), "rejection": config_to_dict(rejection),
                           "train": config_to_dict(dpo if kind == "iterative_dpo" else raft)})
        md5 = {"prompts": dvc_md5(prompts_file), "eval": dvc_md5(eval_file)}
        for name, path in (("prompts", prompts_file), ("eval", eval_file)):
            validate_data(path=path, md5=md5[name], kind="prompts", name=name, fields=fields, tracking=tracking_d,
                          parent_run_id=parent.run_id)
        parent.set_tags(lineage_tags({"prompts": prompts_file, "eval": eval_file, "start_model": cyc.start_model},
                                     kind))

        policy, rm_path = cyc.start_model, cyc.reward_model_path
        pair_pool = PairPool(fields)
        if cyc.retrain_reward:
            pair_pool.add(reward.train_file)
        history: list[dict[str, Any]] = []
        previous_cycle_run: str | None = None
        for k in range(1, n_cycles + 1):
            cycle_tags = {"alignflow.cycle": str(k), "alignflow.flow": kind,
                          "alignflow.parent_cycle_run_id": previous_cycle_run or "",
                          **lineage_tags({"policy": policy}, f"{kind}-cycle")}
            with start_run(tracking, f"cycle-{k}", parent.run_id, cycle_tags) as cycle_run:
                common = dict(tracking=tracking_d, parent_run_id=cycle_run.run_id)
                policy_md5 = dvc_md5(policy)

                # ---- sample and score ----------------------------------------------------
                params = {**config_to_dict(rejection), **fields, "policy_path": policy, "prompts_file": prompts_file,
                          "scorer": cyc.scorer, "reward_model_path": rm_path, "n_samples": cyc.n_samples,
                          "temperature": cyc.temperature, "max_prompts": cyc.max_prompts, "seed": cyc.seed + k,
                          "output_file": str(data_dir / "kept.jsonl"), "pairs_file": str(data_dir / "pairs.jsonl")}
                input_md5 = {"policy": policy_md5, "prompts": md5["prompts"]}
                if cyc.scorer == "reward_model":
                    input_md5["reward_model"] = dvc_md5(rm_path)
                sampled = _run(sample_best_of_n, cache, params=params, input_md5=input_md5, **common)
                consumed = "pairs" if kind == "iterative_dpo" else "kept"

                # ---- the gate, then versioning ------------------------------------------
                validate_data(path=sampled["outputs"][consumed], md5=sampled["md5"][consumed],
                              kind="preference" if consumed == "pairs" else "sft", name=f"cycle-{k}-{consumed}",
                              fields=fields, **common)
                to_version = [sampled["outputs"]["pairs"], sampled["outputs"]["kept"]]
                if kind == "iterative_dpo" and cyc.retrain_reward:
                    pair_pool.add(sampled["outputs"]["pairs"])
                    accumulated = pair_pool.write(data_dir / "reward_pairs.jsonl")
                    rm = _run(train_reward, cache, **common,
                              params={**config_to_dict(reward), **fields, "train_file": accumulated,
                                      "output_dir": str(models_dir / "reward")},
                              input_md5={"model": dvc_md5(reward.model_path), "train": dvc_md5(accumulated)})
                    rm_path = rm["outputs"]["model"]
                    to_version += [accumulated, rm_path]
                versioned = None
                if cyc.version:
                    message = (f"{kind} {run_label} cycle {k}/{n_cycles}: {consumed} "
                               f"{sampled['md5'][consumed]} (flow run {tags['prefect.flow_run_id'] or '-'})")
                    versioned = version_outputs(paths=to_version, message=message, push=cyc.push)
                    cycle_run.set_tags({"git.version_commit": versioned["commit"],
                                        **{f"dvc.md5.versioned.{Path(p).name}": m
                                           for p, m in versioned["md5"].items()}})

                # ---- train the next policy --------------------------------------------------
                out_dir = str(models_dir / f"cycle_{k}")
                if kind == "iterative_dpo":
                    trained = _run(train_dpo, cache, **common,
                                   params={**config_to_dict(dpo), **fields, "model_path": policy,
                                           "ref_model_path": policy, "train_file": sampled["outputs"]["pairs"],
                                           "eval_file": eval_file, "output_dir": out_dir,
                                           "checkpoint_dir": str(Path("checkpoints") / kind / f"cycle_{k}")},
                                   input_md5={"model": policy_md5, "train": sampled["md5"]["pairs"],
                                              "eval": md5["eval"]})
                else:
                    trained = _run(train_raft, cache, **common,
                                   params={**config_to_dict(raft), **fields, "model_path": policy,
                                           "train_file": sampled["outputs"]["kept"], "eval_file": eval_file,
                                           "output_dir": out_dir,
                                           "checkpoint_dir": str(Path("checkpoints") / kind / f"cycle_{k}")},
                                   input_md5={"model": policy_md5, "train": sampled["md5"]["kept"],
                                              "eval": md5["eval"]})

                # ---- evaluate, register, promote --------------------------------------------
                accuracy = trained["metrics"]["eval/accuracy"]
                registry = register_model(model_dir=trained["outputs"]["model"], run_id=trained["run_id"],
                                          accuracy=accuracy, registered_name=cyc.registered_model,
                                          tracking=tracking_d)
                metrics = {"cycle/accuracy": accuracy, "cycle/accuracy_stderr": trained["metrics"]["eval/accuracy_stderr"],
                           **{f"cycle/{k2.split('/')[-1]}": v for k2, v in sampled["metrics"].items()}}
                cycle_run.log_metrics(metrics, k)
                parent.log_metrics({"eval/accuracy": accuracy}, k)
                cycle_run.set_tags({"registry.version": registry["version"], "registry.verdict": registry["verdict"],
                                    "dvc.md5.output_model": trained["md5"]["model"]})
                logger.info("%s cycle %d/%d: accuracy %.3f ± %.3f; %s", kind, k, n_cycles, accuracy,
                            metrics["cycle/accuracy_stderr"], registry["verdict"])
                history.append({"cycle": k, "policy_in": policy, "model": trained["outputs"]["model"],
                                "model_md5": trained["md5"]["model"], "accuracy": accuracy,
                                "accuracy_stderr": metrics["cycle/accuracy_stderr"], "data_md5": sampled["md5"],
                                "commit": versioned["commit"] if versioned else None, "run_id": cycle_run.run_id,
                                "registry": registry})
                policy, previous_cycle_run = trained["outputs"]["model"], cycle_run.run_id

        summary = {"flow": kind, "parent_run_id": parent.run_id, "tracking_uri": resolve_tracking_uri(tracking),
                   "registered_model": cyc.registered_model, "cycles": history, "final_model": policy}
        print(f"{kind}: " + " -> ".join(f"cycle {h['cycle']} {h['accuracy']:.3f}" for h in history))
        return summary


@flow(name="iterative_dpo", log_prints=True)
def iterative_dpo(params_file: str | None = "params.yaml", overrides: dict[str, dict[str, Any]] | None = None,
                  cycles: int | None = None) -> dict[str, Any]:
    """N cycles of on-policy preference pairs (best vs worst of n) -> DPO; returns per-cycle results."""
    return run_cycles("iterative_dpo", params_file, overrides, cycles)


@flow(name="raft", log_prints=True)
def raft(params_file: str | None = "params.yaml", overrides: dict[str, dict[str, Any]] | None = None,
         cycles: int | None = None) -> dict[str, Any]:
    """N cycles of best-of-n sampling -> SFT on the kept samples (RAFT); returns per-cycle results."""
    return run_cycles("raft", params_file, overrides, cycles)
