"""The stage registry: each pipeline stage declared once, everything that runs or lists stages derived from it.

A :class:`Stage` names a stage's command, help line, params section and config class, the function that
runs it (:mod:`rlhf_core.stages.wrappers`), the datasets it reads and the kind the gate checks them as,
what it writes, whether it trains, is guarded (a policy stage: guards against its parent, ``--register``)
and sits in the align flow's chain, and its DVC stages. From this table come the ``alignflow`` stage
commands (flows/cli.py), the Prefect training tasks and their child-process worker (tasks/), the align
flow's chain (flows/align.py), the guarded stages ``alignflow diff`` compares, what preflight says writes a
missing path (flows/preflight.py), the flow's known stages (``flow.stages``) and ``dvc.yaml``
(``alignflow dvc-stages --write``, flows/dvc_stages.py).

Config classes and stage functions are named by dotted path (``module:name``) and imported only when a
stage runs: importing this module imports nothing of the core, so ``alignflow --help`` stays light and the
config module can read the align chain from here. A stage of a plugin or a test calls :func:`register`.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

TRAIN = "train"
"""``Stage.command``: the shared training-command shape (config, ``--metrics-file``, tracking, guards)."""
OWN = "own"
"""``Stage.command``: a command with a handler of its own in flows/cli.py."""
NONE = "none"
"""``Stage.command``: no ``alignflow`` command (a DVC stage runs ``python -m`` a module)."""


@dataclass(frozen=True)
class Read:
    """A flow dataset a stage reads: the config field naming it, the dataset, the kind the gate checks."""

    field: str
    """Config field holding the file's path (``train_file``)."""
    dataset: str
    """The align flow's dataset: ``sft``, ``preferences``, ``prompts`` or ``eval``."""
    kind: str
    """Validation kind (rlhf_core/data/validate.py KINDS) this stage reads it as."""


@dataclass(frozen=True)
class DvcStage:
    """One stage of ``dvc.yaml``; its alignflow source deps are derived, not listed here."""

    name: str
    cmd: str
    deps: tuple[str, ...] = ()
    """Data and model deps, in order; the code deps follow them."""
    params: tuple[str, ...] = ()
    outs: tuple[str, ...] = ()
    cache_outs: bool = True
    """False: each out is written with ``cache: false`` (reports kept in git)."""
    metrics: tuple[str, ...] = ()
    """Metrics files, never cached."""
    foreach: tuple[tuple[str, Any], ...] = ()
    """A foreach stage's items (key, value): the stage body becomes its ``do``."""
    comment: tuple[str, ...] = ()
    """Comment lines written above the stage."""
    in_template: bool = True
    """Also a stage of the ``alignflow init`` project template (flows/project_template/dvc.yaml)."""
    file: str = "dvc.yaml"
    """The checkout's ``dvc.yaml`` that holds it. A recipe of its own (the real recipe: ``recipes/real/dvc.yaml``)
    sits in its own file, which ``dvc repro`` and ``make repro`` leave alone (DVC reads the working directory's
    ``dvc.yaml`` unless given a target); its stages run from the checkout's root (``wdir``), their paths as here."""


@dataclass(frozen=True)
class Stage:
    """A pipeline stage, declared once (module docstring)."""

    name: str
    """Command name (``alignflow init-model``)."""
    help: str
    """One line for ``alignflow --help``."""
    section: str
    """The params.yaml section it reads."""
    config: type | str
    """Its config class, or its dotted path ``module:Class``."""
    entry: str
    """The function that runs it, ``module:function`` (rlhf_core/stages/wrappers.py)."""
    command: str = OWN
    """How flows/cli.py exposes it: :data:`TRAIN`, :data:`OWN` or :data:`NONE`."""
    reads: tuple[Read, ...] = ()
    gates: tuple[tuple[str, str], ...] = ()
    """Outputs (name, validation kind) the gate checks before a later stage trains on them."""
    writes: tuple[str, str] | None = None
    """(config field, what its command does there): what preflight names as the maker of a missing path."""
    trains: bool = False
    """Checkpoints and resumes; the data report runs on its training data first."""
    guarded: bool = False
    """A policy stage: its model is checked against its parent (``guards``) and may be registered."""
    in_chain: bool = False
    """Runs in the align flow after SFT when ``flow.stages`` names it (registration order is the default order)."""
    task: str = ""
    """Its Prefect task's name (a training stage's)."""
    dvc: tuple[DvcStage, ...] = ()

    def config_class(self) -> type:
        return _resolve(self.config) if isinstance(self.config, str) else self.config

    def entry_function(self) -> Any:
        return _resolve(self.entry)


def _resolve(dotted: str) -> Any:
    module, _, name = dotted.partition(":")
    return getattr(importlib.import_module(module), name)


STAGES: dict[str, Stage] = {}
"""Every registered stage by command name, in registration order."""


def register(stage: Stage) -> Stage:
    """Add ``stage``; a name or DVC stage name already taken is an error, not a silent replacement."""
    if stage.name in STAGES:
        raise ValueError(f"stage {stage.name!r} is already registered")
    taken = {d.name for s in STAGES.values() for d in s.dvc}
    clash = [d.name for d in stage.dvc if d.name in taken]
    if clash:
        raise ValueError(f"stage {stage.name!r}: DVC stage(s) {clash} already registered")
    STAGES[stage.name] = stage
    return stage


def unregister(name: str) -> None:
    """Remove a stage (a test's toy stage)."""
    STAGES.pop(name)


def get(name: str) -> Stage:
    try:
        return STAGES[name]
    except KeyError:
        raise KeyError(f"no stage {name!r}; registered: {', '.join(STAGES)}") from None


def commands() -> list[Stage]:
    """Stages with an ``alignflow`` command."""
    return [s for s in STAGES.values() if s.command != NONE]


def training() -> list[Stage]:
    return [s for s in STAGES.values() if s.trains]


def guarded() -> list[Stage]:
    return [s for s in STAGES.values() if s.guarded]


def chain() -> list[Stage]:
    """The stages the align flow can run after SFT, in their default order."""
    return [s for s in STAGES.values() if s.in_chain]


def chain_names() -> tuple[str, ...]:
    return tuple(s.name for s in chain())


def dvc_stages() -> list[DvcStage]:
    """Every DVC stage in ``dvc.yaml``'s order: the template's, then the repository's own, each by registration."""
    every = [d for s in STAGES.values() for d in s.dvc]
    return [d for d in every if d.in_template] + [d for d in every if not d.in_template]


def recipes() -> dict[str, str]:
    """Each recipe of its own (a dvc.yaml beside the checkout's): its name (the file's folder) -> the file."""
    return {Path(d.file).parent.name: d.file for d in dvc_stages() if d.file != "dvc.yaml"}


# --------------------------------------------------------------------------------------
# alignflow's stages
# --------------------------------------------------------------------------------------

_CONFIG = "rlhf_core.config"
_WRAPPERS = "rlhf_core.stages.wrappers"
_EMBEDDED = "data/embedded"
_VALIDATED = "reports/validation"
_TOOL_COMMENT = (
    "# ---- the embedded tool task (rlhf_core/rollout/tool_task.py): arithmetic with a calculator --------------",
    "# Beside the default pipeline, sharing none of its outputs; params sections tool_* (params.yaml).",
    "# Not in the `alignflow init` template (tests/unit/test_project_template.py says why).",
)
_TOOL_TASK = "python -m rlhf_core.rollout.tool_task"
_REAL = "data/real"
_REAL_FILES = ("prompts.jsonl", "eval.jsonl", "sft.jsonl", "eval_second.jsonl", "eval_gsm.jsonl", "manifest.json")
"""What real_generate writes (params.yaml's real_generate section: the task, a second task and gsm_symbolic)."""
_REAL_KINDS = {name: "sft" if name == "sft.jsonl" else "prompts" for name in _REAL_FILES if name.endswith(".jsonl")}
"""Each file's validation kind (the real_validate stage)."""
_REAL_DVC = "recipes/real/dvc.yaml"
"""The real recipe's own dvc.yaml: ``make real-recipe`` (``dvc repro recipes/real/dvc.yaml``) runs it."""
_REAL_COMMENT = (
    "# ---- the real recipe: a pretrained model on a reasoning-gym task (the real-model extra: make setup-real) -----",
    "# Beside the default pipeline, sharing none of its outputs; params sections real_* (params.yaml).",
)


def _real(stage: str, deps: tuple[str, ...], *, outs: tuple[str, ...] = ()) -> DvcStage:
    """The real recipe's DVC stage of ``alignflow STAGE --section real_STAGE``: models/real_STAGE unless ``outs``."""
    name = f"real_{stage}"
    return DvcStage(name, f"alignflow {stage} --section {name} --metrics-file metrics/{name}.json", deps=deps,
                    params=(name,), outs=outs or (f"models/{name}",), metrics=(f"metrics/{name}.json",),
                    in_template=False, file=_REAL_DVC)


_REAL_EVALS = tuple((f"{model}{suffix}", {"model": f"models/real_{model}", "eval": f"eval{suffix}", "tokens": tokens})
                    for suffix, tokens, models in (("", 48, ("base", "sft", "rl", "raft")),
                                                   ("_second", 48, ("base", "sft", "rl", "raft")), ("_gsm", 160, ("base", "raft")))
                    for model in models)
"""The real recipe's evaluations (key, item): every model on the task, the first and last on the second task and on
gsm_symbolic (whose worked answers need a longer budget)."""


def _train(name: str, help_text: str, cls: str, *, reads: tuple[Read, ...], deps: tuple[str, ...],
           guarded: bool = False, in_chain: bool = True, task: str = "", comment: tuple[str, ...] = (),
           more_dvc: tuple[DvcStage, ...] = ()) -> Stage:
    """A training stage of the usual shape: ``alignflow NAME`` writes ``models/NAME`` and ``metrics/NAME.json``."""
    dvc = DvcStage(name, f"alignflow {name} --metrics-file metrics/{name}.json", deps=deps, params=(name,),
                   outs=(f"models/{name}",), metrics=(f"metrics/{name}.json",), comment=comment)
    return Stage(name, help_text, name, f"{_CONFIG}:{cls}", f"{_WRAPPERS}:{name}", command=TRAIN, reads=reads,
                 writes=("output_dir", "trains it"), trains=True, guarded=guarded, in_chain=in_chain,
                 task=task or f"train-{name}", dvc=(dvc, *more_dvc))


register(Stage(
    "generate", "write the embedded task's datasets", "generate", f"{_CONFIG}:GenerateConfig", f"{_WRAPPERS}:generate",
    writes=("out_dir", "writes the embedded datasets there"),
    dvc=(DvcStage("generate", "alignflow generate", params=("generate",),
                  outs=tuple(f"{_EMBEDDED}/{n}.jsonl" for n in ("sft", "preferences", "prompts", "eval"))),)))

register(Stage(
    "tool-generate", "write the tool task's datasets", "tool_generate", f"{_CONFIG}:ToolGenerateConfig",
    "rlhf_core.rollout.tool_task:main", command=NONE,
    dvc=(DvcStage("tool_generate", f"{_TOOL_TASK} generate", params=("tool_generate",),
                  outs=("data/tool/sft.jsonl", "data/tool/prompts.jsonl", "data/tool/eval.jsonl"),
                  comment=_TOOL_COMMENT, in_template=False),)))

register(Stage(
    "validate", "validate a dataset with Great Expectations (exit 1 if invalid)", "sft", f"{_CONFIG}:DataFields",
    f"{_WRAPPERS}:validate",
    dvc=(DvcStage("validate", "alignflow validate --kind ${item.kind} data/embedded/${item.file} "
                              "--report reports/validation/${key}.json",
                  deps=("data/embedded/${item.file}",), outs=(f"{_VALIDATED}/${{key}}.json",), cache_outs=False,
                  foreach=(("sft", {"file": "sft.jsonl", "kind": "sft"}),
                           ("preferences", {"file": "preferences.jsonl", "kind": "preference"}),
                           ("prompts", {"file": "prompts.jsonl", "kind": "prompts"}),
                           ("eval", {"file": "eval.jsonl", "kind": "prompts"}))),)))

register(Stage(
    "init-model", "train the tokenizer and build the embedded tiny model", "model", f"{_CONFIG}:ModelConfig",
    f"{_WRAPPERS}:init_model", writes=("out_dir", "builds the embedded tiny model there"),
    dvc=(DvcStage("init_model", "alignflow init-model", deps=(f"{_EMBEDDED}/sft.jsonl",), params=("model",),
                  outs=("models/base",)),
         DvcStage("tool_init_model", "alignflow init-model --section tool_model", deps=("data/tool/sft.jsonl",),
                  params=("tool_model",), outs=("models/tool_base",), in_template=False))))

register(_train(
    "sft", "supervised fine-tuning", "SFTConfig", in_chain=False,
    reads=(Read("train_file", "sft", "sft"),),
    deps=("models/base", f"{_EMBEDDED}/sft.jsonl", f"{_EMBEDDED}/eval.jsonl", f"{_VALIDATED}/sft.json",
          f"{_VALIDATED}/eval.json"),
    more_dvc=(DvcStage("tool_sft", "alignflow sft --section tool_sft --metrics-file metrics/tool_sft.json",
                       deps=("models/tool_base", "data/tool/sft.jsonl", "data/tool/eval.jsonl"), params=("tool_sft",),
                       outs=("models/tool_sft",), metrics=("metrics/tool_sft.json",), in_template=False),
              _real("sft", ("models/real_base", f"{_REAL}/sft.jsonl", f"{_REAL}/eval.jsonl",
                            f"{_VALIDATED}/real_sft.json")))))

register(Stage(
    "evaluate", "greedy exact-match accuracy of a model", "evaluate", f"{_CONFIG}:EvalConfig", f"{_WRAPPERS}:evaluate",
    dvc=(DvcStage("evaluate", "alignflow evaluate", deps=("models/sft", f"{_EMBEDDED}/eval.jsonl"),
                  params=("evaluate",), metrics=("metrics/eval_sft.json",)),
         DvcStage("real_evaluate", "alignflow evaluate --section real_evaluate --run-name real-eval-${key} "
                                   "--set model_path=${item.model} --set eval_file=data/real/${item.eval}.jsonl "
                                   "--set max_new_tokens=${item.tokens} --set output_file=metrics/real_eval_${key}.json",
                  deps=("${item.model}", "data/real/${item.eval}.jsonl"), params=("real_evaluate",),
                  metrics=("metrics/real_eval_${key}.json",), in_template=False, file=_REAL_DVC,
                  foreach=_REAL_EVALS))))

register(_train(
    "reward", "train a scalar reward model on preference pairs", "RewardConfig", task="train-reward-model",
    reads=(Read("train_file", "preferences", "preference"),),
    deps=("models/sft", f"{_EMBEDDED}/preferences.jsonl", f"{_VALIDATED}/preferences.json"),
    comment=("# ---- offline alignment, each from the SFT model ------------------------------------",)))

register(_train(
    "dpo", "direct preference optimisation (DPO, IPO, cDPO) on preference pairs", "DPOConfig", guarded=True,
    reads=(Read("train_file", "preferences", "preference"),),
    deps=("models/sft", f"{_EMBEDDED}/preferences.jsonl", f"{_EMBEDDED}/eval.jsonl", f"{_VALIDATED}/preferences.json")))

register(_train(
    "kto", "Kahneman-Tversky optimisation on unpaired desirable/undesirable examples", "KTOConfig", guarded=True,
    reads=(Read("train_file", "preferences", "unpaired"),),
    deps=("models/sft", f"{_EMBEDDED}/preferences.jsonl", f"{_EMBEDDED}/eval.jsonl", f"{_VALIDATED}/preferences.json")))

register(Stage(
    "rejection", "best-of-n sampling scored by a reward model or the rule", "rejection", f"{_CONFIG}:RejectionConfig",
    f"{_WRAPPERS}:rejection", command=TRAIN, reads=(Read("prompts_file", "prompts", "prompts"),),
    gates=(("kept", "sft"), ("pairs", "preference")), writes=("output_file", "writes it"), in_chain=True,
    task="sample-best-of-n",
    dvc=(DvcStage("rejection", "alignflow rejection --metrics-file metrics/rejection.json",
                  deps=("models/sft", "models/reward", f"{_EMBEDDED}/prompts.jsonl", f"{_VALIDATED}/prompts.json"),
                  params=("rejection",), outs=("data/rejection/best.jsonl", "data/rejection/pairs.jsonl"),
                  metrics=("metrics/rejection.json",)),
         DvcStage("validate_rejection", "alignflow validate --kind ${item.kind} data/rejection/${item.file} "
                                        "--report reports/validation/rejection_${key}.json",
                  deps=("data/rejection/${item.file}",), outs=(f"{_VALIDATED}/rejection_${{key}}.json",),
                  cache_outs=False, foreach=(("kept", {"file": "best.jsonl", "kind": "sft"}),
                                             ("pairs", {"file": "pairs.jsonl", "kind": "preference"}))),
         _real("rejection", ("models/real_rl", f"{_REAL}/prompts.jsonl", f"{_VALIDATED}/real_prompts.json"),
               outs=(f"{_REAL}/rejection/best.jsonl", f"{_REAL}/rejection/pairs.jsonl")))))

register(_train(
    "raft", "SFT of the policy on its kept best-of-n samples (one RAFT round)", "RaftConfig", guarded=True, reads=(),
    deps=("models/sft", "data/rejection/best.jsonl", f"{_EMBEDDED}/eval.jsonl", f"{_VALIDATED}/rejection_kept.json"),
    more_dvc=(_real("raft", ("models/real_rl", f"{_REAL}/rejection/best.jsonl", f"{_REAL}/eval.jsonl")),)))

register(_train(
    "distill", "token-level knowledge distillation from a teacher model", "DistillConfig", guarded=True,
    task="distill-teacher", reads=(Read("train_file", "sft", "sft"),),
    deps=("models/sft", "models/dpo", f"{_EMBEDDED}/sft.jsonl", f"{_EMBEDDED}/eval.jsonl")))

register(_train(
    "rl", "online RL from the policy's samples: PPO, REINFORCE++, RLOO, GRPO, Dr.GRPO (DAPO options)", "RLConfig",
    guarded=True, reads=(Read("prompts_file", "prompts", "prompts"),),
    deps=("models/sft", f"{_EMBEDDED}/prompts.jsonl", f"{_EMBEDDED}/eval.jsonl", f"{_VALIDATED}/prompts.json"),
    more_dvc=(DvcStage("tool_rl", "alignflow rl --section tool_rl --metrics-file metrics/tool_rl.json",
                       deps=("models/tool_sft", "data/tool/prompts.jsonl", "data/tool/eval.jsonl"), params=("tool_rl",),
                       outs=("models/tool_rl",), metrics=("metrics/tool_rl.json",), in_template=False),
              _real("rl", ("models/real_sft", f"{_REAL}/prompts.jsonl", f"{_REAL}/eval.jsonl",
                           f"{_VALIDATED}/real_prompts.json")))))

register(Stage(
    "tool-evaluate", "exact-match accuracy of a tool task model", "tool_evaluate", f"{_CONFIG}:ToolEvalConfig",
    "rlhf_core.rollout.tool_task:main", command=NONE,
    dvc=(DvcStage("tool_evaluate", f"{_TOOL_TASK} evaluate --model ${{item}} --out metrics/tool_eval_${{key}}.json",
                  deps=("${item}", "data/tool/eval.jsonl"), params=("tool_evaluate",),
                  metrics=("metrics/tool_eval_${key}.json",),
                  foreach=(("sft", "models/tool_sft"), ("rl", "models/tool_rl")), in_template=False),)))


register(Stage(
    "import-model", "import a pretrained model from a package's GGUF file (or a local HF folder)", "import_model",
    f"{_CONFIG}:ImportModelConfig", f"{_WRAPPERS}:import_model", writes=("out_dir", "imports the model there"),
    dvc=(DvcStage("real_import", "alignflow import-model --section real_import", params=("real_import",),
                  outs=("models/real_base",), in_template=False, file=_REAL_DVC,
                  comment=(*_REAL_COMMENT, "# real_import depends on its params only: the sha256 there pins the "
                                           "file's content.")),)))

register(Stage(
    "gym-generate", "write a reasoning-gym task's datasets (the real-model extra)", "gym_generate",
    f"{_CONFIG}:GymGenerateConfig", f"{_WRAPPERS}:gym_generate", writes=("out_dir", "writes the task's datasets there"),
    dvc=(DvcStage("real_generate", "alignflow gym-generate --section real_generate", params=("real_generate",),
                  outs=tuple(f"{_REAL}/{name}" for name in _REAL_FILES), in_template=False, file=_REAL_DVC),
         DvcStage("real_validate", "alignflow validate --kind ${item.kind} data/real/${item.file} "
                                   "--report reports/validation/real_${key}.json",
                  deps=("data/real/${item.file}",), outs=(f"{_VALIDATED}/real_${{key}}.json",), cache_outs=False,
                  foreach=tuple((name.removesuffix(".jsonl"), {"file": name, "kind": kind})
                                for name, kind in _REAL_KINDS.items()), in_template=False, file=_REAL_DVC))))
