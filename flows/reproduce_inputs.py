"""The inputs of a run that ``alignflow reproduce RUN_ID`` reruns: the data it read, by md5, never today's.

A run records each input's path (project-relative inside the project, absolute outside it:
:func:`rlhf_core.tracking.lineage.project_relative`) and its DVC md5 (``dvc.md5.<name>`` tags). The
rerun runs in a worktree of the run's commit, where each input inside the project is put
exactly as the run read it:

1. the commit's own file (git-tracked), when its md5 is the recorded one;
2. else the content of the recorded md5 from the project's DVC cache (a file, or a folder with
   every file its ``.dir`` listing names);
3. else fetched from the DVC remote (``dvc fetch`` of that path at the commit), then as in 2.

An input outside the project (a ``--base-model`` elsewhere) is read where it is, after its md5
is checked against the recorded one. The working copy is never read: data edited since the run
(committed or not) does not reach the rerun. An input found nowhere with its recorded md5 stops
the reproduction before anything runs, naming it.

Used by :mod:`flows.reproduce`; imports nothing of it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from flows.reproduce_trust import inside
from rlhf_core.tracking.lineage import dvc_md5, project_relative, restore_from_cache

ALIGN_INPUTS = {"sft_file": ("sft", "--sft-file"), "preference_file": ("preferences", "--preference-file"),
                "prompts_file": ("prompts", "--prompts-file"), "eval_file": ("eval", "--eval-file"),
                "base_model": ("model_base", "--base-model")}
"""``reproduce.json`` input -> (the name in its ``dvc.md5.*`` / ``input.*`` tags, the flow's flag)."""
CYCLE_INPUTS = ("prompts", "eval", "start_model")
"""The inputs an iterative flow tags (``input.<name>``, ``dvc.md5.<name>``); their paths come from its params."""


@dataclass(frozen=True)
class RecordedInput:
    """One input as the run recorded it: ``path`` project-relative (inside) or absolute (outside),
    ``md5`` its DVC md5 (None for a run that recorded none), ``flag`` the flow's option, if any."""

    name: str
    path: str
    md5: str | None
    flag: str | None = None

    @property
    def outside(self) -> bool:
        return os.path.isabs(self.path)


def recorded_inputs(flow: str, inputs: dict[str, Any], tags: dict[str, str], project: Path) -> list[RecordedInput]:
    """The run's inputs: the align flow's given files (``reproduce.json``), an iterative flow's tagged
    ones. A path recorded absolute under ``project`` is read as project-relative."""
    out = []
    if flow == "align":
        for name, (tag, flag) in ALIGN_INPUTS.items():
            value = inputs.get(name)
            if value is None:
                continue
            if not isinstance(value, str) or not value:
                raise SystemExit(f"reproduce: reproduce.json: inputs.{name}: expected a path, got {value!r}")
            out.append(RecordedInput(name, project_relative(value, project), tags.get(f"dvc.md5.{tag}"), flag))
    else:
        for name in CYCLE_INPUTS:
            if tags.get(f"input.{name}"):
                out.append(RecordedInput(name, project_relative(tags[f"input.{name}"], project),
                                         tags.get(f"dvc.md5.{name}")))
    return out


def _refuse(inp: RecordedInput, why: str) -> SystemExit:
    return SystemExit(f"reproduce: input {inp.name} ({inp.path}): {why}; nothing was rerun")


def place_input(inp: RecordedInput, worktree: Path, commit: str, cache_root: Path | None,
                fetch: Callable[[str], None]) -> str:
    """Put ``inp`` where the rerun reads it (see the module docstring); returns where it came from."""
    if inp.outside:
        now = dvc_md5(inp.path) if Path(inp.path).exists() else None
        if inp.md5 is not None and now != inp.md5:
            raise _refuse(inp, f"the run read md5 {inp.md5}; that path now holds "
                               f"{'md5 ' + now if now else 'nothing'}")
        return "in place, outside the project" + ("" if inp.md5 else " (no md5 recorded: not checked)")
    if not inside(worktree, inp.path):
        raise _refuse(inp, "resolves outside the rerun's worktree")
    target = worktree / inp.path
    if inp.md5 is None:  # a run from before md5s were recorded: the commit's file as it is
        if target.exists():
            return f"commit {commit[:12]} (no md5 recorded: not checked)"
        raise _refuse(inp, f"no md5 recorded and commit {commit[:12]} has no such file")
    if target.exists() and dvc_md5(target, cache=False) == inp.md5:
        return f"commit {commit[:12]}"
    if cache_root is not None and restore_from_cache(cache_root, inp.md5, target):
        return "the DVC cache"
    if cache_root is not None:
        fetch(inp.path)
        if restore_from_cache(cache_root, inp.md5, target):
            return "the DVC remote"
    raise _refuse(inp, f"the run read md5 {inp.md5}, which neither commit {commit[:12]} nor the project's DVC "
                       "cache or remote holds (version data with `dvc add`, commit and `dvc push` before a run "
                       "to make it reproducible)")


def place_inputs(inputs: list[RecordedInput], worktree: Path, commit: str, cache_root: Path | None,
                 fetch: Callable[[str], None]) -> dict[str, str]:
    """:func:`place_input` for each input; returns ``{name: where it came from}``. ``fetch(path)`` brings
    the content the commit's DVC files name for ``path`` into the cache from the remote (best effort)."""
    return {inp.name: place_input(inp, worktree, commit, cache_root, fetch) for inp in inputs}
