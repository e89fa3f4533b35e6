"""The ``alignflow`` command line: one subcommand per stage, ``validate``, ``flow align`` and ``init``.

Stage commands (one per stage of the registry, rlhf_core/config/stage_registry.py: ``generate``,
``init-model``, ``sft``, ``evaluate``, the alignment stages) run a stage directly, as ``dvc repro`` does; ``flow align`` runs the whole pipeline under Prefect. Every command
reads ``params.yaml`` (``--params``) and takes ``--set field=value`` overrides (a stage command
also takes ``--set section.field=value`` for its own section; ``flow`` takes only that form).

Exit codes: 0 success; 1 invalid data (the Great Expectations report is printed); 2 a bad
config, command line or model directory. An error is printed once, naming its source
(flows/errors.py); ``--debug`` adds its traceback.

``--help`` and ``--version`` import nothing heavy: torch, MLflow, Prefect, Ray and Great
Expectations load inside the command that needs them (tests/unit/test_cli_startup.py).

``diff A B`` compares two runs or model versions (flows/diff.py); ``dvc-stages`` writes ``dvc.yaml`` from the
stage registry (flows/dvc_stages.py); ``gc`` deletes old runs, checkpoints and unused DVC objects (flows/gc_command.py).

``init PATH`` scaffolds a project of your own (flows/scaffold.py); every other command runs
in a project folder, reading its ``params.yaml``.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import json
import logging
import signal
import sys
import textwrap
from pathlib import Path
from typing import Any, Sequence

import rlhf_core  # offline switches first
from flows import errors
from flows.params import load_all, write_private_overrides
from flows.preflight import check_flow_inputs, check_inputs, check_prefect_server
from flows.profiles import Profile, apply_team_profile, params_file, take_profile
from rlhf_core.common.redact import redact_secrets
from rlhf_core.config import (
    OVERRIDE_SOURCE,
    SECTIONS,
    ConfigError,
    DataFields,
    DataReportConfig,
    GuardsConfig,
    TrackingConfig,
    field_docs,
    load_config,
    parse_overrides,
    read_params,
    section_fields,
)
from rlhf_core.data.validate import KINDS, ValidationFailed
from rlhf_core.config import stage_registry as registry
from rlhf_core.config.stage_registry import Stage
from rlhf_core.stages import wrappers as stages


def _common(p: argparse.ArgumentParser, section: str | None, stage: Stage | None = None) -> None:
    p.add_argument("--params", default="params.yaml", help="params file (default: params.yaml)")
    help_text = ("override a field of params.yaml's section (repeatable; VALUE read as YAML): FIELD=VALUE or "
                 "SECTION.FIELD=VALUE; the fields are listed below" if section is not None else
                 "override a field (repeatable; VALUE read as YAML): SECTION.FIELD=VALUE, e.g. sft.max_steps=100")
    p.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE", help=help_text)
    if section is not None:
        p.add_argument("--section", default=section,
                       help=f"the params.yaml section to read (default: {section}); another section of the same "
                            "fields runs this stage on another task, e.g. --section tool_sft")
        p.fields_section = section  # listed by _Parser.format_help
        p.fields_config = stage.config_class if stage is not None else None
        p.formatter_class = argparse.RawDescriptionHelpFormatter
    if stage is not None and stage.guarded:
        _add_register_flag(p)


class _Parser(argparse.ArgumentParser):
    """A subcommand's parser; a stage command's ``--help`` ends with its section's fields, read from the config
    module's docstrings only when help is shown (parsing them for every command would cost most of a second)."""

    fields_section: str | None = None
    fields_config: Any = None  # the stage's Stage.config_class, called only for help

    def format_help(self) -> str:
        if self.fields_section is not None:
            cls = self.fields_config() if self.fields_config is not None else SECTIONS[self.fields_section]
            self.epilog = _field_listing(self.fields_section, cls)
        return super().format_help()


def _field_listing(section: str, cls: type) -> str:
    """The ``--help`` epilog of a stage command: each field of its section on lines of its own."""
    docs = field_docs(cls)
    width = max(len(k) for k in docs) + 2
    lines = [f"fields of '{section}' (--set FIELD=VALUE):"]
    for name, doc in docs.items():
        lines += textwrap.wrap(" ".join(doc.split()), 100, initial_indent=f"  {name:<{width}}", subsequent_indent=" " * (width + 2))
    # argparse formats help with %: a field doc's "30%" broke `alignflow sft --help` (ValueError)
    return "\n".join(lines).replace("%", "%%")


def stage_overrides(pairs: Sequence[str], section: str, command: str,
                    shared: tuple[str, ...] = ()) -> dict[str, Any]:
    """A stage command's ``--set`` pairs as ``{field: value}``: ``FIELD=VALUE``, or ``SECTION.FIELD=VALUE`` for
    the section it reads (``section``, or the command's own name); ``shared`` sections' keys
    (``guards.FIELD``) are kept whole for the caller. Any other section is an error naming the flag."""
    out: dict[str, Any] = {}
    inner = section_fields(SECTIONS.get(section) or registry.get(command).config_class())  # rl's kl.coef ...
    for key, value in parse_overrides(list(pairs)).items():
        prefix, dot, name = key.partition(".")
        if dot and prefix in (section, command) and prefix not in inner:
            key = name
        elif dot and prefix not in shared and prefix not in inner:
            raise ConfigError(f"{OVERRIDE_SOURCE}: {key}: `alignflow {command}` sets fields of section "
                              f"'{section}' (FIELD=VALUE or {section}.FIELD=VALUE); "
                              f"other sections: `alignflow flow align --set {prefix}.FIELD=VALUE`")
        out[key] = value
    return out


def _print(obj: Any) -> None:
    print(json.dumps(obj, indent=2, sort_keys=True, default=str))


def _stage_cfg(args: argparse.Namespace) -> Any:
    """The command's config from params.yaml and ``--set``, its input files and start model checked."""
    stage = registry.get(args.command)
    cfg_section = getattr(args, "section", None) or stage.section
    overrides = stage_overrides(args.set, cfg_section, args.command)
    cfg = load_config(stage.config_class(), cfg_section, args.params, overrides)
    check_inputs(cfg, cfg_section, overrides, args.params)
    return cfg


def cmd_generate(args: argparse.Namespace) -> int:
    cfg = _stage_cfg(args)
    _print(stages.generate(cfg).to_dict())
    return 0


def cmd_gym_generate(args: argparse.Namespace) -> int:
    cfg = _stage_cfg(args)
    _print(stages.gym_generate(cfg, section=getattr(args, "section", None) or "gym_generate").to_dict())
    return 0


def cmd_init_model(args: argparse.Namespace) -> int:
    cfg = _stage_cfg(args)
    _print(stages.init_model(cfg).to_dict())
    return 0


def cmd_import_model(args: argparse.Namespace) -> int:
    cfg = _stage_cfg(args)
    _print(stages.import_model(cfg).to_dict())
    return 0


def cmd_validate(args: argparse.Namespace) -> int:
    overrides = stage_overrides(args.set, "sft", "validate")  # field names: the sft section's, as the flows read them
    # The unpaired kind's boolean field lives in its stage's own config, not DataFields.
    desirable_field = overrides.pop("desirable_field", None)
    fields = load_config(DataFields, "sft", None, overrides) if overrides else DataFields()
    # --eval-file: the data report too (what the flows run on each dataset they train on).
    report_cfg = load_config(DataReportConfig, "data_report", args.params) if args.eval_file else None
    try:
        result = stages.validate(args.file, args.kind, fields, report_file=args.report,
                                 desirable_field=None if desirable_field is None else str(desirable_field),
                                 data_report=report_cfg, eval_file=args.eval_file)
    except ValidationFailed as exc:  # this command's answer: the whole report, not a bounded error
        print(exc.report.render(), file=sys.stderr)
        return 1
    print(f"{args.file}: valid {args.kind} dataset ({int(result.metrics['data/n_rows'])} rows)")
    if report_cfg is not None:
        print(f"{args.file}: data report passed: " + ", ".join(
            f"{k.removeprefix('data/')} {v:.4g}" for k, v in result.metrics.items()
            if k.endswith(("_rate", "_matches", "_overlaps"))))
    return 0


def _require_checkpoint(cfg: Any, section: str) -> None:
    """``--resume``: there must be a checkpoint of this run (same config and inputs) to continue, or its
    finished output, saved but not yet tracked (the stage stopped before registering it)."""
    from rlhf_core.tracking.checkpoint import Checkpointer, run_fingerprint  # lazy: torch (light CLI start)

    checkpointer = Checkpointer(cfg.checkpoint_dir, run_fingerprint(cfg))
    if checkpointer.latest() is None and checkpointer.finished() is None:
        raise ConfigError(f"{section}: --resume: no checkpoint of this run (same config and inputs) in "
                          f"{cfg.checkpoint_dir}; run without --resume to start one")


def cmd_stage(args: argparse.Namespace) -> int:
    """A training-shaped stage command: runs the registry's entry of ``args.command`` with tracking, its guards
    and data report, and an optional metrics file."""
    stage = registry.get(args.command)
    cfg_section = getattr(args, "section", None) or stage.section
    overrides = stage_overrides(args.set, cfg_section, stage.name, shared=("guards", "data_report"))
    shared = {k: overrides.pop(k) for k in list(overrides) if k.partition(".")[0] in ("guards", "data_report")}
    cfg = load_config(stage.config_class(), cfg_section, args.params, overrides)
    check_inputs(cfg, cfg_section, overrides, args.params)
    if getattr(args, "resume", None) is not None:
        cfg = dataclasses.replace(cfg, resume=args.resume)
        if args.resume:
            _require_checkpoint(cfg, stage.section)
    tracking = load_config(TrackingConfig, "tracking", args.params)
    extra = _stage_extras(stage, cfg_section, args.params, shared)
    # torch and the trainers load with the entry: only once the config and inputs hold
    result = stage.entry_function()(cfg, tracking, metrics_file=args.metrics_file, **extra)
    out = result.to_dict()
    if getattr(args, "register", None):
        out["registry"] = _register(args.register, result, tracking, extra["guards"])
    _print(out)
    return 0


def _stage_extras(stage: Stage, cfg_section: str, params: str, shared: dict[str, Any]) -> dict[str, Any]:
    """A stage's guards (policy stages) and data report (training stages) configs, from their params sections
    and the ``guards.FIELD`` / ``data_report.FIELD`` overrides in ``shared``."""
    picked = {name: {k.split(".", 1)[1]: v for k, v in shared.items() if k.startswith(f"{name}.")}
              for name in ("guards", "data_report")}
    extra: dict[str, Any] = {}
    if stage.guarded:
        extra["guards"] = load_config(GuardsConfig, _task_section(cfg_section, "guards", params), params,
                                      picked["guards"])
    elif picked["guards"]:
        raise ConfigError(f"{OVERRIDE_SOURCE}: guards.* overrides apply to policy stages only "
                          f"({', '.join(s.name for s in registry.guarded())})")
    if stage.trains:  # the flows' data report, thresholds from params.yaml's data_report
        extra["data_report"] = load_config(DataReportConfig, _task_section(cfg_section, "data_report", params),
                                           params, picked["data_report"])
    elif picked["data_report"]:
        raise ConfigError(f"{OVERRIDE_SOURCE}: data_report.* overrides apply to training stages only "
                          f"({', '.join(s.name for s in registry.training())})")
    return extra


def _task_section(section: str, shared: str, params: str) -> str:
    """The params section of a stage section's data report or guards (``shared``: ``data_report``, ``guards``):
    ``tool_sft`` reads ``tool_data_report`` and ``tool_rl`` ``tool_guards`` where the params file has them (the tool
    task's answers repeat more; a tool call legitimately lengthens its answers), every other section ``shared``."""
    prefix = section.rpartition("_")[0]
    own = f"{prefix}_{shared}"
    if prefix and own in SECTIONS and Path(params).exists() and own in read_params(params):
        return own
    return shared


def _register(name: str, result: Any, tracking: TrackingConfig, guards: GuardsConfig) -> dict[str, Any]:
    """Register a policy stage's model as ``candidate`` of ``name``; ``champion`` only through the gate."""
    from tasks.registry import register_model  # lazy: prefect (light CLI start)

    if not tracking.log_model:
        raise ConfigError("--register: tracking.log_model is false, so no model is registered")
    outcome = register_model.fn(model_dir=result.outputs["model"], run_id=result.run_id,
                                accuracy=result.metrics.get("eval/accuracy"), registered_name=name,
                                tracking=dataclasses.asdict(tracking), guards=dataclasses.asdict(guards))
    print(f"registry: {name}: {outcome['verdict']}", file=sys.stderr)
    return outcome


def cmd_init(args: argparse.Namespace) -> int:
    from flows.scaffold import init_project  # lazy: prefect (light CLI start)

    made = init_project(args.path, force=args.force, recipe=args.recipe)
    print(f"alignflow project in {made.root}: {', '.join(made.written)}")
    print(f"DVC remote (default): {made.dvc_remote} (git-ignored; `dvc remote modify local url ...` moves it)")
    if made.initial_commit:
        print(f"git repository made; scaffold committed as {made.initial_commit[:10]}")
    else:
        print("inside an existing git repository: commit the scaffold (git add, git commit) before iterative flows")
    recipe = f"\n  dvc repro {registry.recipes()[args.recipe]}" if args.recipe else ""
    print(f"next:\n  cd {args.path}\n  alignflow flow align\n  alignflow flow iterative_dpo{recipe}")
    return 0


def cmd_evaluate(args: argparse.Namespace) -> int:
    cfg = _stage_cfg(args)
    tracking = load_config(TrackingConfig, "tracking", args.params)
    _print(stages.evaluate(cfg, tracking, run_name=args.run_name).to_dict())
    return 0


def _section_overrides(pairs: Sequence[str]) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for key, value in parse_overrides(list(pairs)).items():
        if "." not in key:
            raise ConfigError(f"{OVERRIDE_SOURCE}: {key!r}: flow overrides are section.field=value "
                              "(e.g. sft.max_steps=100)")
        section, name = key.split(".", 1)
        out.setdefault(section, {})[name] = value
    return out


def _flow_overrides(pairs: Sequence[str]) -> tuple[dict[str, dict[str, Any]], str | None]:
    """A flow's ``--set`` overrides as its Prefect parameters: ``(overrides, private_overrides)``.

    Prefect keeps a flow run's parameters in its database and UI, so a value that carries a secret
    (a URL's ``user:pass@`` or ``?token=``, a field named like ``token``) is shown there redacted
    (``***``), and its real value goes to a private file whose path is the second parameter
    (:func:`flows.params.write_private_overrides`). Secret-free overrides stay readable as given."""
    overrides = _section_overrides(pairs)
    secret = {section: {name: value for name, value in values.items() if redact_secrets(value, name) != value}
              for section, values in overrides.items()}
    secret = {section: values for section, values in secret.items() if values}
    if not secret:
        return overrides, None
    return redact_secrets(overrides), write_private_overrides(secret)


def _check_flow_config(args: argparse.Namespace, overrides: dict[str, dict[str, Any]], private: str | None) -> None:
    """Every section's config, the flow's own input paths and the Prefect server it is pointed at, checked before
    Prefect starts: a typo or a server that is down is one line naming its source in a second, not a failed flow run."""
    load_all(args.params, overrides, private)
    check_flow_inputs({f"--{k.replace('_', '-')}": getattr(args, k, None)
                       for k in ("sft_file", "preference_file", "prompts_file", "eval_file", "base_model")})
    check_prefect_server()


def cmd_flow(args: argparse.Namespace) -> int:
    if args.name in ("iterative_dpo", "raft"):
        return _cmd_cycles(args)
    overrides, private = _flow_overrides(args.set)
    _check_flow_config(args, overrides, private)
    from flows.align import align  # lazy: prefect (with MLflow and torch: only once the config holds)
    summary = align(params_file=args.params, overrides=overrides, sft_file=args.sft_file,
                    preference_file=args.preference_file, prompts_file=args.prompts_file,
                    eval_file=args.eval_file, base_model=args.base_model, private_overrides=private)
    _write_summary(summary, args.summary)
    uri = summary["tracking_uri"]
    m = summary["metrics"]
    print("\n=== alignflow: align flow finished ===")
    print(f"eval/accuracy  base {m['eval/accuracy_base']:.3f} -> SFT {m['eval/accuracy_sft']:.3f} "
          f"(± {m['eval/accuracy_stderr_sft']:.3f} std. err.)")
    for stage in summary.get("stages", {}):
        if f"eval/accuracy_{stage}" in m:
            print(f"               {stage:<9} {m[f'eval/accuracy_{stage}']:.3f} "
                  f"(± {m[f'eval/accuracy_stderr_{stage}']:.3f}; {m[f'eval/accuracy_{stage}'] - m['eval/accuracy_sft']:+.3f} vs SFT)")
        elif f"rejection/kept_accuracy_{stage}" in m:
            print(f"               {stage:<9} kept samples correct {m[f'rejection/kept_accuracy_{stage}']:.3f} "
                  f"(best of {summary.get('rejection_n', 'n')} by the reward model)")
        elif f"eval/reward_accuracy_{stage}" in m:
            print(f"               {stage:<9} held-out pairwise accuracy {m[f'eval/reward_accuracy_{stage}']:.3f}, "
                  f"margin {m[f'eval/reward_margin_{stage}']:.2f}")
    print(f"SFT model:       {summary['sft_model']}  (md5 {summary['md5']['model_sft']})")
    if summary.get("promotion"):
        p = summary["promotion"]
        print(f"policy registry: {p['stage']} model: {p['verdict']}")
        alias = "champion" if p.get("promoted") else "candidate"
        print(f"fetch it:        {_installed_command('mlflow')} artifacts download "
              f"-u models:/{p['registered_model']}@{alias} -d {p['registered_model']}-{alias}")
    print(f"registered SFT:  {summary['registered_model']}  ({summary['model_uri']})")
    print(f"parent run:      {summary['parent_run_id']}")
    print(f"MLflow UI:       {uri}" if uri.startswith(("http://", "https://"))  # a tracking server serves its UI
          else f"MLflow UI:       {_installed_command('mlflow')} ui --backend-store-uri {uri}")
    print(f"summary:         {args.summary}")
    return 0


def _installed_command(name: str) -> str:
    """A console script of this environment as the user can type it: relative where the environment
    lies in the working directory (the checkout's ``.venv/bin/mlflow``), else its absolute path (a
    project of the user's own, alignflow installed elsewhere)."""
    path = Path(sys.executable).parent / name
    return str(path.relative_to(Path.cwd())) if path.is_relative_to(Path.cwd()) else str(path)


def _write_summary(summary: dict[str, Any], path: str) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(summary, indent=2, sort_keys=True, default=str) + "\n")


def _cmd_cycles(args: argparse.Namespace) -> int:
    overrides, private = _flow_overrides(args.set)
    _check_flow_config(args, overrides, private)
    from flows import cycles  # lazy: prefect (light CLI start)
    summary = getattr(cycles, args.name)(params_file=args.params, overrides=overrides, cycles=args.cycles,
                                         private_overrides=private)
    path = args.summary if args.summary != DEFAULT_SUMMARY else f"metrics/{args.name}_summary.json"
    _write_summary(summary, path)
    print(f"\n=== alignflow: {args.name} flow finished ===")
    for h in summary["cycles"]:
        print(f"cycle {h['cycle']}: eval/accuracy {h['accuracy']:.3f} (± {h['accuracy_stderr']:.3f})  "
              f"commit {str(h['commit'])[:10]}  guards fired: {','.join(h.get('guards_fired') or []) or 'none'}  "
              f"{h['registry']['verdict']}")
    print(f"final model:     {summary['final_model']}")
    print(f"parent run:      {summary['parent_run_id']}")
    print(f"summary:         {path}")
    return 0


DEFAULT_SUMMARY = "metrics/align_summary.json"


def _add_register_flag(p: argparse.ArgumentParser) -> None:
    """``--register NAME`` on the policy stages' commands."""
    p.add_argument("--register", default=None, metavar="NAME",
                   help="register the model as candidate of NAME (e.g. alignflow-policy), and champion only "
                        "when the promotion gate passes (guards section; --set guards.FIELD=VALUE)")


def _add_training_command(p: argparse.ArgumentParser, stage: Stage) -> None:
    """A training-shaped stage's arguments (config, overrides, metrics file, resume); its handler :func:`cmd_stage`."""
    _common(p, stage.section, stage)
    p.add_argument("--metrics-file", default=None, help="write final metrics JSON here (for DVC)")
    if stage.trains:  # the trainers checkpoint; a stage that only samples does not
        group = p.add_mutually_exclusive_group()
        group.add_argument("--resume", dest="resume", action="store_const", const=True, default=None,
                           help="continue this run from its newest checkpoint (an error if there is none); "
                                "resuming an interrupted run is also the default without this flag")
        group.add_argument("--fresh", dest="resume", action="store_const", const=False,
                           help="start over, ignoring any checkpoint")
    p.set_defaults(func=cmd_stage)


def _add_validate_command(p: argparse.ArgumentParser) -> None:
    p.add_argument("--kind", required=True, choices=KINDS,
                   help="sft (SFT, RAFT, distill), preference (DPO, reward), prompts (evaluation; RL, rejection "
                        "scored against the label), prompt-only (RL, rejection with a reward model: label "
                        "optional), unpaired (desirable/undesirable examples); each in TRL's standard or "
                        "conversational form")
    p.add_argument("file", help="a .jsonl, .json or .parquet file, a saved datasets folder, or a folder in the "
                                "Hub's dataset layout")
    p.add_argument("--report", default=None, help="write the JSON report here (only when valid)")
    p.add_argument("--eval-file", default=None, help="also run the data report (near-duplicates, contamination "
                   "against this eval set; thresholds: params.yaml's data_report), as the flows do")
    p.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                   help="rename fields, e.g. --set prompt_field=question (unpaired: --set desirable_field=label)")
    p.add_argument("--params", default="params.yaml", help=argparse.SUPPRESS)
    p.set_defaults(func=cmd_validate)


def _add_stage_commands(sub: Any) -> None:
    """One command per stage of the registry that has one: the training-shaped ones share :func:`cmd_stage`,
    the others have a handler of their own."""
    own = {"generate": cmd_generate, "gym-generate": cmd_gym_generate, "init-model": cmd_init_model,
           "import-model": cmd_import_model,
           "evaluate": cmd_evaluate}
    for stage in registry.commands():
        p = sub.add_parser(stage.name, help=stage.help)
        if stage.command == registry.TRAIN:
            _add_training_command(p, stage)
        elif stage.name == "validate":
            _add_validate_command(p)
        else:
            _common(p, stage.section, stage)
            if stage.name == "evaluate":
                p.add_argument("--run-name", default="evaluate")
            p.set_defaults(func=own[stage.name])


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="alignflow", description=__doc__.split("\n\n")[0])
    parser.add_argument("--version", action="version", version=f"alignflow {rlhf_core.__version__}")
    parser.add_argument("--debug", action="store_true",
                        help="on an error, print its traceback too (and Prefect's own failure logs); "
                             "accepted anywhere on the command line")
    parser.add_argument("--profile", choices=[p.value for p in Profile], default=None,
                        help="embedded (default: sqlite MLflow, ephemeral Prefect) or team: the team section's "
                             "services (alignflow services up); accepted anywhere; else ALIGNFLOW_PROFILE")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    _add_stage_commands(sub)

    # Listed for --help only: main() hands these to their modules (PASSTHROUGH).
    sub.add_parser("serve-rm", help="serve a trained reward model over HTTP on 127.0.0.1; --token-env NAME requires a "
                                    "bearer token; body and batch size capped (serve-rm --help)")
    sub.add_parser("reproduce", help="rerun a run (MLflow run id) or commit (git rev) with no cache; compare; stored "
                                     "params that change code, outputs, URLs or tracking need --trust (reproduce --help)")
    sub.add_parser("diff", help="compare two runs or model versions (run ids, models:/NAME/3, NAME@champion): "
                                "code, data md5s, params, metrics with errors; differences first (diff --help)")
    sub.add_parser("nightly", help="serve align / iterative_dpo as cron deployments (default 02:00 UTC; nightly --help)")
    sub.add_parser("services", help="start, stop or report the team profile's services: PostgreSQL, an S3-compatible "
                                    "object store, MLflow and Prefect servers (services --help)")
    sub.add_parser("dvc-stages", help="write (--write) or check (--check) dvc.yaml and the project template's from "
                                      "the stage registry, with each stage's code deps (dvc-stages --help)")
    sub.add_parser("gc", help="delete old runs, their artifacts, versions and checkpoints, and unused DVC objects, by "
                              "retention.*; aliased versions, their lineage and alignflow.keep runs stay (dry run "
                              "unless --apply; gc --help)")

    p = sub.add_parser("init", help="scaffold a project of your own: params.yaml, dvc.yaml, prefect.yaml, data/, "
                                    "git + DVC with a local remote (refuses to overwrite existing files)")
    p.add_argument("path", help="the project folder (made if missing)")
    p.add_argument("--force", action="store_true", help="overwrite the scaffold's files where they exist")
    p.add_argument("--recipe", choices=sorted(registry.recipes()),
                   help="also a recipe of its own: its dvc.yaml (recipes/NAME/dvc.yaml) and params sections "
                        "(real: a pretrained model on a reasoning-gym task; needs the real-model extra)")
    p.set_defaults(func=cmd_init)

    p = sub.add_parser("flow", help="run a Prefect flow")
    p.add_argument("name", choices=["align", "iterative_dpo", "raft"])
    _common(p, None)
    p.add_argument("--sft-file"), p.add_argument("--preference-file"), p.add_argument("--prompts-file")
    p.add_argument("--eval-file"), p.add_argument("--base-model", help="a user's HF model directory")
    p.add_argument("--cycles", type=int, default=None, help="iterative_dpo / raft: override cycles.cycles")
    p.add_argument("--summary", default=DEFAULT_SUMMARY,
                   help="where the run summary is written (cycle flows: metrics/<flow>_summary.json)")
    p.set_defaults(func=cmd_flow)
    return parser


# Commands implemented by a module's own ``main(argv)``; listed in build_parser for --help only.
PASSTHROUGH = {"serve-rm": "rlhf_core.rewards.server", "nightly": "flows.nightly", "reproduce": "flows.reproduce",
               "diff": "flows.diff", "dvc-stages": "flows.dvc_stages", "services": "flows.services.command",
               "gc": "flows.gc_command"}


def setup_logging(debug: bool) -> None:
    """Warnings and up on stderr, one line each; Prefect's repeats of the project's own errors dropped
    unless ``debug`` (:func:`flows.errors.quiet_prefect_failures`). Before Prefect is imported, which then
    keeps this handler."""
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    if not debug:
        errors.quiet_prefect_failures()


def _apply_profile(argv: list[str]) -> list[str]:
    """``argv`` without ``--profile NAME``; the team profile points this process at the team's services first
    (flows/profiles.py). ``services`` reads its own team section and takes no profile."""
    profile, argv = take_profile(argv)
    if profile is Profile.TEAM and argv[:1] != ["services"]:
        apply_team_profile(params_file(argv))
    return argv


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in argv  # taken anywhere on the line, so it can be added to a command as typed
    argv = [a for a in argv if a != "--debug"]
    try:
        argv = _apply_profile(argv)
    except Exception as exc:  # noqa: BLE001 - a bad profile or team section is one message
        code = errors.report(exc, debug)
        if code is None:
            raise
        return code
    if argv[:1] and argv[0] in PASSTHROUGH:  # these commands' own parsers own every argument, --help included
        return importlib.import_module(PASSTHROUGH[argv[0]]).main(argv[1:])
    args = build_parser().parse_args(argv)
    setup_logging(debug)
    try:
        return args.func(args)
    except Exception as exc:  # noqa: BLE001 - the project's own errors become one message; others propagate
        code = errors.report(exc, debug)
        if code is None:
            raise
        return code


if __name__ == "__main__":
    sys.exit(main())
