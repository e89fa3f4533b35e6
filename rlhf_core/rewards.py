"""Reward sources for online RL: a reward model, a reward function file, or an HTTP endpoint.

Each is a :class:`RewardSource` — ``source(prompts, completions, labels) -> list[float]``,
one reward per sample — so a trainer never knows where rewards come from. The config picks
one with :class:`RewardKind` and :func:`build_reward_source`:

* ``model``: a trained reward model directory (``alignflow reward``), scores normalised;
* ``function``: ``path/to/file.py:function`` with the same signature (the embedded task's
  rule is ``rlhf_core/rewards_embedded.py:reward``);
* ``http``: a server answering ``POST {"prompts", "completions", "labels"}`` with
  ``{"rewards": [...]}`` — e.g. ``alignflow serve-rm`` (:mod:`rlhf_core.reward_server`).

Every reply is checked (one finite number per sample) and every failure raises
:class:`RewardError` saying which source, which sample and why.
"""

from __future__ import annotations

import enum
import hashlib
import importlib.util
import json
import math
import numbers
import sys
import time
from pathlib import Path
from typing import Any, Callable, Protocol, Sequence, runtime_checkable

import torch

from rlhf_core.redact import redact_secrets


class RewardError(RuntimeError):
    """A reward source that failed or answered something other than one finite number per sample."""


@runtime_checkable
class RewardSource(Protocol):
    """One reward per ``(prompt, completion, label)``; ``labels`` entries may be ``None``."""

    @property
    def name(self) -> str:
        """Where rewards come from, for logs (``model:/path``, ``function:file.py:fn``, ``http:url``)."""
        ...

    def __call__(self, prompts: Sequence[str], completions: Sequence[str],
                 labels: Sequence[str | None]) -> list[float]:
        ...


class RewardKind(str, enum.Enum):
    """Where rewards come from (config field ``reward_kind``)."""

    MODEL = "model"
    FUNCTION = "function"
    HTTP = "http"

    @property
    def loads_model(self) -> bool:
        """Whether the source holds model weights in this process (and wants a device)."""
        return self is RewardKind.MODEL


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
            raise RewardError(f"{where}: sample {i}: reward {v!r} is not a number")
        if not math.isfinite(v):
            raise RewardError(f"{where}: sample {i}: reward {v!r} is not finite")
        out.append(float(v))
    return out


# --------------------------------------------------------------------------------------
# A trained reward model
# --------------------------------------------------------------------------------------


class RewardModelSource:
    """Normalised scores of a reward model directory (see :mod:`rlhf_core.reward_model`); labels unused."""

    def __init__(self, path: str | Path, device: torch.device | str | None = None, batch_size: int = 64,
                 max_length: int = 256):
        from rlhf_core.models import load_tokenizer
        from rlhf_core.reward_model import load_reward_model

        self.path = Path(path)
        self.model = load_reward_model(self.path, torch.device(device) if isinstance(device, str) else device)
        self.tokenizer = load_tokenizer(self.path)
        self.batch_size, self.max_length = batch_size, max_length

    @property
    def name(self) -> str:
        return f"model:{self.path}"

    def __call__(self, prompts: Sequence[str], completions: Sequence[str],
                 labels: Sequence[str | None]) -> list[float]:
        from rlhf_core.reward_model import score

        _check_inputs(self.name, prompts, completions, labels)
        if not prompts:
            return []
        values = score(self.model, self.tokenizer, list(prompts), list(completions),
                       batch_size=self.batch_size, max_length=self.max_length)
        return validate_rewards(values, len(prompts), self.name)


# --------------------------------------------------------------------------------------
# A reward function file
# --------------------------------------------------------------------------------------


INSTALL_ROOT = Path(__file__).resolve().parents[1]
"""The folder holding ``rlhf_core/``: where the shipped reward files live."""


def resolve_reward_file(file_part: str) -> Path:
    """A reward file's path: as given (relative to the working directory), else, for a
    relative path that does not exist there, relative to the alignflow installation — so
    the shipped ``rlhf_core/rewards_embedded.py`` is found from any project folder."""
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
    path = resolve_reward_file(file_part)
    if path.suffix != ".py":
        raise RewardError(f"reward function {spec!r}: {file_part} is not a .py file")
    if not path.is_file():
        raise RewardError(f"reward function {spec!r}: file {path} not found")
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


class HttpRewardSource:
    """Rewards from ``POST url`` with ``{"prompts", "completions", "labels"}`` → ``{"rewards": [...]}``.

    Timeouts, connection errors and 5xx replies are retried ``retries`` times (so at most
    ``retries + 1`` attempts), sleeping ``backoff_s * 2**k`` before retry ``k``; a 4xx reply
    or a malformed 200 is a bug, not a blip, and fails at once. ``timeout_s`` bounds the
    connect and each read of the reply (requests' semantics), not the whole exchange.
    """

    def __init__(self, url: str, timeout_s: float = 30.0, retries: int = 3, backoff_s: float = 1.0):
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"HttpRewardSource: url must start with http:// or https://, got {url!r}")
        if timeout_s <= 0:
            raise ValueError(f"HttpRewardSource: timeout_s must be > 0, got {timeout_s}")
        if retries < 0:
            raise ValueError(f"HttpRewardSource: retries must be >= 0, got {retries}")
        if backoff_s < 0:
            raise ValueError(f"HttpRewardSource: backoff_s must be >= 0, got {backoff_s}")
        self.url, self.timeout_s, self.retries, self.backoff_s = url, timeout_s, retries, backoff_s
        self._session: Any = None  # made on first use: one keep-alive connection across calls

    @property
    def name(self) -> str:
        return f"http:{redact_secrets(self.url)}"  # names appear in logs and MLflow: no credentials

    def __call__(self, prompts: Sequence[str], completions: Sequence[str],
                 labels: Sequence[str | None]) -> list[float]:
        import requests

        where = f"reward server {redact_secrets(self.url)}"
        _check_inputs(where, prompts, completions, labels)
        body = {"prompts": list(prompts), "completions": list(completions), "labels": list(labels)}
        attempts, last = self.retries + 1, ""
        for attempt in range(1, attempts + 1):
            if attempt > 1:
                time.sleep(self.backoff_s * 2 ** (attempt - 2))
            if self._session is None:
                self._session = requests.Session()
            try:
                reply = self._session.post(self.url, json=body, timeout=self.timeout_s)
            except requests.Timeout as exc:
                last = f"timed out after {self.timeout_s}s ({type(exc).__name__})"
                continue
            except requests.ConnectionError as exc:
                last = f"connection failed: {exc}"
                continue
            if reply.status_code >= 500:
                last = f"HTTP {reply.status_code}: {reply.text[:200]}"
                continue
            if reply.status_code != 200:
                raise RewardError(f"{where}: HTTP {reply.status_code} (not retried): {reply.text[:500]}")
            try:
                payload = reply.json()
            except json.JSONDecodeError:
                raise RewardError(f"{where}: reply is not JSON: {reply.text[:200]!r}") from None
            if not isinstance(payload, dict) or "rewards" not in payload:
                raise RewardError(f"{where}: reply has no 'rewards' field: {str(payload)[:200]}")
            return validate_rewards(payload["rewards"], len(prompts), where)
        raise RewardError(f"{where}: failed after {attempts} attempts; last error: {last}")


# --------------------------------------------------------------------------------------
# The one place a kind becomes a source
# --------------------------------------------------------------------------------------


def build_reward_source(kind: RewardKind | str, *, path: str | Path | None = None, url: str | None = None,
                        device: torch.device | str | None = None, batch_size: int = 64,
                        timeout_s: float = 30.0, retries: int = 3, backoff_s: float = 1.0) -> RewardSource:
    """The reward source of ``kind``: ``model`` and ``function`` need ``path``, ``http`` needs ``url``."""
    try:
        kind = RewardKind(kind)
    except ValueError:
        raise ValueError(f"reward kind {kind!r}: expected one of {[k.value for k in RewardKind]}") from None
    if kind is RewardKind.HTTP:
        if not url:
            raise ValueError("reward kind 'http' needs a url")
        return HttpRewardSource(url, timeout_s=timeout_s, retries=retries, backoff_s=backoff_s)
    if not path:
        raise ValueError(f"reward kind '{kind.value}' needs a path")
    if kind is RewardKind.MODEL:
        return RewardModelSource(path, device=device, batch_size=batch_size)
    return FunctionRewardSource(str(path))
