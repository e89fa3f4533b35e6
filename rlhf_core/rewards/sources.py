"""Reward sources for online RL: a reward model, a reward function file, or an HTTP endpoint.

Each is a :class:`RewardSource` — ``source(prompts, completions, labels) -> list[float]``,
one reward per sample — so a trainer never knows where rewards come from. The config picks
one with :class:`RewardKind` and :func:`build_reward_source`:

* ``model``: a trained reward model directory (``alignflow reward``), scores normalised;
* ``function``: ``path/to/file.py:function`` with the same signature (the embedded task's
  rule is ``rlhf_core/embedded/reward.py:reward``);
* ``http``: a server answering ``POST {"prompts", "completions", "labels"}`` with
  ``{"rewards": [...]}`` — e.g. ``alignflow serve-rm`` (:mod:`rlhf_core.rewards.server`).

Every reply is checked (one finite number per sample) and every failure raises
:class:`RewardError` saying which source, which sample and why.

What a source receives, per sample: ``prompts`` the text the policy read, rendered (a
conversational prompt with the policy's chat template and generation prompt, so its role
markers are in the string; a standard prompt as written), ``completions`` the decoded answer
with special tokens (the end-of-turn eos included) skipped, and ``labels`` the prompt record's
label or ``None``.
"""

from __future__ import annotations

import datetime
import email.utils
import hashlib
import importlib.util
import math
import numbers
import os
import random
import re
import sys
import time
from pathlib import Path
from typing import Any, Callable, Protocol, Sequence, runtime_checkable
from urllib.parse import urlsplit

import torch

from rlhf_core.common.redact import redact_secrets, register_secret, register_url_secrets
from rlhf_core.common.shown import shown
from rlhf_core.config.choices import RewardKind  # re-exported: users' reward files and the configs name it
from rlhf_core.models.loading import load_tokenizer
from rlhf_core.rewards.model import load_reward_model, score


class RewardError(RuntimeError):
    """A reward source that failed or answered something other than one finite number per sample."""


@runtime_checkable
class RewardSource(Protocol):
    """One reward per ``(prompt, completion, label)``: the rendered prompt text, the decoded answer (no
    special tokens), the label or ``None`` (see the module docstring)."""

    @property
    def name(self) -> str:
        """Where rewards come from, for logs (``model:/path``, ``function:file.py:fn``, ``http:url``)."""
        ...

    def __call__(self, prompts: Sequence[str], completions: Sequence[str],
                 labels: Sequence[str | None]) -> list[float]:
        ...


def _check_inputs(where: str, prompts: Sequence[str], completions: Sequence[str],
                  labels: Sequence[str | None]) -> None:
    if not len(prompts) == len(completions) == len(labels):
        raise RewardError(f"{where}: {len(prompts)} prompts, {len(completions)} completions and "
                          f"{len(labels)} labels; expected one of each per sample")


def validate_rewards(values: Any, n: int, where: str) -> list[float]:
    """``values`` as ``n`` finite floats, else a :class:`RewardError` naming ``where`` and the sample."""
    if hasattr(values, "tolist") and not isinstance(values, (list, tuple)):
        values = values.tolist()  # a tensor or array of rewards
    if isinstance(values, (str, bytes)) or not isinstance(values, Sequence):
        raise RewardError(f"{where}: expected a list of {n} rewards, got {type(values).__name__}")
    if len(values) != n:
        raise RewardError(f"{where}: returned {len(values)} rewards for {n} samples")
    out: list[float] = []
    for i, v in enumerate(values):
        if not isinstance(v, numbers.Real):
            raise RewardError(f"{where}: sample {i}: reward {shown(v, 60)} is not a number")
        try:
            f = float(v)
        except OverflowError:  # an int past float's range (JSON integers have no bound)
            f = math.inf
        if not math.isfinite(f):
            raise RewardError(f"{where}: sample {i}: reward {shown(v, 60)} is not finite")
        out.append(f)
    return out


# --------------------------------------------------------------------------------------
# A trained reward model
# --------------------------------------------------------------------------------------


class RewardModelSource:
    """Normalised scores of a reward model directory (see :mod:`rlhf_core.rewards.model`); labels unused."""

    def __init__(self, path: str | Path, device: torch.device | str | None = None, batch_size: int = 64,
                 max_length: int = 256, attention: str = "auto"):
        self.path = Path(path)
        self.model = load_reward_model(self.path, torch.device(device) if isinstance(device, str) else device,
                                       attention=attention)
        self.tokenizer = load_tokenizer(self.path)
        self.batch_size, self.max_length = batch_size, max_length

    @property
    def name(self) -> str:
        return f"model:{self.path}"

    def __call__(self, prompts: Sequence[str], completions: Sequence[str],
                 labels: Sequence[str | None]) -> list[float]:
        _check_inputs(self.name, prompts, completions, labels)
        if not prompts:
            return []
        values = score(self.model, self.tokenizer, list(prompts), list(completions),
                       batch_size=self.batch_size, max_length=self.max_length)
        return validate_rewards(values, len(prompts), self.name)


# --------------------------------------------------------------------------------------
# A reward function file
# --------------------------------------------------------------------------------------


INSTALL_ROOT = Path(__file__).resolve().parents[2]
"""The folder holding ``rlhf_core/``: where the shipped reward files live."""

MOVED_REWARD_FILES = {"rlhf_core/rewards_embedded.py": "rlhf_core/embedded/reward.py"}
"""Shipped reward files that moved, old path -> new, so a params file naming the old path still runs."""


def resolve_reward_file(file_part: str) -> Path:
    """A reward file's path: as given (relative to the working directory), else, for a
    relative path that does not exist there, relative to the alignflow installation — so
    the shipped ``rlhf_core/embedded/reward.py`` is found from any project folder."""
    file_part = MOVED_REWARD_FILES.get(file_part, file_part)
    path = Path(file_part).expanduser()
    if not path.is_absolute() and not path.exists() and (INSTALL_ROOT / path).is_file():
        path = INSTALL_ROOT / path
    return path.resolve()


def load_function(spec: str) -> tuple[Path, str, Callable[..., Any]]:
    """``(file, name, function)`` of ``"path/to/file.py:name"``, imported from that file only.

    Loaded by file path, never by module name, so a config cannot make alignflow import an
    arbitrary installed module; the file gets a private module name so two reward files
    called ``reward.py`` do not collide.
    """
    file_part, sep, func_name = spec.rpartition(":")
    if not sep or not file_part or not func_name:
        raise RewardError(f"reward function {spec!r}: expected 'path/to/file.py:function_name'")
    try:
        path = resolve_reward_file(file_part)
        is_file, exists = path.is_file(), path.exists()
    except (ValueError, OSError, RuntimeError) as exc:  # a NUL byte, a name too long, ~user with no home
        raise RewardError(f"reward function {spec!r}: cannot use {file_part!r} as a path: {exc}") from None
    if path.suffix != ".py":
        raise RewardError(f"reward function {spec!r}: {file_part} is not a .py file")
    if not is_file:
        raise RewardError(f"reward function {spec!r}: "
                          + (f"{path} is not a file" if exists else f"file {path} not found"))
    module_name = f"alignflow_reward_{path.stem}_{hashlib.sha1(str(path).encode()).hexdigest()[:10]}"
    module_spec = importlib.util.spec_from_file_location(module_name, path)
    if module_spec is None or module_spec.loader is None:
        raise RewardError(f"reward function {spec!r}: cannot import {path}")
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[module_name] = module  # dataclasses and pickling look modules up here
    try:
        module_spec.loader.exec_module(module)
    except Exception as exc:
        sys.modules.pop(module_name, None)
        raise RewardError(f"reward function {spec!r}: importing {path} failed: "
                          f"{type(exc).__name__}: {exc}") from exc
    func = getattr(module, func_name, None)
    if func is None:
        raise RewardError(f"reward function {spec!r}: {path} defines no '{func_name}'")
    if not callable(func):
        raise RewardError(f"reward function {spec!r}: '{func_name}' in {path} is not callable")
    return path, func_name, func


class FunctionRewardSource:
    """Rewards from ``fn(prompts, completions, labels) -> rewards`` defined in a ``.py`` file.

    ``path`` is ``"file.py:function_name"`` (relative to the working directory or absolute).
    """

    def __init__(self, path: str):
        self.spec = path
        self.file, self.function_name, self.fn = load_function(path)

    @property
    def name(self) -> str:
        return f"function:{self.file}:{self.function_name}"

    def __getstate__(self) -> dict[str, Any]:  # ship the spec, not the function, to another process
        return {"spec": self.spec}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["spec"])

    def __call__(self, prompts: Sequence[str], completions: Sequence[str],
                 labels: Sequence[str | None]) -> list[float]:
        where = f"reward function {self.function_name} in {self.file}"
        _check_inputs(where, prompts, completions, labels)
        try:
            values = self.fn(list(prompts), list(completions), list(labels))
        except Exception as exc:
            raise RewardError(self._locate_failure(where, prompts, completions, labels, exc)) from exc
        return validate_rewards(values, len(prompts), where)

    def _locate_failure(self, where: str, prompts: Sequence[str], completions: Sequence[str],
                        labels: Sequence[str | None], exc: Exception) -> str:
        """The message for a batch call that raised, naming the first sample that raises alone."""
        for i, (p, c, y) in enumerate(zip(prompts, completions, labels)):
            try:
                self.fn([p], [c], [y])
            except Exception as one:
                return f"{where}: raised on sample {i} ({c!r}, label {y!r}): {type(one).__name__}: {one}"
        return f"{where}: raised on the batch of {len(prompts)} samples: {type(exc).__name__}: {exc}"


# --------------------------------------------------------------------------------------
# An HTTP endpoint
# --------------------------------------------------------------------------------------


def _retry_after_s(value: str | None) -> float | None:
    """Seconds a ``Retry-After`` header asks for (delta-seconds or an HTTP date, RFC 9110 §10.2.3); None if absent or unreadable."""
    if not value:
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    if when.tzinfo is None:
        when = when.replace(tzinfo=datetime.timezone.utc)
    return max(0.0, (when - datetime.datetime.now(datetime.timezone.utc)).total_seconds())


def _excerpt(text: str, limit: int = 120) -> str:
    """A short, redacted, one-line excerpt of a server's reply: redacted first, so truncation
    cannot leave a recognisable piece of a secret behind."""
    text = " ".join(redact_secrets(text).split())
    return text if len(text) <= limit else text[:limit] + "..."


def _transport_reason(exc: Exception) -> str:
    """The cause of a requests error without the URL requests puts in its message (urllib3's
    ``MaxRetryError`` quotes the path and query): the inner reason, object addresses dropped."""
    inner = exc.args[0] if exc.args and isinstance(exc.args[0], Exception) else exc
    reason = getattr(inner, "reason", None) or inner
    return re.sub(r"<[\w.]+ object at 0x[0-9a-fA-F]+>:\s*", "", str(reason))


def _read_token(name: str) -> str:
    """The bearer token in environment variable ``name``, registered for redaction."""
    value = os.environ.get(name, "")
    if not value:
        raise RewardError(f"reward.token_env: environment variable {name} is not set (or is empty); export the "
                          f"reward server's token under that name")
    register_secret(value)
    return value


DEFAULT_MAX_RESPONSE_BYTES = 4 * 1024 * 1024
"""Largest reply body a reward or environment server may send: rewards for a few thousand samples, or a long
tool observation, with room to spare; a larger one is refused unread."""

_STATUS_HINTS = {**{code: " (redirects are not followed: set the URL to where the server points)"
                    for code in (301, 302, 303, 307, 308)},
                 401: " (check reward_token_env: the server wants a bearer token)",
                 403: " (the token in reward_token_env was refused)",
                 413: " (the batch is over the server's size or item limit: serve-rm --max-body-bytes/--max-items)"}


class _Retry(Exception):
    """A transient failure of one attempt: ``last`` for the message, ``wait_s`` if the server named one."""

    def __init__(self, last: str, counts: bool = True, wait_s: float | None = None):
        super().__init__(last)
        self.last, self.counts, self.wait_s = last, counts, wait_s


class HttpRewardSource:
    """Rewards from ``POST url`` with ``{"prompts", "completions", "labels"}`` → ``{"rewards": [...]}``.

    One call's failures:

    * timeouts, connection errors and 5xx replies are retried up to ``retries`` times, sleeping
      ``uniform(0, min(backoff_cap_s, backoff_s * 2**k))`` before retry ``k`` — exponential
      backoff with full jitter (Brooker, "Exponential Backoff and Jitter", AWS Architecture
      Blog 2015), so many ranks hitting one server do not retry in lock-step;
    * 429 is the server asking to slow down, not a failure: it is retried without using up
      ``retries``, after the reply's ``Retry-After`` (seconds or a date), else after the backoff;
    * any other 4xx, a 3xx (redirects are not followed) or a malformed 200 is a bug, not a blip,
      and fails at once;
    * ``deadline_s`` bounds the whole call, retries and waits included: a wait that would end
      past it is not begun, and each attempt's timeout is ``min(timeout_s, time left)``;
    * ``timeout_s`` bounds one attempt from connect to the reply's last byte, not each read
      (requests' own timeout), so a server trickling bytes is cut off at it
      (:class:`rlhf_core.common.bounded_http.Deadline`) and the attempt counts as a timeout;
    * a reply body over ``max_response_bytes`` is refused as it streams in, never read whole
      (:func:`rlhf_core.common.bounded_http.read_capped`); a 200 that is not strict JSON (``NaN`` and
      ``Infinity`` are not JSON numbers), too large, or malformed fails at once.

    ``token_env`` names an environment variable whose value is sent as ``Authorization: Bearer``;
    the value is read here, never stored in a config, and registered with
    :mod:`rlhf_core.common.redact`. Every error message is redacted (URL credentials and secret query
    values, the token, anything of theirs echoed back) and quotes a server's body only as a
    short redacted excerpt of a 5xx or a malformed 200, never a 4xx's.
    """

    def __init__(self, url: str, timeout_s: float = 30.0, retries: int = 3, backoff_s: float = 1.0, *,
                 backoff_cap_s: float = 30.0, deadline_s: float = 300.0, token_env: str = "",
                 max_response_bytes: int = DEFAULT_MAX_RESPONSE_BYTES):
        register_url_secrets(url)  # first: the checks below quote the URL
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"HttpRewardSource: url must start with http:// or https://, got {redact_secrets(url)!r}")
        for field, value, floor in (("timeout_s", timeout_s, "> 0"), ("retries", retries, ">= 0"),
                                    ("backoff_s", backoff_s, ">= 0"), ("backoff_cap_s", backoff_cap_s, ">= 0"),
                                    ("deadline_s", deadline_s, "> 0"),
                                    ("max_response_bytes", max_response_bytes, "> 0")):
            if not (value > 0 if floor == "> 0" else value >= 0):
                raise ValueError(f"HttpRewardSource: {field} must be {floor}, got {value}")
        if token_env and urlsplit(url).username:
            raise ValueError(f"HttpRewardSource: {redact_secrets(url)} carries user:pass@ credentials and token_env "
                             f"{token_env} is set; use one (requests would send only the token)")
        self.url, self.timeout_s, self.retries, self.backoff_s = url, timeout_s, retries, backoff_s
        self.backoff_cap_s, self.deadline_s, self.token_env = backoff_cap_s, deadline_s, token_env
        self.max_response_bytes = int(max_response_bytes)
        self._token = _read_token(token_env) if token_env else None
        self._session: Any = None  # made on first use: one keep-alive connection across calls
        # A private generator: jitter must not advance the global RNG that a checkpoint restores.
        self._rng = random.Random()

    @property
    def name(self) -> str:
        return f"http:{redact_secrets(self.url)}"  # names appear in logs and MLflow: no credentials

    def __getstate__(self) -> dict[str, Any]:  # the token never travels in a pickle: re-read from the env
        return {k: v for k, v in self.__dict__.items() if k not in ("_token", "_session")}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state, _session=None)
        self._token = _read_token(self.token_env) if self.token_env else None

    def backoff_s_before(self, retry: int) -> float:
        """Full-jitter wait before retry ``retry`` (0-based): uniform in [0, min(cap, backoff_s * 2**retry)]."""
        return self._rng.uniform(0.0, min(self.backoff_cap_s, self.backoff_s * 2.0 ** retry))

    def __call__(self, prompts: Sequence[str], completions: Sequence[str],
                 labels: Sequence[str | None]) -> list[float]:
        where = f"reward server {redact_secrets(self.url)}"
        _check_inputs(where, prompts, completions, labels)
        body = {"prompts": list(prompts), "completions": list(completions), "labels": list(labels)}
        return self._with_retries(lambda timeout: self._attempt(body, len(prompts), where, timeout), where)

    def post_json(self, body: dict[str, Any], where: str) -> Any:
        """``POST body`` with this source's retries, deadline and auth; the reply's JSON, unchecked (an
        environment server's transport, :class:`rlhf_core.rollout.environments.HttpEnvironment`)."""

        return self._with_retries(lambda timeout: _loads(self._post(body, where, timeout), where), where)

    def _with_retries(self, attempt: Callable[[float], Any], where: str) -> Any:
        """``attempt(timeout)`` until it returns, retrying :class:`_Retry` as the class docstring says."""
        deadline = time.monotonic() + self.deadline_s
        attempts = failures = 0
        last = ""
        while True:
            attempts += 1
            timeout = max(1e-3, min(self.timeout_s, deadline - time.monotonic()))
            try:
                return attempt(timeout)
            except _Retry as retry:
                # An attempt the deadline cut short says only that; the server's own last error says more.
                cut = timeout < self.timeout_s and time.monotonic() >= deadline
                last = f"{last} (then one more attempt, cut off by the deadline)" if cut and last else retry.last
                wait = retry.wait_s
                failures += retry.counts
                if wait is None:
                    wait = self.backoff_s_before(failures - 1 if retry.counts else attempts - 1)
            if failures > self.retries:
                raise RewardError(redact_secrets(f"{where}: failed after {attempts} attempts; last error: {last}"))
            if time.monotonic() + wait >= deadline:
                raise RewardError(redact_secrets(
                    f"{where}: gave up at the {self.deadline_s:g} s deadline (reward_deadline_s) after {attempts} "
                    f"attempts; last error: {last}"))
            time.sleep(wait)

    def _attempt(self, body: dict[str, list], n: int, where: str, timeout: float) -> list[float]:
        """One POST: the rewards, :class:`_Retry` for a transient failure, :class:`RewardError` otherwise."""
        return self._parse(self._post(body, where, timeout), n, where)

    def _post(self, body: dict[str, Any], where: str, timeout: float) -> bytes:
        """One POST, all of it within ``timeout``: the 200 reply's body (at most ``max_response_bytes``),
        :class:`_Retry` for a transient failure, :class:`RewardError` otherwise."""
        import requests  # lazy: requests (HTTP rewards only)

        from rlhf_core.common.bounded_http import Deadline, deadline_session  # lazy: requests (HTTP rewards only)

        if self._session is None:
            self._session = deadline_session()
        auth = _BearerAuth(self._token) if self._token else None
        with Deadline(timeout) as deadline:
            try:
                # no redirect is followed: requests would read a redirect's body whole, past any cap
                reply = self._session.post(self.url, json=body, timeout=timeout, auth=auth, stream=True,
                                           allow_redirects=False)
                try:
                    return self._read_reply(reply, where, deadline)
                finally:
                    reply.close()  # a body read to its end keeps the connection; any other is dropped
            except (requests.RequestException, TimeoutError) as exc:
                if deadline.expired or isinstance(exc, (requests.Timeout, TimeoutError)):
                    why = "no complete reply by then" if deadline.expired else type(exc).__name__
                    raise _Retry(f"timed out after {timeout:.3g}s ({why})") from None
                if isinstance(exc, (requests.ConnectionError, requests.exceptions.ChunkedEncodingError)):
                    raise _Retry(f"connection failed: {type(exc).__name__}: {_transport_reason(exc)}") from None
                raise RewardError(redact_secrets(f"{where}: request failed (not retried): {type(exc).__name__}: "
                                                 f"{_transport_reason(exc)}")) from None

    def _read_reply(self, reply: Any, where: str, deadline: Any) -> bytes:
        """The body of a 200 ``reply``, or the error its status or size calls for (see :meth:`_post`)."""
        from rlhf_core.common.bounded_http import ReplyTooLarge, read_capped  # lazy: requests (HTTP rewards only)

        code = reply.status_code
        if code == 429:
            wait = _retry_after_s(reply.headers.get("Retry-After"))
            raise _Retry(f"HTTP 429 (rate limited; Retry-After {reply.headers.get('Retry-After', 'absent')!s:.40})",
                         counts=False, wait_s=wait)
        if code >= 500:
            try:
                detail = _excerpt(read_capped(reply, self.max_response_bytes, deadline).decode("utf-8", "replace"))
            except ReplyTooLarge as exc:
                detail = f"(its body {exc}; not quoted)"
            raise _Retry(f"HTTP {code}: {detail}")
        if code != 200:  # the body is not read, nor quoted: a 4xx page may echo the request, credentials and all
            raise RewardError(redact_secrets(f"{where}: HTTP {code} {reply.reason or ''}".rstrip()[:200]
                                             + f" (not retried){_STATUS_HINTS.get(code, '')}"))
        try:
            return read_capped(reply, self.max_response_bytes, deadline)
        except ReplyTooLarge as exc:
            raise RewardError(redact_secrets(f"{where}: reply {exc} (reward.max_response_bytes); refused, not "
                                             "retried")) from None

    @staticmethod
    def _parse(data: bytes, n: int, where: str) -> list[float]:
        payload = _loads(data, where)
        if not isinstance(payload, dict) or "rewards" not in payload:
            raise RewardError(redact_secrets(f"{where}: reply has no 'rewards' field: {_excerpt(str(payload))}"))
        rewards = payload["rewards"]
        if isinstance(rewards, list):  # JSON true is no number, though Python's bool is one
            flag = next((i for i, v in enumerate(rewards) if isinstance(v, bool)), None)
            if flag is not None:
                raise RewardError(redact_secrets(f"{where}: sample {flag}: reward {rewards[flag]!r} is not a number"))
        try:
            return validate_rewards(rewards, n, where)
        except RewardError as exc:  # a reward value is quoted: the server chose it
            raise RewardError(redact_secrets(str(exc))) from None


def _loads(data: bytes, where: str) -> Any:
    """A reply body as strict JSON (:func:`rlhf_core.common.bounded_http.loads_strict`), else a :class:`RewardError`
    saying why, with a redacted excerpt."""
    from rlhf_core.common.bounded_http import loads_strict  # lazy: requests (HTTP rewards only)

    try:
        return loads_strict(data)
    except ValueError as exc:  # json.JSONDecodeError, UnicodeDecodeError, NaN/Infinity, deep nesting
        reason = str(exc).split(":")[0][:80] if isinstance(exc, UnicodeDecodeError) else str(exc)[:120]
        raise RewardError(redact_secrets(f"{where}: reply is not JSON ({reason}): "
                                         f"{_excerpt(data.decode('utf-8', 'replace'))!r}")) from None


class _BearerAuth:
    """``Authorization: Bearer <token>`` as a requests auth hook: passed as ``auth=``, it also
    stops requests from applying ``~/.netrc`` or URL credentials over the header (and no
    redirect is followed, so it never travels to another host)."""

    def __init__(self, token: str):
        self.token = token

    def __call__(self, request: Any) -> Any:
        request.headers["Authorization"] = f"Bearer {self.token}"
        return request

    def __repr__(self) -> str:  # never the token, in a traceback's locals or a debugger
        return "_BearerAuth(***)"


# --------------------------------------------------------------------------------------
# The one place a kind becomes a source
# --------------------------------------------------------------------------------------


def build_reward_source(kind: RewardKind | str, *, path: str | Path | None = None, url: str | None = None,
                        device: torch.device | str | None = None, batch_size: int = 64,
                        timeout_s: float = 30.0, retries: int = 3, backoff_s: float = 1.0,
                        backoff_cap_s: float = 30.0, deadline_s: float = 300.0, token_env: str = "",
                        max_response_bytes: int | None = None, attention: str = "auto") -> RewardSource:
    """The reward source of ``kind``: ``model`` and ``function`` need ``path`` (a model loads with ``attention``,
    :func:`rlhf_core.models.loading.attn_implementation`), ``http`` needs ``url`` (and takes the retry, deadline,
    ``token_env`` and reply-size options of :class:`HttpRewardSource`)."""
    try:
        kind = RewardKind(kind)
    except ValueError:
        raise ValueError(f"reward kind {kind!r}: expected one of {[k.value for k in RewardKind]}") from None
    if kind is RewardKind.HTTP:
        if not url:
            raise ValueError("reward kind 'http' needs a url")
        return HttpRewardSource(url, timeout_s=timeout_s, retries=retries, backoff_s=backoff_s,
                                backoff_cap_s=backoff_cap_s, deadline_s=deadline_s, token_env=token_env,
                                max_response_bytes=DEFAULT_MAX_RESPONSE_BYTES if max_response_bytes is None
                                else max_response_bytes)
    if not path:
        raise ValueError(f"reward kind '{kind.value}' needs a path")
    if kind is RewardKind.MODEL:
        return RewardModelSource(path, device=device, batch_size=batch_size, attention=attention)
    return FunctionRewardSource(str(path))
