"""Chat-mode multi-turn rollouts on a micro model with a Qwen2.5-style template (``rl.environment.tool_messages:
chat``): the
prompt and the trajectory decode to exactly what the chat template renders for the conversation (user, assistant
turn, tool message, assistant turn, ...), sampled tokens kept as sampled; observation tokens are masked.

The micro model is nudged, as in tests/model/test_tool_rollout.py, so that a turn often ends at once at
``</calc>`` or at the end-of-turn eos ``<|im_end|>``; the environment answers every turn. Text mode's
trajectories are checked there; here only that the same model in text mode appends the bare observation.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import MICRO_MODEL

from rlhf_core.rollout.environments import OBSERVATION, StepResult, rollout_with_environment, tool_conversations
from rlhf_core.models.loading import load_causal_lm, load_tokenizer
from rlhf_core.rollout.engine import HFGenerateEngine, SamplingParams
from rlhf_core.rollout.tool_task import TAGS

# Qwen2.5's template without tools in the system prompt: consecutive tool replies share one user turn, each
# wrapped in <tool_response> tags.
QWEN_TEMPLATE = (
    "{% for m in messages %}"
    "{% if m['role'] == 'tool' %}"
    "{% if loop.first or messages[loop.index0 - 1]['role'] != 'tool' %}<|im_start|>user{% endif %}"
    "{{ '\\n<tool_response>\\n' }}{{ m['content'] }}{{ '\\n</tool_response>' }}"
    "{% if loop.last or messages[loop.index0 + 1]['role'] != 'tool' %}<|im_end|>{{ '\\n' }}{% endif %}"
    "{% else %}<|im_start|>{{ m['role'] }}{{ '\\n' }}{{ m['content'] }}<|im_end|>{{ '\\n' }}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant{{ '\\n' }}{% endif %}"
)
CHATS = [[{"role": "system", "content": "Use the calculator."}, {"role": "user", "content": "12+3="}],
         [{"role": "user", "content": "4*5="}]]
OBS = "7"


class _Echo:
    """Answers every model turn with the tool reply ``7``."""

    stop_tokens = ("</calc>",)

    def reset(self, prompt, label):
        pass

    def step(self, action):
        return StepResult(OBS)


@pytest.fixture(scope="module")
def chat_tool_model(tmp_path_factory, micro_tokenizer) -> Path:
    """A micro Qwen2 whose tokenizer has ChatML markers (eos ``<|im_end|>``), the tool tags and QWEN_TEMPLATE;
    ``</calc>`` and eos each lead every other logit (every embedding 4.0 in dimension 0, theirs 4.8)."""
    from transformers import AutoTokenizer

    from rlhf_core.embedded.tiny_model import build_tiny_model

    tok = AutoTokenizer.from_pretrained(str(micro_tokenizer))
    tok.add_special_tokens({"eos_token": "<|im_end|>", "extra_special_tokens": ["<|im_start|>"]},
                           replace_extra_special_tokens=False)
    tok_dir = tmp_path_factory.mktemp("tok") / "chatml"
    tok.save_pretrained(str(tok_dir))
    out = build_tiny_model(tok_dir, tmp_path_factory.mktemp("chat-tool") / "model", added_tokens=TAGS,
                           chat_template=QWEN_TEMPLATE, **{**MICRO_MODEL, "max_positions": 256})
    model, tokenizer = load_causal_lm(out), load_tokenizer(out)
    with torch.no_grad():
        emb = model.get_input_embeddings().weight
        emb[:, 0] = 4.0
        emb[[tokenizer.convert_tokens_to_ids("</calc>"), tokenizer.eos_token_id], 0] = 4.8
    model.save_pretrained(str(out), safe_serialization=True)
    return out


def _turns(ids: list[int], actions: list[int]) -> list[tuple[int, list[int]]]:
    """The response cut into (action, ids) runs, in order."""
    runs: list[tuple[int, list[int]]] = []
    for tok, a in zip(ids, actions):
        if runs and runs[-1][0] == a:
            runs[-1][1].append(tok)
        else:
            runs.append((a, [tok]))
    return runs


def test_chat_trajectories_decode_to_the_template_s_rendering_of_the_conversation(chat_tool_model):
    """For every trajectory: rebuild the conversation from the policy's runs (each an assistant turn, its content
    the sampled text without the closing eos) and the tool replies between them; the decoded prompt + trajectory
    is the template's rendering of the conversation up to the last turn's generation prompt, then the last turn
    as sampled. Observation tokens have action mask 0 and log-prob 0. Text mode appends the bare ``7``."""
    model, tokenizer = load_causal_lm(chat_tool_model), load_tokenizer(chat_tool_model)
    from rlhf_core.data.formats import PromptExample, prompt_text

    conversations = tool_conversations("auto", tokenizer, [PromptExample(c, None, i + 1) for i, c in
                                                           enumerate(CHATS)], "prompts.jsonl")
    assert conversations == CHATS  # auto: conversations and a template of the tokenizer's own
    prompts = [prompt_text(tokenizer, c) for c in CHATS]
    eos, stop = tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids("</calc>")
    params = SamplingParams(n=4, temperature=1.0, max_new_tokens=6, seed=3)
    batch, _ = rollout_with_environment(HFGenerateEngine(model, tokenizer), tokenizer, prompts, [None, None], params,
                                        lambda: _Echo(), max_turns=3, max_trajectory_tokens=160,
                                        conversations=conversations)
    ended = {"eos": 0, "stop": 0}
    for i in range(len(batch)):
        k = int(batch.response_mask[i].sum())
        ids, actions = batch.response_ids[i, :k].tolist(), batch.action_mask[i, :k].tolist()
        runs = _turns(ids, actions)
        messages = list(CHATS[i // 4])
        for (action, turn), nxt in zip(runs, runs[1:] + [(None, [])]):
            if action == OBSERVATION:
                continue
            closed = turn[-1] == eos
            if nxt[0] == OBSERVATION:
                ended["eos" if closed else "stop"] += 1
                assert closed or (turn[-1] == stop and nxt[1][0] == eos)  # a call's turn closed by the environment
            messages.append({"role": "assistant",
                             "content": tokenizer.decode(turn[:-1] if closed else turn, skip_special_tokens=False)})
            messages.append({"role": "tool", "content": OBS})
        messages.pop()  # no reply after the last turn
        last = runs[-1][1]
        assert runs[-1][0] == 1 and len(runs) == 2 * batch.tool_calls[i] + 1
        head = tokenizer.apply_chat_template(messages[:-1], tokenize=False, add_generation_prompt=True)
        prompt_ids = batch.prompt_ids[i][batch.prompt_mask[i].bool()].tolist()
        decoded = tokenizer.decode(prompt_ids + ids, skip_special_tokens=False)
        assert decoded == head + tokenizer.decode(last, skip_special_tokens=False)
        if last[-1] == eos:  # a finished last turn: the template's own rendering, up to its closing newline
            assert tokenizer.apply_chat_template(messages, tokenize=False) == decoded + "\n"
    assert ended["eos"] and ended["stop"]  # both ways a turn ends were followed by a tool message
    observation = (batch.response_mask * (1 - batch.action_mask)).bool()
    assert observation.any() and not batch.sampling_logprobs[observation].any()
    assert (batch.sampling_logprobs[batch.action_mask.bool()] < 0).all()

    text, _ = rollout_with_environment(HFGenerateEngine(model, tokenizer), tokenizer, prompts, [None, None], params,
                                       lambda: _Echo(), max_turns=3, max_trajectory_tokens=160)
    obs = tokenizer.encode(OBS, add_special_tokens=False)
    for i in range(len(text)):
        k = int(text.response_mask[i].sum())
        runs = _turns(text.response_ids[i, :k].tolist(), text.action_mask[i, :k].tolist())
        assert all(turn == obs for a, turn in runs if a == OBSERVATION)
        assert all(turn[-1] == stop for a, turn in runs[:-1] if a == 1)  # eos ended the episode


def test_trainer_renders_tool_messages_for_conversation_prompts(chat_tool_model, tmp_path):
    """rl.environment.tool_messages auto on a conversations file and a tokenizer with its own template: the trainer's
    rollouts
    and its greedy multi-turn eval hold the template's tool messages, masked; text prompts with chat fail at load,
    naming the file, line and field."""
    import dataclasses
    import json

    from conftest import Recorder

    from rlhf_core.config import RLConfig, build_config
    from rlhf_core.data.io import DataError
    from rlhf_core.trainers.rl import RLTrainer, PhaseTimes
    from rlhf_core.trainers.rl_parts import read_prompts

    env = tmp_path / "env.py"
    env.write_text("from rlhf_core.rollout.environments import StepResult\n\nclass Env:\n    stop_tokens = ('</calc>',)\n"
                   "    def reset(self, prompt, label):\n        pass\n"
                   f"    def step(self, action):\n        return StepResult({OBS!r})\n\n"
                   "def make_env():\n    return Env()\n")
    chats = tmp_path / "chats.jsonl"
    chats.write_text("".join(json.dumps({"prompt": c, "label": "15"}) + "\n" for c in CHATS * 2))
    cfg = build_config(RLConfig, "rl", {"model_path": str(chat_tool_model), "prompts_file": str(chats),
                                        "eval_file": str(chats), "output_dir": str(tmp_path / "rl"),
                                        "checkpoint_dir": str(tmp_path / "ckpt"),
                                        "reward.function": "rlhf_core/rollout/tool_task.py:reward",
                                        "environment.spec": f"{env}:make_env", "environment.max_turns": 2,
                                        "environment.max_trajectory_tokens": 80, "rollout.max_new_tokens": 6,
                                        "max_length": 160, "rollout.prompts_per_step": 2, "rollout.group_size": 2,
                                        "batch_size": 16, "algorithm.mini_batch_size": 4, "eval_items": 4,
                                        "eval_at_start": False, "num_threads": 1, "rollout.engine": "hf"})
    trainer = RLTrainer(cfg, Recorder())
    assert trainer.conversations == CHATS * 2
    batch = trainer.generate(1, PhaseTimes()).batch
    observation = (batch.response_mask * (1 - batch.action_mask)).bool()
    tool_text = trainer.tokenizer.decode(batch.response_ids[observation], skip_special_tokens=False)
    assert f"<|im_start|>user\n<tool_response>\n{OBS}\n</tool_response><|im_end|>" in tool_text
    assert tool_text.endswith("<|im_start|>assistant\n")
    metrics, samples = trainer.evaluate(1)[:2]
    assert any("<tool_response>" in s["text"] for s in samples) and metrics["eval/tool_call_rate"] > 0

    text = tmp_path / "text.jsonl"
    text.write_text(json.dumps({"prompt": "12+3=", "label": "15"}) + "\n")
    with pytest.raises(DataError, match=r"text.jsonl:1: field 'prompt': is text, and tool_messages chat"):
        read_prompts(dataclasses.replace(cfg, prompts_file=str(text),
                                         environment=dataclasses.replace(cfg.environment, tool_messages="chat")),
                     trainer.tokenizer)


def test_the_guard_probe_renders_tool_messages_as_the_stage_eval_does(chat_tool_model, tmp_path):
    """The guards' multi-turn probe on a conversations eval file, tool_messages auto: its trajectories hold the
    template's tool messages and are the greedy multi-turn eval's (same engine, batch and limits); with the
    default, text, they hold the bare observation instead."""
    import json

    from rlhf_core.rollout.environments import evaluate_with_environment
    from rlhf_core.promotion.probe import ProbeEnvironment, probe_with_environment, read_eval_items

    chats = tmp_path / "chats.jsonl"
    chats.write_text("".join(json.dumps({"prompt": c, "label": "15"}) + "\n" for c in CHATS * 2))
    model, tokenizer = load_causal_lm(chat_tool_model), load_tokenizer(chat_tool_model)
    items = read_eval_items(chats, tokenizer, prompt_field="prompt", label_field="label", slice_field="slice",
                            max_items=4)
    limits = dict(max_turns=2, max_trajectory_tokens=80, max_new_tokens=6)
    reward = lambda prompts, completions, labels: [0.0] * len(prompts)  # noqa: E731
    _, answers = probe_with_environment(model, tokenizer, items, ProbeEnvironment(lambda: _Echo(), {}, **limits,
                                                                                  tool_messages="auto"),
                                        reward_fn=reward)
    _, rows = evaluate_with_environment(model, tokenizer, str(chats), lambda: _Echo(), reward, max_items=4,
                                        tool_messages="auto", **limits)
    # the same greedy trajectories: each eval row's text (special tokens kept) holds its probe answer's words
    assert any(f"<tool_response>\n{OBS}\n</tool_response>" in a for a in answers)
    for row, answer in zip(rows, answers, strict=False):
        assert tokenizer.decode(tokenizer.encode(row["text"], add_special_tokens=False),
                                skip_special_tokens=True) == answer
    _, plain = probe_with_environment(model, tokenizer, items, ProbeEnvironment(lambda: _Echo(), {}, **limits),
                                      reward_fn=reward)
    assert not any("<tool_response>" in a for a in plain)
