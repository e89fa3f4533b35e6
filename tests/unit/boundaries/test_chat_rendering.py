"""Boundary: chat messages and a model folder's chat template, rendered by ``rlhf_core.data.chat.render_chat``.

Every chat template in the pipeline runs through ``render_chat`` (``formats.prompt_text`` / ``completion_text``,
``tokenize.tokenize_messages``, ``environments.tool_turn_text``). The contract: a list of ``{role, content}``
messages with string contents and known roles renders to text; any other value is a ``ChatTemplateError``; a
template that raises (a Jinja error, its own ``raise_exception``, any Python error) or runs past its time limit
(``CHAT_TEMPLATE_SECONDS``, here a shorter ``seconds``) is a ``ChatTemplateError`` naming the model folder's
template file, raised within the limit, in any thread, and never another exception type or a hang.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from conftest import LLAMA_CHAT_TEMPLATE
from hypothesis import example, given
from hypothesis import strategies as st

from rlhf_core.data.chat import CHAT_TEMPLATE_DEPTH, CHAT_TEMPLATE_SECONDS, ROLES, ChatTemplateError, render_chat
from rlhf_core.data.formats import completion_text, prompt_text
from rlhf_core.data.tokenize import tokenize_messages
from rlhf_core.rollout.environments import tool_turn_text
from rlhf_core.models.loading import load_tokenizer

LIMIT = 0.3  # seconds: the bound the tests render under (CHAT_TEMPLATE_SECONDS is the pipeline's)

json_values = st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
                           lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=8), c, max_size=3),
                           max_leaves=8)
good_message = st.fixed_dictionaries({"role": st.sampled_from(ROLES), "content": st.text(max_size=30)})
bad_message = st.one_of(
    json_values.filter(lambda v: not isinstance(v, dict)),
    st.fixed_dictionaries({"role": st.text(max_size=10).filter(lambda r: r not in ROLES), "content": st.text()}),
    st.fixed_dictionaries({"role": st.sampled_from(ROLES), "content": json_values.filter(lambda v: not isinstance(v, str))}),
    st.fixed_dictionaries({"role": json_values.filter(lambda v: not isinstance(v, str)), "content": st.text()}),
    st.fixed_dictionaries({"role": st.sampled_from(ROLES)}),
)
FRAGMENTS = [
    "{{ messages[0]['content'] }}", "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}",
    "{{ raise_exception('no system role here') }}", "{% if %}", "{{ 1 / 0 }}", "{{ nothing.at.all }}",
    "{{ messages.__class__.__mro__ }}", "{% for i in range(10**9) %}x{% endfor %}", "{{ messages | tojson }}",
    "{{ eos_token }}", "{% set ns = namespace(n=0) %}{{ ns.n }}", "{% endfor %}", "{{ 'ab' * 3 }}",
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}", "{{ messages[-1]['role'] | upper }}",
    "{{ '%d' % 'x' }}", "{{ strftime_now('%Y') }}", "{% for m in messages %}{% break %}{% endfor %}",
]
templates = st.lists(st.sampled_from(FRAGMENTS) | st.text(alphabet="{}%#()'\"x -|", max_size=12), min_size=1,
                     max_size=4).map("".join)


@pytest.fixture(scope="module")
def tok(llama_chat_model):
    """The Llama micro model's tokenizer (its own object: tests here set its template)."""
    return load_tokenizer(llama_chat_model)


@given(messages=st.lists(good_message | bad_message, max_size=4), generation=st.booleans())
@example(messages=[{"role": "user", "content": "hi"}, {"role": "robot", "content": "x"}], generation=False)
@example(messages=[{"role": ["user"], "content": "hi"}], generation=False)  # an unhashable role
def test_messages_render_or_are_refused(tok, messages, generation):
    tok.chat_template = LLAMA_CHAT_TEMPLATE
    well_formed = bool(messages) and all(isinstance(m, dict) and isinstance(m.get("role"), str) and m["role"] in ROLES
                                         and isinstance(m.get("content"), str) for m in messages)
    try:
        text = render_chat(tok, messages, generation, seconds=LIMIT)
    except ChatTemplateError as exc:
        assert not well_formed, exc
        assert str(exc).startswith(("message ", "expected a non-empty list"))
        return
    assert well_formed
    for m in messages:
        assert m["content"] in text


def test_a_value_that_is_not_a_list_is_refused(tok):
    for value in ([], {"role": "user", "content": "x"}, "user: x", None, ({"role": "user", "content": "x"},)):
        with pytest.raises(ChatTemplateError, match="expected a non-empty list of"):
            render_chat(tok, value, False)


@given(template=templates, messages=st.lists(good_message, min_size=1, max_size=3))
@example(template="{{ raise_exception('no system role here') }}", messages=[{"role": "user", "content": ""}])
@example(template="{% for i in range(10**9) %}x{% endfor %}", messages=[{"role": "user", "content": ""}])
def test_templates_render_or_are_refused_naming_the_file(tok, llama_chat_model, template, messages):
    tok.chat_template = template
    start = time.monotonic()
    try:
        text = render_chat(tok, messages, True, seconds=LIMIT)
    except ChatTemplateError as exc:
        assert str(llama_chat_model / "chat_template.jinja") in str(exc)
    else:
        assert isinstance(text, str)
    assert time.monotonic() - start < LIMIT + 2.0


RUNAWAY = {
    "a loop of 10^10 steps": "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
    "unbounded recursion": "{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}",
    "a range past the sandbox's": "{% for i in range(10**9) %}x{% endfor %}",
}


@pytest.mark.parametrize("where", ["main thread", "worker thread"])
@pytest.mark.parametrize("name", sorted(RUNAWAY))
def test_a_runaway_template_is_refused_within_the_limit(tok, llama_chat_model, name, where):
    tok.chat_template = RUNAWAY[name]

    def render():
        start = time.monotonic()
        with pytest.raises(ChatTemplateError) as caught:
            render_chat(tok, [{"role": "user", "content": "hi"}], True, seconds=LIMIT)
        return time.monotonic() - start, str(caught.value), threading.current_thread() is threading.main_thread()

    if where == "main thread":
        took, message, on_main = render()
    else:
        with ThreadPoolExecutor(1) as pool:
            took, message, on_main = pool.submit(render).result(timeout=30)
    assert on_main == (where == "main thread")
    assert took < LIMIT + 2.0 and str(llama_chat_model / "chat_template.jinja") in message
    if name == "unbounded recursion":  # stopped at the depth bound, far above the stack's own limit
        assert f"nested more than {CHAT_TEMPLATE_DEPTH} calls deep" in message, message
    assert 0 < CHAT_TEMPLATE_SECONDS <= 60


def test_every_renderer_goes_through_render_chat(tok, llama_chat_model):
    """The three callers refuse a malformed chat and a failing template with the same error."""
    tok.chat_template = "{{ raise_exception('refused by the template') }}"
    chat = [{"role": "user", "content": "hi"}]
    callers = [lambda: prompt_text(tok, chat), lambda: completion_text(tok, chat, [{"role": "assistant", "content": "x"}]),
               lambda: tokenize_messages(tok, chat + [{"role": "assistant", "content": "x"}], 32),
               lambda: tool_turn_text(tok, chat, "x", "y")]
    for call in callers:
        with pytest.raises(ChatTemplateError, match="refused by the template") as caught:
            call()
        assert str(llama_chat_model / "chat_template.jinja") in str(caught.value)
    tok.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    with pytest.raises(ChatTemplateError, match="message 1: role 'robot'"):
        tokenize_messages(tok, chat + [{"role": "robot", "content": "x"}], 32)
    with pytest.raises(ChatTemplateError, match="message 0: 'content' missing"):
        tool_turn_text(tok, [{"role": "user"}], "x", "y")
