"""Boundary: the calculator tool's parser (``rlhf_core.rollout.tool_task``) and what an environment's step returns.

``CalculatorEnv.step`` reads any string the policy wrote and answers ``<result>V</result>`` for a call ``a op b``
(operands of up to six digits, ``op`` in ``+ - *``) or ``<result>error</result>`` for anything else, at once
(``9**9**9`` is not evaluated); ``final_answer`` and ``reward`` take any strings. ``environments._check_result``
takes any value a step returned: a ``StepResult`` (or its dict) of a string, a boolean and a finite reward or
none is accepted, anything else is an ``EnvironmentFailure`` naming the environment, never another exception.
"""

from __future__ import annotations

import re
import time

import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from rlhf_core.rollout.environments import EnvironmentFailure, StepResult, _check_result, _step
from rlhf_core.rollout.tool_task import CALL_CLOSE, CALL_OPEN, RESULT_CLOSE, CalculatorEnv, final_answer, reward

calls = st.builds(lambda a, op, b, pad: f"{pad}{a}{pad}{op}{pad}{b}{pad}", st.integers(-10**7, 10**7),
                  st.sampled_from("+-*/%^"), st.integers(-10**7, 10**7), st.sampled_from(["", " ", "\t"]))
actions = st.one_of(st.text(), calls.map(lambda c: f"x{CALL_OPEN}{c}{CALL_CLOSE}"),
                    st.lists(st.sampled_from([CALL_OPEN, CALL_CLOSE, "1", "*", " ", "9**9**9", "-"])).map("".join))


@given(action=actions)
@example(action=f"{CALL_OPEN}9**9**9{CALL_CLOSE}")
@example(action="\u0663 * -\u0664")  # Arabic-Indic digits, no tags: the whole text is the call
@example(action=f"{CALL_OPEN}{'9' * 100000}*{'9' * 100000}{CALL_CLOSE}")
@example(action=f"{CALL_OPEN}{' ' * 100000}1+1{' ' * 100000}x{CALL_CLOSE}")
def test_the_calculator_answers_any_action(action):
    start = time.monotonic()
    result = CalculatorEnv().step(action)
    assert time.monotonic() - start < 1.0
    assert isinstance(result, StepResult) and result.observation.endswith(RESULT_CLOSE) and not result.done
    value = result.observation.removeprefix("<result>").removesuffix(RESULT_CLOSE)
    call = action.rsplit(CALL_OPEN, 1)[-1].removesuffix(CALL_CLOSE)
    readable = re.fullmatch(r"\s*(-?\d{1,6})\s*([+\-*])\s*(-?\d{1,6})\s*", call)
    assert (value != "error") == (readable is not None)
    if readable:  # two short integers (any Unicode digits) and one operator
        a, op, b = int(readable[1]), readable[2], int(readable[3])
        assert int(value) == {"+": a + b, "-": a - b, "*": a * b}[op]
    assert _check_result(result, "calculator") is result


@given(completions=st.lists(st.text(), min_size=1, max_size=3), label=st.text(max_size=5))
def test_final_answer_and_reward_take_any_text(completions, label):
    for c in completions:
        answer = final_answer(c)
        assert isinstance(answer, str) and "\n" not in answer
    assert set(reward([""] * len(completions), completions, [label] * len(completions))) <= {0.0, 1.0}


class _Unprintable:
    def __str__(self):
        raise RuntimeError("no text")


values = st.one_of(
    st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
                 lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=8), c, max_size=3), max_leaves=6),
    st.fixed_dictionaries({}, optional={"observation": st.text(max_size=5) | st.integers(), "done": st.booleans() | st.none(),
                                        "reward": st.floats() | st.integers() | st.none() | st.booleans()}),
    st.builds(StepResult, observation=st.text(max_size=5) | st.integers(), done=st.booleans() | st.integers(),
              reward=st.none() | st.floats() | st.integers(10**300, 10**320)),
    st.just(_Unprintable()), st.just(10**5000),
)


@given(value=values)
@example(value=10**5000)  # str() of it raised ValueError (the 4300-digit limit) inside the error message
@example(value=StepResult(reward=10**5000))
@example(value={"observation": 10**5000})
@example(value=_Unprintable())
def test_a_step_result_is_accepted_or_refused_naming_the_environment(value):
    try:
        result = _check_result(value, "environment MyEnv")
    except EnvironmentFailure as exc:
        assert str(exc).startswith("environment MyEnv: step returned")
        return
    assert isinstance(result.observation, str) and isinstance(result.done, bool)
    assert result.reward is None or float("-inf") < float(result.reward) < float("inf")


class _Raising:
    stop_tokens = ("</calc>",)

    def step(self, action):
        raise ValueError(10**5000)


def test_a_step_that_raises_is_a_failure_naming_the_environment():
    with pytest.raises(EnvironmentFailure, match="^environment _Raising: step failed: ValueError"):
        _step(_Raising(), "x")
