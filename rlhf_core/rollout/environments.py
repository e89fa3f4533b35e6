"""Multi-turn environments for RL: a tool the policy calls mid-answer, and the rollout loop that runs it.

An :class:`Environment` sees one trajectory: :meth:`~Environment.reset` with the prompt and label,
then :meth:`~Environment.step` with the text of each model turn that ends at one of the
environment's ``stop_tokens`` (a tool call's closing tag, e.g. ``</calc>``), or in chat mode at eos. A step
returns an observation (the tool's reply, e.g. ``<result>84</result>``), whether the episode is
over and an optional reward. :func:`rollout_with_environment` alternates engine turns and
environment steps:

* a trajectory's token ids are exactly the ids the engine sampled plus the observation ids the
  environment's text encodes to, appended; nothing is re-tokenised, so the learner scores the
  very tokens that were sampled;
* ``action_mask`` marks the policy's tokens (1) and the observation tokens (0): the loss, the
  KL and the advantages cover only the former (:meth:`rlhf_core.rollout.engine.RolloutBatch.loss_mask`;
  GAE and the returns skip interior masked tokens, :func:`rlhf_core.algorithms.advantages.gae`);
* ``max_turns`` bounds the model's turns and ``max_trajectory_tokens`` the response (turns and
  observations together); a trajectory that reaches either ends where it is.

How an observation joins the trajectory is ``rl.environment.tool_messages`` (:class:`ToolMessages`). ``text``: its
text's ids right after the turn, inside the model's turn, and a turn that ends at eos ends the episode (the embedded
tool task: text prompts, no chat template). ``chat``: a turn ends at eos as well as at a stop token and either
is a step (the environment parses a tool call from the turn's text and ends the episode, ``done``, where there
is none: a final answer); the observation is rendered by the model's chat template as a ``tool`` message
followed by the next assistant turn's generation prompt (:func:`tool_turn_text`; after the end-of-turn eos,
masked too, where the turn stopped at a stop token rather than eos), so prompt + trajectory decode
to what the template renders for the conversation (user..., assistant, tool, assistant...), sampled tokens kept
as sampled. ``auto`` (the default): chat where the prompts are conversations and the tokenizer has a chat
template of its own that renders tool turns (:func:`tool_conversations`), else text.

Each turn is one engine call from token ids (``generate_ids``: HF, our static-cache engine and vLLM
all have it), so the engines need nothing multi-turn of their own. Our engine prefills each turn
afresh (observations are written by the next prefill, never inside a captured CUDA graph); vLLM's
prefix cache reuses the earlier turns' KV blocks.

Environments come from a Python file, like reward functions (``rl.environment.spec:
path/to/env.py:make_env``, a zero-argument factory returning a fresh environment per trajectory),
or over HTTP (``rl.environment.spec: http://host/step``) with the reward server's timeouts, retries,
deadline and bearer-token handling (:class:`HttpEnvironment`).
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, replace
from typing import Any, Callable, Protocol, Sequence, runtime_checkable

import torch

from rlhf_core.common.redact import redact_secrets
from rlhf_core.data.chat import PLAIN_CHAT_TEMPLATE, render_chat
from rlhf_core.data.formats import is_conversational, prompt_text, read_prompt_examples
from rlhf_core.data.io import DataError, read_records
from rlhf_core.data.tokenize import encode_prompt
from rlhf_core.embedded.tasks import parse_prompt
from rlhf_core.rewards.sources import DEFAULT_MAX_RESPONSE_BYTES, HttpRewardSource, RewardError, load_function
from rlhf_core.rollout.engine import HFGenerateEngine, RolloutBatch, SamplingParams, _left_pad
from rlhf_core.common.shown import shown, shown_error
from rlhf_core.config.choices import ToolMessages  # re-exported: rl.environment.tool_messages's values, dispatched here
from rlhf_core.rollout.evaluate import accuracy_with_stderr

log = logging.getLogger(__name__)

# the value a trajectory's observation tokens carry in action_mask (the policy's own tokens: 1)
OBSERVATION = 0


class EnvironmentFailure(RewardError):
    """An environment failed (its file raised, its server is down, slow or replied with garbage).

    A :class:`rlhf_core.rewards.sources.RewardError`, so the CLI reports it the same way: a clear message,
    exit 1, and the run stops before anything is written."""


@dataclass(frozen=True)
class StepResult:
    """What an environment answers to one model turn."""

    observation: str = ""
    """Text appended to the trajectory as observation tokens (masked from the loss); empty: none."""
    done: bool = False
    """The episode is over: the trajectory ends after this turn (no observation is appended)."""
    reward: float | None = None
    """Added to the reward source's score of the trajectory; ``None``: the reward source alone scores it."""


@runtime_checkable
class Environment(Protocol):
    """One trajectory's environment (a fresh one per trajectory)."""

    @property
    def stop_tokens(self) -> Sequence[str]:
        """Tokens that end a model turn besides eos (each must be one token of the policy's tokenizer)."""
        ...

    def reset(self, prompt: str, label: str | None) -> None:
        """Start an episode on ``prompt`` (as the policy reads it) with its label (``None`` where none)."""
        ...

    def step(self, action: str) -> StepResult:
        """The reply to the model turn ``action`` (its decoded text, closing stop token included)."""
        ...


# --------------------------------------------------------------------------------------
# Environments from a file or over HTTP
# --------------------------------------------------------------------------------------


def _finite(value: int | float) -> bool:
    """Whether ``value`` is a finite float: an int past float's range (JSON integers have no bound) is not."""
    try:
        return math.isfinite(value)
    except OverflowError:
        return False


def _check_result(value: Any, where: str) -> StepResult:
    """``value`` (what ``where``'s step returned) as a :class:`StepResult`; an :class:`EnvironmentFailure` naming
    ``where`` and the value where it is none."""
    if isinstance(value, StepResult):
        result = value
    elif isinstance(value, dict) and set(value) <= {"observation", "done", "reward"}:
        result = StepResult(**value)
    else:
        raise EnvironmentFailure(redact_secrets(f"{where}: step returned {shown(value, 120)}; expected a StepResult "
                                               "or {observation: str, done: bool, reward: float | null}"))
    if not isinstance(result.observation, str) or not isinstance(result.done, bool):
        raise EnvironmentFailure(redact_secrets(f"{where}: step returned observation {shown(result.observation, 60)} "
                                               f"and done {shown(result.done, 40)}; expected a string and a boolean"))
    if result.reward is not None and (isinstance(result.reward, bool) or not isinstance(result.reward, (int, float))
                                      or not _finite(result.reward)):
        raise EnvironmentFailure(f"{where}: step returned reward {shown(result.reward, 40)}; expected a finite "
                                 "number or null")
    return result


class HttpEnvironment:
    """An environment served over HTTP: ``POST url`` with ``{"prompt", "label", "actions"}`` (every model turn so
    far, newest last) → ``{"observation": str, "done": bool, "reward": float | null}``.

    Stateless on the wire (each request carries the whole episode), so a retried request is safe. The transport
    is :class:`rlhf_core.rewards.sources.HttpRewardSource`'s: timeouts, connection errors and 5xx retried ``retries``
    times with full-jitter backoff, 429 honoured, ``timeout_s`` per request from connect to last byte,
    ``deadline_s`` per step, the body capped at ``max_response_bytes``, ``token_env`` sent as a bearer token,
    every message redacted; a malformed, non-finite or oversized reply or another 4xx fails at once with
    :class:`EnvironmentFailure`.
    """

    def __init__(self, transport: HttpRewardSource, stop_tokens: Sequence[str]):
        self.transport = transport  # shared by every trajectory's environment: one keep-alive connection
        self._stop_tokens = tuple(stop_tokens)
        self.prompt: str = ""
        self.label: str | None = None
        self.actions: list[str] = []

    @property
    def stop_tokens(self) -> Sequence[str]:
        return self._stop_tokens

    def reset(self, prompt: str, label: str | None) -> None:
        self.prompt, self.label, self.actions = prompt, label, []

    def step(self, action: str) -> StepResult:
        self.actions.append(action)
        where = f"environment server {redact_secrets(self.transport.url)}"
        body = {"prompt": self.prompt, "label": self.label, "actions": list(self.actions)}
        try:
            payload = self.transport.post_json(body, where)
        except RewardError as exc:  # the transport's message, as an environment error
            raise EnvironmentFailure(str(exc)) from None
        try:
            return _check_result(payload, where)
        except EnvironmentFailure as exc:  # a value it quotes is the server's choice: an echoed secret included
            raise EnvironmentFailure(redact_secrets(str(exc))) from None


def environment_factory(spec: str, *, stop_tokens: Sequence[str] = (), timeout_s: float = 30.0, retries: int = 3,
                        backoff_cap_s: float = 30.0, deadline_s: float = 300.0,
                        token_env: str = "", max_response_bytes: int | None = None) -> Callable[[], Environment]:
    """A factory of fresh environments from ``spec``: ``path/to/env.py:make_env`` (a zero-argument function
    returning an :class:`Environment`) or an ``http(s)://`` URL (:class:`HttpEnvironment`, whose turns end at
    ``stop_tokens``; ``None`` for ``max_response_bytes`` is the reward client's default cap)."""
    if spec.startswith(("http://", "https://")):
        if not stop_tokens:
            raise ValueError("rl.environment.stop_tokens: an HTTP environment needs the tokens that end a model "
                             "turn (e.g. ['</calc>'])")

        transport = HttpRewardSource(spec, timeout_s=timeout_s, retries=retries, backoff_cap_s=backoff_cap_s,
                                     deadline_s=deadline_s, token_env=token_env,
                                     max_response_bytes=DEFAULT_MAX_RESPONSE_BYTES if max_response_bytes is None
                                     else max_response_bytes)

        def make_http() -> Environment:
            return HttpEnvironment(transport, stop_tokens)

        return make_http
    _, _, make = load_function(spec)
    return make


# --------------------------------------------------------------------------------------
# Tool turns as chat-template messages
# --------------------------------------------------------------------------------------


def tool_turn_text(tokenizer: Any, history: Sequence[dict[str, Any]], assistant: str, observation: str) -> str:
    """What ``tokenizer``'s chat template writes after an assistant turn's end-of-turn token (its eos) when a
    ``tool`` message holding ``observation`` follows: the tool message and the next assistant turn's header.

    ``render(history + [assistant, tool], add_generation_prompt=True)`` minus ``render(history + [assistant])``
    up to and including its last eos text, so whatever the template writes after the eos (ChatML's newline) is
    part of it. ChatML (``<|im_start|>{role}\\n{content}<|im_end|>\\n`` per message, eos ``<|im_end|>``, generation
    prompt ``<|im_start|>assistant\\n``) and observation ``84`` give
    ``"\\n<|im_start|>tool\\n84<|im_end|>\\n<|im_start|>assistant\\n"``. Raises ValueError where the assistant
    turn holds no eos or the template is not prefix-stable (a later message re-renders an earlier one), and
    :class:`rlhf_core.data.chat.ChatTemplateError` (a ValueError) where rendering fails.
    """
    head = render_chat(tokenizer, list(history), True)
    turn = [*history, {"role": "assistant", "content": assistant}]
    upto = render_chat(tokenizer, turn, False)
    full = render_chat(tokenizer, [*turn, {"role": "tool", "content": observation}], True)
    eos = tokenizer.eos_token or ""
    if not upto.startswith(head):
        raise ValueError("chat template is not prefix-stable: the conversation rendered with its generation prompt "
                         "is not a prefix of it rendered with an assistant turn added")
    end = upto.rfind(eos) if eos else -1
    if end < len(head):
        raise ValueError(f"chat template: an assistant turn does not end with the tokenizer's eos token {eos!r}, so "
                         "a model turn cannot end where the template ends it (make the end-of-turn token the eos, "
                         "or use rl.environment.tool_messages: text)")
    cut = upto[:end + len(eos)]
    if not full.startswith(cut):
        raise ValueError("chat template is not prefix-stable: a tool message after an assistant turn changes how "
                         f"the turn renders ({cut[len(head):][-40:]!r} is not followed by the tool message)")
    return full[len(cut):]


def tool_conversations(mode: str, tokenizer: Any, examples: Sequence[Any], path: str,
                       prompt_field: str = "prompt") -> list[list[dict[str, Any]]] | None:
    """Each prompt's conversation, into which chat mode renders tool turns; ``None``: text mode.

    ``mode`` is a :class:`ToolMessages` value; ``auto`` is chat where every prompt of ``examples``
    (:class:`rlhf_core.data.formats.PromptExample` of ``path``) is a conversation and the tokenizer has a chat
    template of its own (the plain fallback template counts as none) that renders tool turns, else text. Chat
    is checked here, before any rollout, by rendering one tool turn after the first prompt
    (:func:`tool_turn_text`): an error for ``chat``; for ``auto``, text and a warning saying why.
    """
    chosen = ToolMessages(mode)
    text = next((e for e in examples if not is_conversational(e.prompt)), None)
    own = getattr(tokenizer, "chat_template", None)
    if chosen is ToolMessages.TEXT or (chosen is ToolMessages.AUTO and (
            text is not None or not examples or not own or own == PLAIN_CHAT_TEMPLATE)):
        return None
    if text is not None:
        raise DataError(path, text.line, "is text, and tool_messages chat renders tool turns into conversations "
                        "(a list of messages); give conversations or set tool_messages: text", prompt_field)
    conversations = [list(e.prompt) for e in examples]
    try:
        if conversations:
            tool_turn_text(tokenizer, conversations[0], "", "")
    except ValueError as exc:
        if chosen is ToolMessages.CHAT:
            raise ValueError(f"tool_messages chat: {exc}") from None
        # a template that worked with text observations keeps working: auto never turns a run into an error
        log.warning("tool_messages auto: observations appended as text, not as chat-template tool messages: %s", exc)
        return None
    return conversations


# --------------------------------------------------------------------------------------
# The multi-turn rollout
# --------------------------------------------------------------------------------------


def stop_token_ids(tokenizer: Any, stop_tokens: Sequence[str]) -> tuple[int, ...]:
    """The id of each stop token; an error naming it where it is not one token of ``tokenizer``."""
    ids = []
    for text in stop_tokens:
        encoded = tokenizer.encode(text, add_special_tokens=False)
        if len(encoded) != 1:
            raise ValueError(f"environment stop token {text!r} is {len(encoded)} tokens of this tokenizer; it must "
                             "be one (add it to the tokenizer, e.g. model.added_tokens when building the model)")
        ids.append(encoded[0])
    return tuple(ids)


@dataclass
class _Trajectory:
    context: list[int]  # prompt + every turn and observation so far: the next turn's prompt
    ids: list[int]
    logprobs: list[float]
    actions: list[int]  # 1 the policy's token, OBSERVATION the environment's
    env: Any
    messages: list[dict[str, Any]] | None = None  # chat mode: the conversation so far; None: text mode
    tool_calls: int = 0
    reward: float = 0.0
    done: bool = False


def rollout_with_environment(engine: Any, tokenizer: Any, prompts: Sequence[str], labels: Sequence[str | None],
                             params: SamplingParams, make_env: Callable[[], Environment], *, max_turns: int,
                             max_trajectory_tokens: int,
                             conversations: Sequence[Sequence[dict[str, Any]]] | None = None,
                             ) -> tuple[RolloutBatch, torch.Tensor]:
    """``params.n`` multi-turn trajectories per prompt, grouped contiguously, and each one's environment reward
    ``(B*n,)`` (0 where the environment gave none).

    Turn ``k`` of every unfinished trajectory is one ``engine.generate_ids`` call (n=1 per row, the same
    temperature/top-p, seed ``params.seed + k``), stopped at eos or an environment stop token and capped at
    ``min(params.max_new_tokens, tokens left in the budget)``. A turn that ends at a stop token is the
    environment's :meth:`Environment.step`; its observation's ids are appended with ``action_mask`` 0 and
    sampling log-prob 0. Returns a :class:`RolloutBatch` whose ``response_ids`` are the trajectories (turns and
    observations), ``response_mask`` 1 on all of them, ``action_mask`` 1 on the sampled tokens only, and
    ``tool_calls`` the environment steps of each.

    ``conversations`` (chat mode, :class:`ToolMessages`): each prompt's messages, ``prompts[i]`` being their
    rendering with the generation prompt. A turn that ends at eos is then a step too (a final answer is one the
    environment ends with ``done``, not counted in ``tool_calls``), and an observation is a ``tool`` message:
    the ids of :func:`tool_turn_text`, after the end-of-turn eos where the turn stopped at a stop token instead.
    """
    if max_turns < 1 or max_trajectory_tokens < 1:
        raise ValueError(f"rollout_with_environment: max_turns ({max_turns}) and max_trajectory_tokens "
                         f"({max_trajectory_tokens}) must be >= 1")
    chat, eos = conversations is not None, tokenizer.eos_token_id
    rows = _start_trajectories(tokenizer, prompts, labels, params.n, make_env, conversations)
    stops = stop_token_ids(tokenizer, rows[0].env.stop_tokens) if rows else ()
    for turn in range(max_turns):
        live = [r for r in rows if not r.done]
        if not live:
            break
        budget = min(params.max_new_tokens, *(max_trajectory_tokens - len(r.ids) for r in live))
        turn_params = replace(params, n=1, max_new_tokens=max(budget, 1), stop_token_ids=stops,
                              seed=None if params.seed is None else params.seed + turn)
        batch = engine.generate_ids([r.context for r in live], turn_params)
        for i, r in enumerate(live):
            k = int(batch.response_mask[i].sum())
            new = batch.response_ids[i, :k].tolist()
            r.ids += new
            r.logprobs += batch.sampling_logprobs[i, :k].tolist()
            r.actions += [1] * k
            r.context += new
            # chat: eos ends the assistant turn, not the episode; the environment reads it (a call or an answer)
            closed = chat and bool(new) and new[-1] == eos
            if not (closed or (new and new[-1] in stops)) or turn == max_turns - 1 \
                    or len(r.ids) >= max_trajectory_tokens:
                r.done = True  # eos, the turn's token cap, the turn limit or the budget
                continue
            result = _step(r.env, tokenizer.decode(new, skip_special_tokens=True))
            r.tool_calls += not (closed and result.done)
            r.reward += result.reward or 0.0
            if result.done:
                r.done = True
                continue
            obs = (_chat_observation_ids(tokenizer, r, new, result.observation) if chat
                   else tokenizer.encode(result.observation, add_special_tokens=False) if result.observation else [])
            obs = obs[:max(max_trajectory_tokens - len(r.ids), 0)]
            r.ids += obs
            r.logprobs += [0.0] * len(obs)
            r.actions += [OBSERVATION] * len(obs)
            r.context += obs
            if len(r.ids) >= max_trajectory_tokens:
                r.done = True
    return _to_batch(tokenizer, prompts, params.n, rows, tokenizer.pad_token_id)


def _start_trajectories(tokenizer: Any, prompts: Sequence[str], labels: Sequence[str | None], n: int,
                        make_env: Callable[[], Environment],
                        conversations: Sequence[Sequence[dict[str, Any]]] | None) -> list[_Trajectory]:
    """``n`` trajectories per prompt, each with a fresh environment reset on the prompt and its label."""
    if conversations is not None and len(conversations) != len(prompts):
        raise ValueError(f"rollout_with_environment: {len(conversations)} conversations for {len(prompts)} prompts")
    rows: list[_Trajectory] = []
    for j, (prompt, label) in enumerate(zip(prompts, labels, strict=True)):
        encoded = encode_prompt(tokenizer, prompt)
        for _ in range(n):
            env = make_env()
            try:
                env.reset(prompt, label)
            except RewardError:
                raise
            except Exception as exc:  # a user's environment file: name it and keep the cause
                raise EnvironmentFailure(f"environment reset failed: {type(exc).__name__}: {exc}") from exc
            messages = None if conversations is None else [dict(m) for m in conversations[j]]
            rows.append(_Trajectory(list(encoded), [], [], [], env, messages))
    return rows


def _step(env: Environment, action: str) -> StepResult:
    """``env``'s checked reply to one model turn; a user's exception becomes an :class:`EnvironmentFailure`."""
    where = f"environment {type(env).__name__}"
    try:
        value = env.step(action)
    except RewardError:
        raise
    except Exception as exc:
        raise EnvironmentFailure(f"{where}: step failed: {shown_error(exc)}") from exc
    return _check_result(value, where)


def _chat_observation_ids(tokenizer: Any, r: _Trajectory, turn: list[int], observation: str) -> list[int]:
    """Chat mode's observation ids after the model turn ``turn``: the end-of-turn eos where the turn stopped at a
    stop token instead (the template closes every assistant turn), then :func:`tool_turn_text`'s ids; the turn
    and the tool message join ``r.messages``."""
    eos = tokenizer.eos_token_id
    closed = turn[-1] == eos
    content = tokenizer.decode(turn[:-1] if closed else turn, skip_special_tokens=False)
    text = tool_turn_text(tokenizer, r.messages or [], content, observation)
    r.messages = [*(r.messages or []), {"role": "assistant", "content": content},
                  {"role": "tool", "content": observation}]
    return ([] if closed else [eos]) + tokenizer.encode(text, add_special_tokens=False)


def _to_batch(tokenizer: Any, prompts: Sequence[str], n: int, rows: list[_Trajectory],
              pad: int) -> tuple[RolloutBatch, torch.Tensor]:
    """The trajectories as one :class:`RolloutBatch` (prompts left-padded, trajectories right-padded) and
    their environment rewards."""
    prompt_lens = [len(r.context) - len(r.ids) for r in rows]
    prompt_ids, prompt_mask = _left_pad([r.context[:p] for r, p in zip(rows, prompt_lens)], pad)
    width = max(max(len(r.ids) for r in rows), 1)
    response_ids = torch.full((len(rows), width), pad, dtype=torch.long)
    response_mask = torch.zeros_like(response_ids)
    action_mask = torch.zeros_like(response_ids)
    logprobs = torch.zeros((len(rows), width), dtype=torch.float32)
    for i, r in enumerate(rows):
        k = len(r.ids)
        response_ids[i, :k] = torch.tensor(r.ids, dtype=torch.long)
        response_mask[i, :k] = 1
        action_mask[i, :k] = torch.tensor(r.actions, dtype=torch.long)
        logprobs[i, :k] = torch.tensor(r.logprobs, dtype=torch.float32)
    completions = [tokenizer.decode(r.ids, skip_special_tokens=True) for r in rows]
    batch = RolloutBatch(prompts=[p for p in prompts for _ in range(n)], completions=completions,
                         prompt_ids=prompt_ids, prompt_mask=prompt_mask, response_ids=response_ids,
                         response_mask=response_mask, sampling_logprobs=logprobs, group_size=n,
                         action_mask=action_mask, tool_calls=torch.tensor([r.tool_calls for r in rows]))
    return batch, torch.tensor([r.reward for r in rows], dtype=torch.float32)


def trajectory_rows(tokenizer: Any, batch: RolloutBatch, rewards: torch.Tensor, n: int) -> list[dict[str, Any]]:
    """The first ``n`` trajectories for an MLflow table: ``text`` (response, special tokens kept), ``segments``
    (the response cut into ``policy`` and ``observation`` spans, in order), ``action_mask`` (one 0/1 per response
    token), ``tool_calls`` and ``reward``; secrets redacted."""
    rows = []
    for i in range(min(n, len(batch))):
        k = int(batch.response_mask[i].sum())
        ids = batch.response_ids[i, :k].tolist()
        actions = (batch.action_mask[i, :k] if batch.action_mask is not None else torch.ones(k, dtype=torch.long))
        actions = actions.tolist()
        segments: list[dict[str, str]] = []
        start = 0
        for j in range(1, k + 1):
            if j == k or actions[j] != actions[start]:
                segments.append({"source": "policy" if actions[start] else "observation",
                                 "text": tokenizer.decode(ids[start:j], skip_special_tokens=False)})
                start = j
        rows.append(redact_secrets({
            "prompt": batch.prompts[i], "text": tokenizer.decode(ids, skip_special_tokens=False),
            "segments": segments, "action_mask": "".join(str(a) for a in actions),
            "tool_calls": int(batch.tool_calls[i]) if batch.tool_calls is not None else 0,
            "reward": float(rewards[i])}))
    return rows


# --------------------------------------------------------------------------------------
# Greedy multi-turn evaluation
# --------------------------------------------------------------------------------------


def evaluate_with_environment(model: Any, tokenizer: Any, eval_file: str, make_env: Callable[[], Environment],
                              reward_fn: Callable[..., Sequence[float]], *, max_items: int, max_turns: int,
                              max_trajectory_tokens: int, max_new_tokens: int, batch_size: int = 256,
                              prompt_field: str = "prompt", label_field: str = "label",
                              tool_messages: str = "text") -> tuple[dict[str, float], list[dict[str, Any]]]:
    """Greedy multi-turn answers to the first ``max_items`` items of ``eval_file``, scored by ``reward_fn``;
    observations join as ``tool_messages`` says (:func:`tool_conversations`).

    Metrics (binomial standard errors ``sqrt(p (1-p) / n)`` beside each): ``eval/accuracy_tool`` (mean reward:
    the share exactly right for a 0/1 rule reward), ``eval/accuracy_<skill>_tool`` per skill of the embedded
    task (``eval/accuracy_arithmetic_tool``), ``eval/tool_call_rate`` (share of items with at least one tool
    call) and ``eval/tool_calls_mean``; also the first trajectories (:func:`trajectory_rows`).
    """
    examples = read_prompt_examples(read_records(eval_file, limit=max_items), eval_file, prompt_field=prompt_field,
                                    label_field=label_field)
    conversations = tool_conversations(tool_messages, tokenizer, examples, eval_file, prompt_field)
    prompts = [prompt_text(tokenizer, e.prompt) for e in examples]
    labels = [None if e.label is None else str(e.label) for e in examples]
    engine = HFGenerateEngine(model, tokenizer, batch_size=batch_size)
    batch, env_rewards = rollout_with_environment(
        engine, tokenizer, prompts, labels, SamplingParams(n=1, temperature=0.0, max_new_tokens=max_new_tokens),
        make_env, max_turns=max_turns, max_trajectory_tokens=max_trajectory_tokens, conversations=conversations)
    scores = [float(r) + float(e) for r, e in zip(reward_fn(prompts, batch.completions, labels), env_rewards)]
    correct = [s >= 1.0 for s in scores]
    called = [int(c) > 0 for c in batch.tool_calls]
    acc, se = accuracy_with_stderr(correct)
    rate, rate_se = accuracy_with_stderr(called)
    metrics = {"eval/accuracy_tool": acc, "eval/accuracy_tool_stderr": se, "eval/tool_call_rate": rate,
               "eval/tool_call_rate_stderr": rate_se, "eval/tool_calls_mean": float(batch.tool_calls.float().mean()),
               "eval/n_items": float(len(correct))}
    groups: dict[str, list[bool]] = {}
    for prompt, ok in zip(examples, correct):
        problem = parse_prompt(prompt.prompt) if isinstance(prompt.prompt, str) else None
        if problem is not None:
            groups.setdefault(problem.skill, []).append(ok)
    for skill, oks in sorted(groups.items()):
        metrics[f"eval/accuracy_{skill}_tool"], metrics[f"eval/accuracy_{skill}_tool_stderr"] = \
            accuracy_with_stderr(oks)
    return metrics, trajectory_rows(tokenizer, batch, torch.tensor(scores), 8)
