"""What a tool-task model does with the calculator: greedy multi-turn answers, each call checked.

For each held-out item: did the model call the tool, does the call copy the question's expression
exactly, does the answer after ``</result>`` copy the calculator's result, and is the answer right.
The diagnosis of issue 19 item 2 (bench/results/cpu/2026-11-27/tool_task_cpu.md) reads these counts.

Run: ``PYTHONPATH=. python bench/tool_call_audit.py models/tool_sft [models/tool_rl ...]``
"""

from __future__ import annotations

import json
import sys

import torch


def audit(model_dir: str, eval_file: str = "data/tool/eval.jsonl", max_items: int = 500) -> dict[str, float]:
    from rlhf_core.data.formats import prompt_text, read_prompt_examples
    from rlhf_core.data.io import read_records
    from rlhf_core.rollout.environments import rollout_with_environment
    from rlhf_core.models.loading import load_causal_lm, load_tokenizer
    from rlhf_core.rollout.engine import HFGenerateEngine, SamplingParams
    from rlhf_core.rollout.tool_task import CALL_CLOSE, CALL_OPEN, RESULT_CLOSE, RESULT_OPEN, final_answer, make_env

    model, tokenizer = load_causal_lm(model_dir, torch.device("cpu")), load_tokenizer(model_dir)
    examples = read_prompt_examples(read_records(eval_file, limit=max_items), eval_file)
    prompts = [prompt_text(tokenizer, e.prompt) for e in examples]
    labels = [str(e.label) for e in examples]
    batch, _ = rollout_with_environment(HFGenerateEngine(model, tokenizer, batch_size=256), tokenizer, prompts, labels,
                                        SamplingParams(n=1, temperature=0.0, max_new_tokens=16), make_env,
                                        max_turns=2, max_trajectory_tokens=32)
    n = len(prompts)
    calls = copied_expr = copied_result = right_with_call = right_without_call = 0
    for prompt, completion, label in zip(prompts, batch.completions, labels, strict=True):
        right = final_answer(completion) == label
        if CALL_OPEN not in completion:
            right_without_call += right
            continue
        calls += 1
        expr = completion.split(CALL_OPEN, 1)[1].split(CALL_CLOSE, 1)[0]
        copied_expr += expr == prompt[:-1]
        result = completion.split(RESULT_OPEN, 1)[-1].split(RESULT_CLOSE, 1)[0]
        copied_result += final_answer(completion) == result
        right_with_call += right
    return {"model": model_dir, "items": n, "calls": calls, "calls_copying_expression": copied_expr,
            "answers_copying_result": copied_result, "right_with_call": right_with_call,
            "right_without_call": right_without_call, "no_call": n - calls}


if __name__ == "__main__":
    torch.set_num_threads(1)
    for path in sys.argv[1:]:
        print(json.dumps(audit(path)))
