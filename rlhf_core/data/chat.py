"""Chat messages and their rendering by a tokenizer's chat template: the one place a template runs.

A chat is a list of ``{role, content}`` messages, each role one of :data:`ROLES` and each content a string.
:func:`render_chat` checks that, then renders the chat with the tokenizer's own Jinja template (from its
model folder) or :data:`PLAIN_CHAT_TEMPLATE` where it has none, bounded by :data:`CHAT_TEMPLATE_SECONDS`;
every failure is a :class:`ChatTemplateError` naming the template's file. transformers renders in Jinja's
sandbox, which blocks attribute access and ranges over 100000 items but sets no bound on time; the bound is
:mod:`rlhf_core.common.time_limit` (a trace function, so it holds in any thread, Ray's and Prefect's included).
No torch here: data validation reads :data:`ROLES` and :func:`message_problem` without it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rlhf_core.common.time_limit import TimeLimitExceeded, time_limit

ROLES = ("system", "user", "assistant", "tool")
"""Roles a message may have (the OpenAI / Hugging Face chat convention)."""

CHAT_TEMPLATE_DEPTH = 64
"""The deepest a chat template's own calls (macros, recursive loops) may nest during one rendering: real templates
nest a few levels (a recursive macro over a tool's JSON schema: its nesting); deeper is refused as runaway
recursion. Each level costs Jinja about five Python frames, so Python's limit of 1000 would stop it near 199."""

CHAT_TEMPLATE_SECONDS = 5.0
"""The longest one rendering of a chat template may run (:func:`render_chat`); a real template takes
milliseconds, so only a runaway one (a loop of 10^10 steps, unbounded recursion) meets it."""

# Used when a tokenizer ships no chat template: plain text, no special tokens needed
# beyond eos, which ends every assistant turn so that generation knows where to stop.
# Newlines are Jinja expressions because transformers renders with trim_blocks=True,
# which would eat a literal newline after a block tag.
PLAIN_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ message['role'] }}: {{ message['content'] }}"
    "{% if message['role'] == 'assistant' %}{{ eos_token }}{% endif %}{{ '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}assistant: {% endif %}"
)


def ensure_chat_template(tokenizer: Any) -> Any:
    """Give ``tokenizer`` the plain template if it has none; return it."""
    if not getattr(tokenizer, "chat_template", None):
        tokenizer.chat_template = PLAIN_CHAT_TEMPLATE
    return tokenizer


class ChatTemplateError(ValueError):
    """Messages that are not a chat, or a chat template that fails or runs past its time limit; the message
    says which, naming the file the template came from."""


def message_problem(message: Any) -> str | None:
    """What makes ``message`` no chat message (an object with a string ``content`` and a role in
    :data:`ROLES`), or None."""
    if not isinstance(message, dict):
        return f"expected an object, got {type(message).__name__}"
    if "content" not in message or not isinstance(message["content"], str):
        return "'content' missing or not a string"
    if not isinstance(message.get("role"), str) or message["role"] not in ROLES:
        return f"role {str(message.get('role'))[:40]!r} is not one of {', '.join(ROLES)}"
    return None


def template_source(tokenizer: Any) -> str:
    """Where ``tokenizer``'s chat template comes from, for messages: its model folder's ``chat_template.jinja``
    or ``tokenizer_config.json``, or the plain template."""
    if getattr(tokenizer, "chat_template", None) == PLAIN_CHAT_TEMPLATE:
        return "the plain chat template (rlhf_core.data.chat.PLAIN_CHAT_TEMPLATE)"
    folder = Path(getattr(tokenizer, "name_or_path", "") or ".")
    found = next((folder / name for name in ("chat_template.jinja", "chat_template.json")
                  if (folder / name).is_file()), folder / "tokenizer_config.json")
    return f"the chat template of {found}"


def _template_code(code: Any) -> bool:
    return code.co_filename == "<template>"  # Jinja's name for the code a template string compiles to


def render_chat(tokenizer: Any, messages: list[dict[str, Any]], add_generation_prompt: bool, *,
                seconds: float = CHAT_TEMPLATE_SECONDS) -> str:
    """``messages`` rendered as text by ``tokenizer``'s chat template (the plain one where it has none).

    Raises :class:`ChatTemplateError` where ``messages`` is not a non-empty list of chat messages
    (:func:`message_problem`), and where the template raises (a Jinja error, its own ``raise_exception``,
    any other exception) or runs past ``seconds`` (:mod:`rlhf_core.common.time_limit`), naming the template's file
    (:func:`template_source`)."""
    if not isinstance(messages, list) or not messages:
        raise ChatTemplateError(f"expected a non-empty list of {{role, content}} messages, got "
                                f"{'an empty list' if isinstance(messages, list) else type(messages).__name__}")
    for j, message in enumerate(messages):
        if (problem := message_problem(message)) is not None:
            raise ChatTemplateError(f"message {j}: {problem}")
    ensure_chat_template(tokenizer)
    try:
        with time_limit(seconds, _template_code, max_depth=CHAT_TEMPLATE_DEPTH):
            text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
    except TimeLimitExceeded as exc:
        raise ChatTemplateError(f"{template_source(tokenizer)}: rendering {len(messages)} message(s) was stopped, "
                                f"{exc} (limits: {seconds:g} s, {CHAT_TEMPLATE_DEPTH} nested calls)") from None
    except Exception as exc:  # noqa: BLE001 - the template is the model folder's code: any failure is its own
        raise ChatTemplateError(f"{template_source(tokenizer)} failed: {type(exc).__name__}: {str(exc)[:300]}") \
            from exc
    if not isinstance(text, str):
        raise ChatTemplateError(f"{template_source(tokenizer)} rendered a {type(text).__name__}, not text")
    return text
