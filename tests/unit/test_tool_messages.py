"""Tool turns as chat-template ``tool`` messages (``rl.environment.tool_messages``), without a model: the text a
template puts
between an assistant turn's end and the next assistant turn, the mode's resolution and checks, and the rollout's
bookkeeping with a scripted engine.

The tiny-model test (prompt + trajectory decode to the template's rendering of the conversation) is in
tests/model/test_tool_chat_rollout.py.
"""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
import torch

from rlhf_core.config import ConfigError, RLConfig, build_config
from rlhf_core.data.formats import PromptExample
from rlhf_core.data.io import DataError
from rlhf_core.rollout.environments import (OBSERVATION, StepResult, rollout_with_environment, tool_conversations,
                                    tool_turn_text)
from rlhf_core.models.loading import load_tokenizer
from rlhf_core.rollout.engine import SamplingParams

# Every message "[role]content", an assistant turn closed by eos, each message followed by a newline.
BRACKETS = ("{% for m in messages %}[{{ m['role'] }}]{{ m['content'] }}"
            "{% if m['role'] == 'assistant' %}{{ eos_token }}{% endif %}{{ '\n' }}{% endfor %}"
            "{% if add_generation_prompt %}[assistant]{% endif %}")
# The same, except that only the conversation's last assistant turn is closed by eos; earlier ones by "<sep>".
LAST_ONLY = BRACKETS.replace("{% if m['role'] == 'assistant' %}{{ eos_token }}{% endif %}",
                             "{% if m['role'] == 'assistant' %}{% if loop.last %}{{ eos_token }}{% else %}<sep>"
                             "{% endif %}{% endif %}")
USER = [{"role": "user", "content": "2+2="}]


@pytest.fixture()
def tok(micro_model):
    """The micro tokenizer (eos ``<|endoftext|>``) with ``</calc>`` as one token and the bracket template."""
    tokenizer = load_tokenizer(micro_model)
    tokenizer.add_tokens(["</calc>"])
    tokenizer.chat_template = BRACKETS
    return tokenizer


def test_tool_turn_text_is_what_the_template_writes_after_the_eos(tok):
    """head = "[user]2+2=\\n[assistant]"; the assistant turn renders head + "<calc>2+2</calc>" + eos + "\\n";
    with the tool message and the generation prompt that is followed by "[tool]4\\n[assistant]". Cut after the
    eos, the observation is "\\n[tool]4\\n[assistant]": the newline the template writes after the eos is the
    tool turn's, since generation stops at the eos."""
    assert tool_turn_text(tok, USER, "<calc>2+2</calc>", "4") == "\n[tool]4\n[assistant]"
    # an eos-like text inside the turn's content does not move the cut: the turn's own eos is the last one
    assert tool_turn_text(tok, USER, f"a{tok.eos_token}b", "") == "\n[tool]\n[assistant]"


def test_a_template_that_is_not_prefix_stable_is_a_clear_error(tok):
    """LAST_ONLY closes an assistant turn with eos only while it is the last message: a tool message after it
    turns that eos into "<sep>", so the trajectory cannot be what the template renders."""
    tok.chat_template = LAST_ONLY
    with pytest.raises(ValueError, match="not prefix-stable: a tool message after an assistant turn changes"):
        tool_turn_text(tok, USER, "<calc>2+2</calc>", "4")
    tok.chat_template = BRACKETS.replace("{{ eos_token }}", "<end>")
    with pytest.raises(ValueError, match="does not end with the tokenizer's eos token"):
        tool_turn_text(tok, USER, "x", "4")


def test_auto_is_chat_only_for_conversations_with_a_template_of_the_tokenizer_s_own(tok, micro_model, caplog):
    chats = [PromptExample(USER, "4", 1), PromptExample([{"role": "user", "content": "3+4="}], "7", 2)]
    assert tool_conversations("auto", tok, chats, "p.jsonl") == [USER, [{"role": "user", "content": "3+4="}]]
    mixed = [chats[0], PromptExample("3+4=", "7", 2)]
    assert tool_conversations("auto", tok, mixed, "p.jsonl") is None
    assert tool_conversations("text", tok, chats, "p.jsonl") is None
    plain = load_tokenizer(micro_model)  # no template of its own: load_tokenizer gave it the plain one
    assert tool_conversations("auto", plain, chats, "p.jsonl") is None
    assert tool_conversations("chat", plain, chats, "p.jsonl") is not None  # the plain template renders tools
    with pytest.raises(DataError, match=r"p.jsonl:2: field 'prompt': is text, and tool_messages chat"):
        tool_conversations("chat", tok, mixed, "p.jsonl")
    tok.chat_template = LAST_ONLY  # checked at load, before any rollout: chat fails, auto falls back to text
    with pytest.raises(ValueError, match="tool_messages chat: chat template is not prefix-stable"):
        tool_conversations("chat", tok, chats, "p.jsonl")
    with caplog.at_level(logging.WARNING, logger="rlhf_core.rollout.environments"):
        assert tool_conversations("auto", tok, chats, "p.jsonl") is None
    assert "observations appended as text" in caplog.text and "not prefix-stable" in caplog.text


def test_config_names_the_field():
    with pytest.raises(ConfigError, match=r"rl.environment.tool_messages: must be one of \['auto', 'text', 'chat'\]"):
        build_config(RLConfig, "rl", {"environment.spec": "env.py:make_env", "environment.tool_messages": "tool"})
    with pytest.raises(ConfigError, match="rl.environment.tool_messages: is only used with an environment"):
        build_config(RLConfig, "rl", {"environment.tool_messages": "chat"})
    assert build_config(RLConfig, "rl", {"environment.spec": "env.py:make_env",
                                         "environment.tool_messages": "chat"}).environment.tool_messages == "chat"


class _Scripted:
    """An engine whose turn ``k`` answers every row with ``turns[k]`` (token ids), log-prob -1 per token."""

    def __init__(self, turns: list[list[int]]):
        self.turns, self.calls = turns, 0

    def generate_ids(self, contexts, params):
        ids = torch.tensor([self.turns[self.calls]] * len(contexts))
        self.calls += 1
        return SimpleNamespace(response_ids=ids, response_mask=torch.ones_like(ids),
                               sampling_logprobs=-torch.ones(ids.shape))


class _Calculator:
    """Answers "4" to a turn holding a call, ends the episode at a turn without one (a final answer)."""

    stop_tokens = ("</calc>",)

    def reset(self, prompt, label):
        self.actions = []

    def step(self, action):
        self.actions.append(action)
        return StepResult("4") if "calc" in action else StepResult(done=True, reward=0.5)


def test_chat_rollout_closes_turns_renders_tool_messages_and_ends_at_a_final_answer(tok):
    """Turn 1 stops at ``</calc>``: the template closes the turn, so the observation is eos + "\\n[tool]4\\n
    [assistant]". Turn 2 calls again and ends at eos itself: its observation starts after that eos. Turn 3 ends
    at eos with no call: the environment ends the episode (reward 0.5), and that final answer is no tool call.
    Text mode on the same turns: the eos of turn 2 ends the episode after one observation "4"."""
    def enc(text: str) -> list[int]:
        return tok.encode(text, add_special_tokens=False)

    eos = tok.eos_token_id
    turns = [enc("<calc>2+2</calc>"), enc("<calc>4") + [eos], enc("4") + [eos]]
    prompt = tok.apply_chat_template(USER, tokenize=False, add_generation_prompt=True)
    kw = dict(max_turns=4, max_trajectory_tokens=200)
    params = SamplingParams(n=1, temperature=1.0, max_new_tokens=20)
    batch, rewards = rollout_with_environment(_Scripted(turns), tok, [prompt], ["4"], params, _Calculator,
                                              conversations=[USER], **kw)
    ids = batch.response_ids[0].tolist()
    obs = enc("\n[tool]4\n[assistant]")
    assert ids == turns[0] + [eos] + obs + turns[1] + obs + turns[2]
    assert batch.action_mask[0].tolist() == ([1] * len(turns[0]) + [OBSERVATION] * (1 + len(obs)) + [1] * len(turns[1])
                                             + [OBSERVATION] * len(obs) + [1] * len(turns[2]))
    assert batch.sampling_logprobs[0].tolist() == [-float(a) for a in batch.action_mask[0].tolist()]
    assert batch.tool_calls.tolist() == [2] and rewards.tolist() == [0.5]
    conversation = USER + [{"role": "assistant", "content": "<calc>2+2</calc>"}, {"role": "tool", "content": "4"},
                           {"role": "assistant", "content": "<calc>4"}, {"role": "tool", "content": "4"},
                           {"role": "assistant", "content": "4"}]
    rendered = tok.apply_chat_template(conversation, tokenize=False)
    assert rendered == tok.decode(enc(prompt) + ids, skip_special_tokens=False) + "\n"

    text, _ = rollout_with_environment(_Scripted(turns), tok, [prompt], ["4"], params, _Calculator, **kw)
    assert text.response_ids[0].tolist() == turns[0] + enc("4") + turns[1] and text.tool_calls.tolist() == [1]
