"""The embedded tool task: the arithmetic skill of :mod:`rlhf_core.embedded.tasks` with a calculator tool.

Beside the embedded default, not instead of it: its own datasets (``data/tool/``), model
(``models/tool_base`` → ``tool_sft`` → ``tool_rl``) and DVC stages (``tool_*`` in ``dvc.yaml``,
parameters under ``tool_*`` in ``params.yaml``). The format is short in tokens, because the
tiny model must learn it::

    47*8=<calc>47*8</calc><result>376</result>376<eos>
         `--- policy ---'`--- observation --'`policy'

The policy writes a tool call ``<calc>EXPR</calc>``; its turn ends at ``</calc>`` (a stop
token), the :class:`CalculatorEnv` evaluates ``EXPR`` and the observation ``<result>V</result>``
is appended (masked from the loss and the advantages); the policy then writes the answer and eos.
The four tags are single tokens of the task's tokenizer (``tool_model.added_tokens``).

SFT demonstrations come from a flawed demonstrator: with probability ``skip_tool`` it skips the
tool and guesses (a plausible wrong answer with probability ``guess_noise``, as
:func:`rlhf_core.embedded.tasks.wrong_answer` makes them). A tiny model cannot do the arithmetic in its
head (0.02-0.09 accuracy without the tool), so the demonstrations that use the tool are the ones
worth imitating, and only a reward tells it which: RL with the rule reward should raise both the
tool-call rate and the accuracy over SFT alone.

Run: ``python -m rlhf_core.rollout.tool_task generate`` (params section ``tool_generate``) and
``python -m rlhf_core.rollout.tool_task evaluate --model models/tool_sft --out metrics/tool_eval_sft.json``
(section ``tool_evaluate``); the model and trainers are the ordinary stages, ``alignflow init-model
--section tool_model``, ``alignflow sft --section tool_sft``, ``alignflow rl --section tool_rl``.
"""

from __future__ import annotations

import argparse
import json
import random
import re
import sys
from pathlib import Path
from typing import Any, Sequence

from rlhf_core.common.atomic_io import write_text_atomic
from rlhf_core.config import ToolEvalConfig, ToolGenerateConfig, load_config
from rlhf_core.embedded.tasks import (
    Problem,
    ProblemSpace,
    normalize_completion,
    sample_problems,
    write_jsonl,
    wrong_answer,
)

CALL_OPEN, CALL_CLOSE = "<calc>", "</calc>"
RESULT_OPEN, RESULT_CLOSE = "<result>", "</result>"
TAGS = (CALL_OPEN, CALL_CLOSE, RESULT_OPEN, RESULT_CLOSE)
_EXPR_RE = re.compile(r"^\s*(-?\d{1,6})\s*([+\-*])\s*(-?\d{1,6})\s*$")


def tool_completion(problem: Problem) -> str:
    """The demonstration that uses the calculator: call, observation, answer."""
    return f"{CALL_OPEN}{problem.prompt[:-1]}{CALL_CLOSE}{RESULT_OPEN}{problem.answer}{RESULT_CLOSE}{problem.answer}"


def final_answer(completion: str) -> str:
    """The answer of a trajectory: the text after its last observation (all of it where there is none)."""
    tail = completion.rsplit(RESULT_CLOSE, 1)[-1]
    return normalize_completion(tail)


def reward(prompts: Sequence[str], completions: Sequence[str], labels: Sequence[str | None]) -> list[float]:
    """Rule reward of a tool trajectory (``rl.reward.function: rlhf_core/rollout/tool_task.py:reward``): 1.0 where the
    answer after the last ``</result>`` is exactly the label, else 0.0. Calling the tool earns nothing by itself; it
    pays only through the answer."""
    del prompts
    missing = [i for i, y in enumerate(labels) if y is None]
    if missing:
        raise ValueError(f"sample {missing[0]} has no label; the tool task's rule reward compares against it")
    return [1.0 if final_answer(c) == str(y).strip() else 0.0 for c, y in zip(completions, labels, strict=True)]


class CalculatorEnv:
    """A calculator for ``a op b`` (``op`` in ``+ - *``): ``<calc>47*8</calc>`` → ``<result>376</result>``.

    An expression it cannot read gets ``<result>error</result>``; the episode ends at the policy's eos
    (or at the rollout's turn/token limits), and the environment gives no reward of its own.
    """

    stop_tokens = (CALL_CLOSE,)

    def reset(self, prompt: str, label: str | None) -> None:
        del prompt, label

    def step(self, action: str) -> Any:
        from rlhf_core.rollout.environments import StepResult  # lazy: torch (the generate command needs no model)

        call = action.rsplit(CALL_OPEN, 1)[-1].removesuffix(CALL_CLOSE)
        match = _EXPR_RE.match(call)
        if match is None:
            return StepResult(f"{RESULT_OPEN}error{RESULT_CLOSE}")
        value = Problem(int(match.group(1)), match.group(2), int(match.group(3))).answer
        return StepResult(f"{RESULT_OPEN}{value}{RESULT_CLOSE}")


def make_env() -> CalculatorEnv:
    """``rl.environment.spec: rlhf_core/rollout/tool_task.py:make_env``."""
    return CalculatorEnv()


# --------------------------------------------------------------------------------------
# Datasets
# --------------------------------------------------------------------------------------


def generate_tool_datasets(cfg: ToolGenerateConfig) -> dict[str, Path]:
    """Write ``sft.jsonl`` (prompt/completion), ``prompts.jsonl`` and ``eval.jsonl`` (prompt/label), disjoint by
    problem; deterministic in ``cfg.seed``."""
    rng = random.Random(cfg.seed)
    space = ProblemSpace(sort_fraction=0.0, ops=cfg.ops, max_add=cfg.max_add, max_mul_left=cfg.max_mul_left,
                         max_mul_right=cfg.max_mul_right)
    taken: set[Any] = set()
    eval_set = sample_problems(cfg.n_eval, rng, space, taken)  # first: independent of the training sizes
    sft = sample_problems(cfg.n_sft, rng, space, taken)
    prompts = sample_problems(cfg.n_prompts, rng, space, taken)

    def sft_row(p: Problem) -> dict:
        if rng.random() >= cfg.skip_tool:
            return {"prompt": p.prompt, "completion": tool_completion(p)}
        guess = wrong_answer(p, rng) if rng.random() < cfg.guess_noise else p.answer
        return {"prompt": p.prompt, "completion": str(guess)}

    def label_row(p: Problem) -> dict:
        return {"prompt": p.prompt, "label": str(p.answer)}

    out = Path(cfg.out_dir)
    return {"sft": write_jsonl((sft_row(p) for p in sft), out / "sft.jsonl"),
            "prompts": write_jsonl((label_row(p) for p in prompts), out / "prompts.jsonl"),
            "eval": write_jsonl((label_row(p) for p in eval_set), out / "eval.jsonl")}


# --------------------------------------------------------------------------------------
# Evaluation: greedy multi-turn answers with the calculator
# --------------------------------------------------------------------------------------


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m rlhf_core.rollout.tool_task", description=__doc__.split("\n\n")[0])
    parser.add_argument("command", choices=["generate", "evaluate"])
    parser.add_argument("--params", default="params.yaml")
    parser.add_argument("--model", help="evaluate: the model directory")
    parser.add_argument("--out", help="evaluate: the metrics JSON to write")
    args = parser.parse_args(argv)
    if args.command == "generate":
        paths = generate_tool_datasets(load_config(ToolGenerateConfig, "tool_generate", args.params))
        print(json.dumps({k: str(v) for k, v in paths.items()}, indent=2))
        return 0
    if not args.model or not args.out:
        parser.error("evaluate needs --model and --out")
    import torch  # lazy: torch (the generate command needs no model)

    from rlhf_core.rollout.environments import (  # lazy: torch (the generate command needs no model)
        evaluate_with_environment)
    from rlhf_core.models.loading import (  # lazy: torch (the generate command needs no model)
        load_causal_lm, load_tokenizer)

    cfg = load_config(ToolEvalConfig, "tool_evaluate", args.params)
    torch.set_num_threads(cfg.num_threads)
    model, tokenizer = load_causal_lm(args.model, torch.device("cpu")), load_tokenizer(args.model)
    metrics, _ = evaluate_with_environment(model, tokenizer, cfg.eval_file, make_env, reward, max_items=cfg.max_items,
                                           max_turns=cfg.max_turns, max_trajectory_tokens=cfg.max_trajectory_tokens,
                                           max_new_tokens=cfg.max_new_tokens)
    write_text_atomic(Path(args.out), json.dumps({k: round(v, 6) for k, v in metrics.items()}, indent=2,
                                                 sort_keys=True) + "\n")
    print(json.dumps(metrics, indent=2, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
