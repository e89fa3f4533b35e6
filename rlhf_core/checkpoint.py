"""Checkpoints that resume a run exactly: weights, optimizer, schedule, RNG, data position.

A checkpoint is ``<checkpoint_dir>/step-0000040/``: an HF directory (safetensors weights and
tokenizer) plus ``trainer_state.pt`` holding everything else as tensors and plain Python
values, so it is read back with ``torch.load(weights_only=True)`` — never arbitrary pickle.
Both are written into a temporary folder that is renamed into place, so a crash mid-write
leaves no half checkpoint under a ``step-*`` name; one that is unreadable anyway (a disk
fault, a copy cut short) is skipped with a warning and the previous one is used.

Each checkpoint carries the run's *fingerprint* (its config and the size and mtime of every
input path), and a run only resumes from a checkpoint with its own fingerprint: a changed
config or dataset starts over instead of silently continuing someone else's run.
Checkpoints exist to resume an interrupted run; :meth:`Checkpointer.clear` removes them once
the run has saved its final model (they would otherwise be resumed by the next, identical run
even after a code change).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import random
import shutil
import signal
import threading
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import torch

from rlhf_core.config import config_to_dict

log = logging.getLogger(__name__)

STATE_FILE = "trainer_state.pt"
# 2: the loop's evaluation metrics are ``loop.eval_metrics`` for every trainer (one checkpointed loop).
# A checkpoint of another format is skipped (the run starts over) rather than misread.
FORMAT_VERSION = 2

# Config fields that decide where or how often state is written, not what is computed.
_NOT_FINGERPRINTED = frozenset({"resume", "save_every", "keep_checkpoints", "checkpoint_dir", "output_dir",
                                "eval_every"})


class TrainingInterrupted(RuntimeError):
    """SIGTERM arrived; a checkpoint of the last finished step was written before stopping."""


# --------------------------------------------------------------------------------------
# What identifies a run
# --------------------------------------------------------------------------------------


def _path_signature(value: str) -> list[Any] | None:
    """(name, size, mtime_ns) of a file, or of every file under a folder; None if not a path."""
    if not value or len(value) > 4096:
        return None
    path = Path(value)
    try:
        if path.is_file():
            st = path.stat()
            return [[path.name, st.st_size, st.st_mtime_ns]]
        if path.is_dir():
            return [[str(p.relative_to(path)), p.stat().st_size, p.stat().st_mtime_ns]
                    for p in sorted(path.rglob("*")) if p.is_file()]
    except OSError:
        return None
    return None


def run_fingerprint(cfg: Any) -> str:
    """sha256 of the config (less the fields in ``_NOT_FINGERPRINTED``) and of its input paths' stats.

    Stats, not content hashes: a multi-GB model would otherwise be read at every start. A
    false mismatch (a touched file) only costs a fresh start; DVC's md5s guard outputs.
    """
    params = {k: v for k, v in config_to_dict(cfg).items() if k not in _NOT_FINGERPRINTED}
    inputs = {k: sig for k, v in params.items() if isinstance(v, str) and (sig := _path_signature(v)) is not None}
    blob = json.dumps({"params": params, "inputs": inputs}, sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()


# --------------------------------------------------------------------------------------
# RNG state as tensors and plain values (weights_only-loadable)
# --------------------------------------------------------------------------------------


def rng_state() -> dict[str, Any]:
    """python, numpy and torch (CPU and every CUDA device) generator states."""
    version, internal, gauss = random.getstate()
    key, keys, pos, has_gauss, cached = np.random.get_state()
    state: dict[str, Any] = {
        "python": {"version": version, "state": torch.tensor(internal, dtype=torch.int64), "gauss": gauss},
        "numpy": {"key": key, "keys": torch.from_numpy(keys.astype(np.int64)), "pos": int(pos),
                  "has_gauss": int(has_gauss), "cached": float(cached)},
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    """Inverse of :func:`rng_state`."""
    py = state["python"]
    random.setstate((py["version"], tuple(int(x) for x in py["state"].tolist()), py["gauss"]))
    npy = state["numpy"]
    np.random.set_state((npy["key"], npy["keys"].numpy().astype(np.uint32), npy["pos"], npy["has_gauss"],
                         npy["cached"]))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


# --------------------------------------------------------------------------------------
# Weights
# --------------------------------------------------------------------------------------


def load_weights(model: torch.nn.Module, directory: str | Path) -> None:
    """Load the safetensors weights of an HF directory into ``model`` in place.

    ``save_pretrained`` stores a tied parameter once (e.g. the LM head shares the embedding),
    so a missing key is accepted only when it shares storage with a loaded one.
    """
    from safetensors.torch import load_file

    files = sorted(Path(directory).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{directory}: no *.safetensors weights in this checkpoint")
    weights: dict[str, torch.Tensor] = {}
    for f in files:
        weights.update(load_file(str(f)))
    missing, unexpected = model.load_state_dict(weights, strict=False)
    params = model.state_dict(keep_vars=True)
    loaded_ptrs = {params[k].data_ptr() for k in weights if k in params}
    untied = [k for k in missing if params[k].data_ptr() not in loaded_ptrs]
    if untied or unexpected:
        raise ValueError(f"{directory}: checkpoint does not match the model (missing {untied[:5]}, "
                         f"unexpected {list(unexpected)[:5]})")


# --------------------------------------------------------------------------------------
# Checkpointer
# --------------------------------------------------------------------------------------


@dataclass
class Checkpoint:
    """A readable checkpoint: its folder, step and trainer state."""

    path: Path
    step: int
    state: dict[str, Any]


class Checkpointer:
    """Writes, finds and prunes the checkpoints of one run under ``root``."""

    def __init__(self, root: str | Path, fingerprint: str, keep: int = 2):
        self.root, self.fingerprint, self.keep = Path(root), fingerprint, max(int(keep), 1)

    def save(self, step: int, model: Any, tokenizer: Any, state: dict[str, Any]) -> Path:
        """Write ``step-{step:07d}`` atomically (weights, tokenizer, ``trainer_state.pt``), keep the last K."""
        final = self.root / f"step-{step:07d}"
        tmp = self.root / f".step-{step:07d}.tmp-{os.getpid()}"
        self.root.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
        model.save_pretrained(str(tmp), safe_serialization=True)
        if tokenizer is not None:
            tokenizer.save_pretrained(str(tmp))
        payload = {"format": FORMAT_VERSION, "step": int(step), "fingerprint": self.fingerprint,
                   "rng": rng_state(), **state}
        with open(tmp / STATE_FILE, "wb") as fh:
            torch.save(payload, fh)
            fh.flush()
            os.fsync(fh.fileno())
        if final.exists():  # the same step saved again (a resumed run re-saving): replace it
            shutil.rmtree(final)
        tmp.rename(final)
        for old in self._step_dirs()[:-self.keep]:
            shutil.rmtree(old, ignore_errors=True)
        return final

    def latest(self) -> Checkpoint | None:
        """The newest readable checkpoint of this run; torn or foreign ones are skipped with a warning."""
        for path in reversed(self._step_dirs()):
            try:
                state = torch.load(path / STATE_FILE, map_location="cpu", weights_only=True)
            except Exception as exc:  # noqa: BLE001 - any unreadable state means a torn checkpoint
                log.warning("skipping torn checkpoint %s: %s", path, exc)
                continue
            if state.get("format") != FORMAT_VERSION:
                log.warning("skipping checkpoint %s: format %s, this version reads format %d", path,
                            state.get("format"), FORMAT_VERSION)
                continue
            if state.get("fingerprint") != self.fingerprint:
                log.warning("skipping checkpoint %s: written by a run with another config or inputs", path)
                continue
            if not any(path.glob("*.safetensors")):
                log.warning("skipping torn checkpoint %s: no weights", path)
                continue
            return Checkpoint(path, int(state["step"]), state)
        return None

    def clear(self) -> None:
        """Remove every checkpoint (and leftover temp folder) under ``root``."""
        for path in self._step_dirs() + sorted(self.root.glob(".step-*.tmp-*")):
            shutil.rmtree(path, ignore_errors=True)

    @contextmanager
    def hold(self, name: str) -> Iterator[None]:
        """Own ``root`` for the whole run: a second run of the stage on the same project (another
        flow started at the same time) waits here, and says so, instead of sharing checkpoints."""
        from filelock import FileLock, Timeout

        self.root.mkdir(parents=True, exist_ok=True)
        lock = FileLock(str(self.root / ".lock"))
        try:
            lock.acquire(timeout=0)
        except Timeout:
            log.warning("%s: another run is using %s; waiting for it to finish", name, self.root)
            lock.acquire()
        try:
            yield
        finally:
            lock.release()

    def _step_dirs(self) -> list[Path]:
        return sorted(p for p in self.root.glob("step-*") if p.is_dir()) if self.root.exists() else []


# --------------------------------------------------------------------------------------
# SIGTERM: finish the step, checkpoint, stop
# --------------------------------------------------------------------------------------


class StopFlag:
    """Set by SIGTERM; the loop checks it after each step."""

    def __init__(self) -> None:
        self.requested = False


@contextmanager
def sigterm_checkpoints() -> Iterator[StopFlag]:
    """While inside, SIGTERM sets the flag instead of killing the process (main thread only;
    elsewhere Python cannot install handlers and the default action stays)."""
    flag = StopFlag()
    if threading.current_thread() is not threading.main_thread():
        yield flag
        return

    def handler(signum: int, frame: Any) -> None:
        del signum, frame
        flag.requested = True

    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield flag
    finally:
        signal.signal(signal.SIGTERM, previous)
