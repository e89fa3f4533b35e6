"""Checkpoints that resume a run exactly: weights, optimizer, schedule, RNG, data position.

A checkpoint is ``<checkpoint_dir>/step-0000040/``: an HF directory (safetensors weights and
tokenizer) plus ``trainer_state.pt`` holding everything else as tensors and plain Python
values, so it is read back with ``torch.load(weights_only=True)`` — never arbitrary pickle.

Durable: every file is written into a temporary folder (a unique ``.step-*.tmp-<pid>-<random>``
name), fsynced, listed with its size and sha256 in ``manifest.json`` (written last, fsynced),
then the folder is fsynced and renamed into place and the parent fsynced; older checkpoints
are pruned only after that. A crash mid-write leaves no half checkpoint under a ``step-*``
name, and one that is damaged anyway (a disk fault, a copy cut short, no manifest) fails
verification in :meth:`Checkpointer.latest`, is skipped with a warning naming what failed,
and the previous one is used. Temp folders are removed in ``finally`` on failure and swept
when a run takes the checkpoint folder's lock (those of killed runs).

Each checkpoint carries the run's *fingerprint* (its config, the size and mtime of every
input path, the bytes of every ``file.py:function`` the config names, and the training
core's code), and a run only resumes from a checkpoint with its own fingerprint and format:
a changed config, dataset, reward function or trainer starts over instead of silently
continuing someone else's run.

Once the final model is saved the loop writes ``finished.json`` beside the checkpoints: the run's
fingerprint, the output folder and its DVC md5, and what the loop hands back (evaluation
metrics and samples, timings, the trainer's result metrics). The stage that ran the loop tracks
and registers the model, then calls :meth:`Checkpointer.clear`, which removes the checkpoints and
the record. A retry of a stage that failed in between (the tracking server went away before the
model was registered) finds the record (:meth:`Checkpointer.finished`) and reuses the output
instead of training again, as long as the output is still the one recorded.

A full, read-only or forbidden disk (ENOSPC, EDQUOT, EROFS, EACCES) while writing raises
:class:`StorageError`, a permanent error: retrying cannot help until someone frees space or
fixes the mount.
"""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import os
import random
import re
import secrets
import shutil
import signal
import threading
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np
import torch
from filelock import FileLock, Timeout
from safetensors.torch import load_file

from rlhf_core.common.atomic_io import fsync_path, write_text_atomic
from rlhf_core.config import config_params
from rlhf_core.distributed.parallel import assign_weights
from rlhf_core.rewards.sources import resolve_reward_file
from rlhf_core.tracking.lineage import core_fingerprint, dvc_md5, file_sha256
from rlhf_core.tracking.manifest import read_manifest, verify_manifest, write_manifest

log = logging.getLogger(__name__)

STATE_FILE = "trainer_state.pt"
FINISHED_FILE = "finished.json"
# 2: the loop's evaluation metrics are ``loop.eval_metrics`` for every trainer (one checkpointed loop).
# 3: optimizer state by parameter name, whole tensors (any strategy and world size); ``rng_ranks``.
# A checkpoint of another format is skipped (the run starts over) rather than misread.
FORMAT_VERSION = 3

# Config fields that decide where or how often state is written, not what is computed.
_NOT_FINGERPRINTED = frozenset({"resume", "save_every", "keep_checkpoints", "checkpoint_dir", "output_dir",
                                "eval_every",
                                # how the work is spread, not what is computed: a checkpoint holds whole
                                # tensors by name, so a run may resume on fewer or more workers (the
                                # sums then differ in float rounding order only)
                                "num_workers", "parallel", "offload_optimizer", "num_threads",
                                "distribution.placement", "distribution.rollout_workers"})


class TrainingInterrupted(RuntimeError):
    """SIGTERM arrived; a checkpoint of the last finished step was written before stopping."""


class StorageError(OSError):
    """A checkpoint or model could not be written: the disk is full or read-only, or the path is not
    writable. Permanent (a retry meets the same disk); the message names the path and what to do."""


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


# A config value naming code to run: ``path/to/file.py:function`` (e.g. ``rl.reward.function``).
_CODE_SPEC = re.compile(r"^(?P<file>[^:]+\.py):(?P<function>[A-Za-z_][A-Za-z0-9_]*)$")


def _code_file_signature(spec: str) -> str | None:
    """sha256 of the file a ``file.py:function`` value names (``"missing"`` if absent); None if not such a value.

    Contents, not stats: the file is small, and an edited reward function must not continue a run
    that was scored by the old one.
    """
    match = _CODE_SPEC.match(spec)
    if match is None:
        return None
    path = resolve_reward_file(match["file"])
    return file_sha256(path) if path.is_file() else "missing"


def run_fingerprint(cfg: Any) -> str:
    """sha256 of the config (less the fields in ``_NOT_FINGERPRINTED``), its input paths' stats, the
    contents of every ``file.py:function`` it names, and the training core's code
    (:func:`rlhf_core.tracking.lineage.core_fingerprint`: package version and ``rlhf_core`` source hash).

    Stats, not content hashes, for data and models: a multi-GB model would otherwise be read at
    every start. A false mismatch (a touched file) only costs a fresh start; DVC's md5s guard outputs.
    """
    params = {k: v for k, v in config_params(cfg).items() if k not in _NOT_FINGERPRINTED}
    inputs = {k: sig for k, v in params.items() if isinstance(v, str) and (sig := _path_signature(v)) is not None}
    code = {k: sig for k, v in params.items() if isinstance(v, str) and (sig := _code_file_signature(v)) is not None}
    blob = json.dumps({"params": params, "inputs": inputs, "code_files": code, "core": core_fingerprint()},
                      sort_keys=True, default=str)
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


def read_weights(directory: str | Path) -> dict[str, torch.Tensor]:
    """Every tensor of an HF directory's ``*.safetensors`` files (on the CPU)."""
    files = sorted(Path(directory).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{directory}: no *.safetensors weights in this checkpoint")
    weights: dict[str, torch.Tensor] = {}
    for f in files:
        weights.update(load_file(str(f)))
    return weights


def load_weights(model: torch.nn.Module, directory: str | Path) -> None:
    """Load the safetensors weights of an HF directory into a plain (unpartitioned) ``model`` in place;
    a model under a data-parallel strategy loads through ``Strategy.load_weights`` instead."""
    assign_weights(model, read_weights(directory), str(directory))


# --------------------------------------------------------------------------------------
# Durable writes: fsync, unique temp names, stale-temp sweeps, storage faults
# --------------------------------------------------------------------------------------

# Storage faults a retry cannot fix, and what the user does about each.
_STORAGE_ADVICE = {
    errno.ENOSPC: "free space on that filesystem or point the path at a larger one",
    errno.EDQUOT: "free space within the disk quota, raise the quota, or point the path elsewhere",
    errno.EROFS: "the filesystem is mounted read-only: remount it writable or point the path elsewhere",
    errno.EACCES: "make the folder writable by this user or point the path elsewhere",
}
# ``.<name>.tmp-<pid>-<random>`` (being written) and ``.<name>.old-<pid>-<random>`` (the previous
# version, moved aside for a moment); names without the random part are from older versions.
_TEMP_NAME = re.compile(r"^\.(?P<name>.+)\.(?P<kind>tmp|old)-(?P<pid>\d+)(?:-[0-9a-f]+)?$")


def storage_errno(exc: BaseException) -> int | None:
    """The errno of a storage fault behind ``exc`` (one of ``_STORAGE_ADVICE``), else None.

    Writers do not all raise OSError: safetensors' Rust writer raises ``SafetensorError(... (os
    error 28))`` and ``torch.save`` a RuntimeError whose context is the file handle's OSError, so
    the cause chain and the OS's own wording are both read.
    """
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, OSError) and current.errno in _STORAGE_ADVICE:
            return current.errno
        text = str(current)
        for code in _STORAGE_ADVICE:
            if f"(os error {code})" in text or os.strerror(code) in text:
                return code
        current = current.__cause__ or current.__context__
    return None


@contextmanager
def storage_guard(path: str | Path, what: str) -> Iterator[None]:
    """Re-raise a storage fault inside as :class:`StorageError` naming ``path`` and what to do."""
    try:
        yield
    except StorageError:
        raise
    except Exception as exc:
        code = storage_errno(exc)
        if code is None:
            raise
        raise StorageError(code, f"{what} {path}: {os.strerror(code)} ({errno.errorcode[code]}); "
                                 f"{_STORAGE_ADVICE[code]}. Not retried: a retry would meet the same disk") from exc


def temp_sibling(path: Path, kind: str = "tmp") -> Path:
    """``.<name>.<kind>-<pid>-<random>`` beside ``path``: unique per writer, and the pid tells a sweep
    whether its writer is still alive."""
    return path.with_name(f".{path.name}.{kind}-{os.getpid()}-{secrets.token_hex(4)}")


def fsync_tree(root: Path) -> None:
    """fsync every file under ``root``, then every directory, deepest first."""
    for dirpath, _dirs, files in os.walk(root, topdown=False):
        for name in files:
            fsync_path(os.path.join(dirpath, name))
        fsync_path(dirpath)


def replace_dir(src: Path, dst: Path) -> None:
    """Rename ``src`` to ``dst`` durably, replacing an existing ``dst``; ``dst`` is never missing
    for long: the old one waits under a temp name (restored by a sweep after a crash) until the new
    one is in place and the parent fsynced."""
    old = temp_sibling(dst, "old")
    if dst.exists():
        dst.rename(old)
    try:
        src.rename(dst)
    except BaseException:
        if old.exists() and not dst.exists():
            old.rename(dst)
        raise
    fsync_path(dst.parent)
    shutil.rmtree(old, ignore_errors=True)


def _pid_alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's live process
        return True
    return True


def sweep_temps(parent: Path, owns: Callable[[str], bool], *, dead_only: bool = True) -> list[Path]:
    """Remove the temp folders of killed writers under ``parent`` (of names for which ``owns(name)``);
    returns what was removed or restored.

    With ``dead_only`` only those whose writer pid is gone (on this host) are touched; without
    it every one is (the caller holds a lock that excludes other writers). An ``.old-`` folder
    whose target is missing was moved aside by a writer killed mid-replace: it is renamed back.
    """
    swept: list[Path] = []
    if not parent.is_dir():
        return swept
    for path in sorted(parent.iterdir()):
        match = _TEMP_NAME.match(path.name)
        if match is None or not owns(match["name"]) or (dead_only and _pid_alive(int(match["pid"]))):
            continue
        target = parent / match["name"]
        if match["kind"] == "old" and not target.exists():
            path.rename(target)
            log.warning("restored %s from %s (its writer was killed while replacing it)", target, path.name)
        elif path.is_dir():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)
        swept.append(path)
    if swept:
        log.warning("swept %d stale temp folder(s) under %s: %s", len(swept), parent, [p.name for p in swept])
    return swept


# --------------------------------------------------------------------------------------
# Checkpointer
# --------------------------------------------------------------------------------------


@dataclass
class Checkpoint:
    """A readable checkpoint: its folder, step and trainer state."""

    path: Path
    step: int
    state: dict[str, Any]


@dataclass
class FinishedRun:
    """A run that saved its final model (``finished.json``): its last step, its output and what the loop
    handed back (``LoopOutcome``'s fields as JSON), kept until the stage's tracking is done."""

    step: int
    output_dir: Path
    output_md5: str
    outcome: dict[str, Any]


def _is_step_name(name: str) -> bool:
    return name.startswith("step-")


class Checkpointer:
    """Writes, finds and prunes the checkpoints of one run under ``root``."""

    def __init__(self, root: str | Path, fingerprint: str, keep: int = 2):
        self.root, self.fingerprint, self.keep = Path(root), fingerprint, max(int(keep), 1)

    def save(self, step: int, model: Any, tokenizer: Any, state: dict[str, Any]) -> Path:
        """Write ``step-{step:07d}`` durably (weights, tokenizer, ``trainer_state.pt``, manifest), then keep the
        last K. A storage fault raises :class:`StorageError`; the temp folder is removed and older checkpoints
        are untouched."""
        final = self.root / f"step-{step:07d}"
        tmp = temp_sibling(final)
        try:
            with storage_guard(final, "cannot write checkpoint"):
                self.root.mkdir(parents=True, exist_ok=True)
                model.save_pretrained(str(tmp), safe_serialization=True)
                if tokenizer is not None:
                    tokenizer.save_pretrained(str(tmp))
                header = {"format": FORMAT_VERSION, "step": int(step), "fingerprint": self.fingerprint}
                with open(tmp / STATE_FILE, "wb") as fh:
                    torch.save({**header, "rng": rng_state(), **state}, fh)
                    fh.flush()
                write_manifest(tmp, header)  # fsyncs every file, the manifest and the folders
                replace_dir(tmp, final)  # a resumed run re-saving the same step replaces it
        finally:
            shutil.rmtree(tmp, ignore_errors=True)  # only still there if something above failed
        for old in self._step_dirs()[:-self.keep]:  # only now that the new one is durable
            shutil.rmtree(old, ignore_errors=True)
        return final

    def latest(self) -> Checkpoint | None:
        """The newest checkpoint of this run that verifies and loads; others are skipped with a warning."""
        for path in reversed(self._step_dirs()):
            found = self._read(path)
            if found is not None:
                return found
        return None

    def _read(self, path: Path) -> Checkpoint | None:
        """``path`` as a checkpoint of this run, or None (with a warning saying why) if it is not one."""
        try:
            manifest = read_manifest(path)
        except ValueError as exc:
            log.warning("skipping torn checkpoint %s: %s", path, exc)
            return None
        if self._foreign(path, manifest):  # decided by the manifest's header: no hashing of another run's files
            return None
        if (problem := verify_manifest(path, manifest)) is not None:
            log.warning("skipping torn checkpoint %s: %s", path, problem)
            return None
        try:
            state = torch.load(path / STATE_FILE, map_location="cpu", weights_only=True)
        except Exception as exc:  # noqa: BLE001 - any unreadable state means a torn checkpoint
            log.warning("skipping torn checkpoint %s: %s cannot be loaded: %s", path, STATE_FILE, exc)
            return None
        if not isinstance(state, dict) or isinstance(state.get("step"), bool) or not isinstance(state.get("step"), int):
            log.warning("skipping torn checkpoint %s: %s is not a trainer state (a dict with an int step)", path,
                        STATE_FILE)
            return None
        if self._foreign(path, state):
            return None
        if not any(path.glob("*.safetensors")):
            log.warning("skipping torn checkpoint %s: no weights", path)
            return None
        return Checkpoint(path, int(state["step"]), state)

    def _foreign(self, path: Path, header: dict[str, Any]) -> bool:
        """Whether ``header`` (a manifest's or a state's) is of another format or run (logged)."""
        if header.get("format") != FORMAT_VERSION:
            log.warning("skipping checkpoint %s: format %s, this version reads format %d", path,
                        header.get("format"), FORMAT_VERSION)
            return True
        if header.get("fingerprint") != self.fingerprint:
            log.warning("skipping checkpoint %s: written by a run with another config, inputs or code", path)
            return True
        return False

    def mark_finished(self, step: int, output_dir: str | Path, outcome: dict[str, Any]) -> Path:
        """Record (durably) that this run saved its final model in ``output_dir`` after ``step`` steps, with
        the output's DVC md5 and ``outcome`` (JSON: metrics, samples, timings) to hand back on reuse."""
        path = self.root / FINISHED_FILE
        record = {"format": FORMAT_VERSION, "fingerprint": self.fingerprint, "step": int(step),
                  "output_dir": str(output_dir), "output_md5": dvc_md5(output_dir), "outcome": outcome}
        with storage_guard(path, "cannot record the finished run in"):
            # default=float: a numpy or 0-d tensor metric; NaN is written as NaN, which json reads back
            write_text_atomic(path, json.dumps(record, indent=1, sort_keys=True, default=float) + "\n")
            fsync_path(path)
            fsync_path(self.root)
        return path

    def finished(self) -> FinishedRun | None:
        """This run's ``finished.json`` if its output is still the one recorded; else None (with a warning
        saying why, unless there is no record): the run trains again."""
        path = self.root / FINISHED_FILE
        if not path.is_file():
            return None
        try:
            record = json.loads(path.read_text(encoding="utf-8"))
            found = FinishedRun(int(record["step"]), Path(record["output_dir"]), str(record["output_md5"]),
                                dict(record["outcome"]))
        except (OSError, ValueError, KeyError, TypeError, OverflowError, RecursionError) as exc:
            log.warning("ignoring %s: unreadable (%s: %s); training again", path, type(exc).__name__, str(exc)[:200])
            return None
        if record.get("format") != FORMAT_VERSION or record.get("fingerprint") != self.fingerprint:
            log.warning("ignoring %s: written by a run of another format, config, inputs or code; training again",
                        path)
            return None
        if not found.output_dir.exists() or dvc_md5(found.output_dir) != found.output_md5:
            log.warning("ignoring %s: its output %s is missing or changed since (DVC md5 recorded %s); training "
                        "again", path, found.output_dir, found.output_md5)
            return None
        return found

    def clear(self) -> None:
        """Remove every checkpoint, the finished record and leftover temp files under ``root``."""
        clear_checkpoints(self.root)

    @contextmanager
    def hold(self, name: str) -> Iterator[None]:
        """Own ``root`` for the whole run: a second run of the stage on the same project (another
        flow started at the same time) waits here, and says so, instead of sharing checkpoints.
        Once held, the temp folders of killed runs are swept (no other writer can be using them)."""
        with storage_guard(self.root, f"{name}: cannot use the checkpoint folder"):
            self.root.mkdir(parents=True, exist_ok=True)
            lock = FileLock(str(self.root / ".lock"))
            try:
                lock.acquire(timeout=0)
            except Timeout:
                log.warning("%s: another run is using %s; waiting for it to finish", name, self.root)
                lock.acquire()
        try:
            sweep_temps(self.root, _is_step_name, dead_only=False)
            yield
        finally:
            lock.release()

    def bytes_held(self) -> int:
        """Bytes of the checkpoints under ``root`` now (pruned or replaced as this run saves)."""
        return sum(f.stat().st_size for d in self._step_dirs() for f in d.rglob("*") if f.is_file())

    def _step_dirs(self) -> list[Path]:
        return sorted(p for p in self.root.glob("step-*") if p.is_dir()) if self.root.exists() else []


def clear_checkpoints(root: str | Path) -> None:
    """Remove the checkpoints, the finished record (``finished.json``) and leftover temps under ``root``:
    what a stage calls once its model is tracked and registered (no fingerprint needed to delete).

    Under the folder's lock (:meth:`Checkpointer.hold`), taken without waiting: a run of the same stage
    training there now (another flow) keeps its checkpoints, and clears after itself when its stage ends.
    """
    root = Path(root)
    if not root.is_dir():
        return
    lock = FileLock(str(root / ".lock"))
    try:
        lock.acquire(timeout=0)
    except Timeout:
        log.warning("not clearing %s: another run is using it", root)
        return
    try:
        for path in root.glob("step-*"):
            if path.is_dir():
                shutil.rmtree(path, ignore_errors=True)
        for path in [root / FINISHED_FILE, *root.glob(f"{FINISHED_FILE}.tmp-*")]:  # temps: write_text_atomic's
            path.unlink(missing_ok=True)
        sweep_temps(root, _is_step_name, dead_only=False)
    finally:
        lock.release()


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
