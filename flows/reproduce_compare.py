"""How ``alignflow reproduce`` compares a run with its rerun, and the one-line verdict.

Four things are compared, each on its own:

* **weights**: the model folders (``dvc.md5.*`` tags ending in ``.dir``); a folder whose DVC md5
  matches is identical, one that does not is opened and its weight files (``*.safetensors``,
  ``*.bin``, ``*.pt``, ``*.pth``, ``*.gguf``) compared by md5;
* **metrics**: the flow run's metrics, every logged step, exactly;
* **data**: the md5 of every dataset the runs read or wrote (``dvc.md5.*`` tags naming files);
* **metadata**: a differing model folder's other files (``alignflow.json``, ``config.json``,
  tokenizer files), key by key where they are JSON.

The rule for metadata: a difference is **ignored** (listed, not counted) only when both values
name the same project-relative path, one side's absolute path lying under its own project folder
(the original project, or the rerun's worktree): it says where the project was, not what ran.
Every other difference counts, a file on one side only included.

The verdict is one line: ``IDENTICAL``, or ``DIFFERENT: `` and the first counted differences.
Pure: no MLflow, git or DVC calls; :mod:`flows.reproduce` gathers what is compared.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from rlhf_core.tracking.lineage import cache_object, cached_listing, dir_listing, project_relative

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")
SAME_PLACE = "the same project-relative path, under each side's own project folder"
KINDS = ("weights", "metrics", "data", "metadata", "registry")


@dataclass(frozen=True)
class Difference:
    """One thing that differs: ``kind`` (one of :data:`KINDS`), what it is, both values, and why it is
    ignored (metadata only) or ``""`` when it counts."""

    kind: str
    what: str
    original: Any
    rerun: Any
    ignored: str = ""

    def line(self) -> str:
        text = f"{self.kind} {self.what}: {_show(self.original)} (original) != {_show(self.rerun)} (rerun)"
        return f"{text}  [ignored: {self.ignored}]" if self.ignored else text


def _show(value: Any) -> str:
    text = value if isinstance(value, str) and value.startswith("<") else json.dumps(value, default=str)
    return text if len(text) <= 160 else text[:157] + "..."


@dataclass
class Comparison:
    """Every difference found, and how many things of each kind were compared."""

    differences: list[Difference] = field(default_factory=list)
    compared: dict[str, int] = field(default_factory=lambda: dict.fromkeys(KINDS, 0))

    @property
    def counted(self) -> list[Difference]:
        return [d for d in self.differences if not d.ignored]

    @property
    def identical(self) -> bool:
        return not self.counted

    def add(self, other: "Comparison") -> "Comparison":
        self.differences += other.differences
        for kind, n in other.compared.items():
            self.compared[kind] = self.compared.get(kind, 0) + n
        return self

    def verdict(self, first: int = 3) -> str:
        """``IDENTICAL``, or ``DIFFERENT: `` with the first ``first`` counted differences."""
        counted = self.counted
        if not counted:
            return "IDENTICAL"
        more = f" (and {len(counted) - first} more)" if len(counted) > first else ""
        return "DIFFERENT: " + "; ".join(d.line() for d in counted[:first]) + more


@dataclass(frozen=True)
class Roots:
    """The project folder each side ran in: the original project, and the rerun's worktree."""

    original: Path
    rerun: Path


@dataclass(frozen=True)
class FolderView:
    """A model folder's files (relative path -> md5), readable from disk or from a DVC cache."""

    files: dict[str, str]
    folder: Path | None = None
    cache_root: Path | None = None

    def read(self, rel: str) -> bytes | None:
        path = self.folder / rel if self.folder is not None else cache_object(self.cache_root, self.files[rel])
        try:
            return path.read_bytes()
        except OSError:
            return None


def disk_view(folder: Path, cache: Any = True) -> FolderView:
    return FolderView(dir_listing(folder, cache), folder=folder)


def cache_view(cache_root: Path, md5: str) -> FolderView | None:
    """The folder ``md5`` as a DVC cache holds it, or None when the cache has no listing of it."""
    listing = cached_listing(cache_root, md5)
    return FolderView(listing, cache_root=cache_root) if listing is not None else None


# --------------------------------------------------------------------------------------
# The rules
# --------------------------------------------------------------------------------------


def is_weight(rel: str) -> bool:
    return rel.lower().endswith(WEIGHT_SUFFIXES)


def same_place(original: Any, rerun: Any, roots: Roots) -> bool:
    """The ignore rule: both are path strings naming the same project-relative path, each read against
    its own project folder (an absolute path under it made relative; a relative one normalised)."""
    if not (isinstance(original, str) and isinstance(rerun, str)) or not original or not rerun:
        return False

    def place(value: str, root: Path) -> str:
        return project_relative(value, root) if os.path.isabs(value) else Path(os.path.normpath(value)).as_posix()

    return place(original, roots.original) == place(rerun, roots.rerun)


def flatten(value: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(value, dict) and value:
        return {k: v for key, sub in value.items() for k, v in flatten(sub, f"{prefix}{key}.").items()}
    return {prefix.rstrip(".") or "(whole file)": value}


def compare_metadata(what: str, original: bytes | None, rerun: bytes | None, roots: Roots) -> list[Difference]:
    """Key-by-key differences of two versions of a metadata file (JSON), each ignored per
    :func:`same_place` or counted; a file that is not JSON is one difference, counted."""
    try:
        a, b = flatten(json.loads(original or b"")), flatten(json.loads(rerun or b""))
    except ValueError:
        return [Difference("metadata", what, "<other bytes>", "<other bytes>")] if original != rerun else []
    out = []
    for key in sorted(set(a) | set(b)):
        va, vb = a.get(key, "<absent>"), b.get(key, "<absent>")
        if va != vb:
            out.append(Difference("metadata", f"{what} {key}", va, vb, SAME_PLACE if same_place(va, vb, roots) else ""))
    return out


def compare_folder(name: str, original: FolderView, rerun: FolderView, roots: Roots) -> list[Difference]:
    """A model folder whose DVC md5 differs, file by file: weight files by md5, metadata key by key."""
    out = []
    for rel in sorted(set(original.files) | set(rerun.files)):
        a, b = original.files.get(rel), rerun.files.get(rel)
        if a == b:
            continue
        if is_weight(rel) or a is None or b is None:
            out.append(Difference("weights" if is_weight(rel) else "metadata", f"{name}/{rel}",
                                  a or "<absent>", b or "<absent>"))
        else:
            out += compare_metadata(f"{name}/{rel}", original.read(rel), rerun.read(rel), roots)
    return out


Views = Callable[[str, str, str], tuple[FolderView | None, FolderView | None]]
"""``(tag, original md5, rerun md5) -> (original's folder, rerun's folder)``, either None when unavailable."""


def compare_md5s(original: dict[str, str], rerun: dict[str, str], views: Views, roots: Roots) -> Comparison:
    """Every ``dvc.md5.*`` tag: a file's md5 is data; a folder's (``.dir``) is a model, opened when it
    differs (:func:`compare_folder`), or one counted difference when either folder cannot be read."""
    result = Comparison()
    for key in sorted(set(original) | set(rerun)):
        a, b = original.get(key, "<absent>"), rerun.get(key, "<absent>")
        kind = "weights" if a.endswith(".dir") or b.endswith(".dir") else "data"
        result.compared[kind] += 1
        if a == b:
            continue
        name = key.removeprefix("dvc.md5.")
        folders = views(key, a, b) if kind == "weights" and "<" not in a + b else (None, None)
        if folders[0] is None or folders[1] is None:
            missing = "" if kind == "data" else " (a folder's files could not be read to compare)"
            result.differences.append(Difference(kind, name + missing, a, b))
        else:
            result.differences += compare_folder(name, folders[0], folders[1], roots)
    return result


def compare_metrics(original: dict[str, list[Any]], rerun: dict[str, list[Any]]) -> Comparison:
    """Each metric's logged values (``[(step, value), ...]``), exactly; one value shown bare."""
    result = Comparison()
    for key in sorted(set(original) | set(rerun)):
        result.compared["metrics"] += 1
        a, b = original.get(key, "<absent>"), rerun.get(key, "<absent>")
        if a != b:
            shown = [v[0][1] if isinstance(v, list) and len(v) == 1 else v for v in (a, b)]
            result.differences.append(Difference("metrics", key, *shown))
    return result


def compare_registry(before: dict[str, Any], after: dict[str, Any]) -> Comparison:
    """The registered models a rerun could touch, before and after it: any change counts."""
    result = Comparison()
    for name in sorted(set(before) | set(after)):
        result.compared["registry"] += 1
        if before.get(name) != after.get(name):
            result.differences.append(Difference("registry", f"{name} (changed by the rerun)",
                                                 before.get(name), after.get(name)))
    return result


# --------------------------------------------------------------------------------------
# The report
# --------------------------------------------------------------------------------------


def report_fields(comparison: Comparison) -> dict[str, Any]:
    """The report's verdict fields: counts compared, counted and ignored differences, the verdict line."""
    per_kind = {kind: {"compared": comparison.compared.get(kind, 0),
                       "different": sum(d.kind == kind for d in comparison.counted),
                       "ignored": sum(d.kind == kind and bool(d.ignored) for d in comparison.differences)}
                for kind in KINDS}
    return {"compared": per_kind, "differences": [d.line() for d in comparison.counted],
            "ignored": [d.line() for d in comparison.differences if d.ignored],
            "identical": comparison.identical, "verdict": comparison.verdict()}


def _kind_line(kind: str, counts: dict[str, int]) -> str | None:
    """One line per kind compared: how many, and how many differ (counted) or were ignored."""
    n, different, ignored = counts["compared"], counts["different"], counts["ignored"]
    if kind == "metadata":
        return f"{different} difference(s) counted, {ignored} ignored" if different or ignored else "no difference"
    if not n:
        return None
    what = {"weights": "model folder(s)", "metrics": "metric(s)", "data": "dataset md5(s)",
            "registry": "registered model(s)"}[kind]
    state = ("unchanged: no version registered, no alias moved" if kind == "registry" else "identical") \
        if not different else f"{different} difference(s)"
    return f"{n} {what}, {state}"


def render(result: dict[str, Any]) -> str:
    """The report as printed (a run's or a revision's, :func:`report_fields` among its keys); its last line is
    the verdict."""
    lines = [f"warning: {w}" for w in result["warnings"]]
    rerun = f", rerun {result['rerun_id']}" if result.get("rerun_id") else ""
    lines.append(f"reproduce {result['target']} ({result['flow']} at {result['commit'][:12]}{rerun}):")
    if result.get("task_states"):
        lines.append("  rerun task states: " + ", ".join(f"{k} {v}" for k, v in sorted(result["task_states"].items())))
    for kind in KINDS:
        line = _kind_line(kind, result["compared"][kind])
        if line:
            lines.append(f"  {kind + ':':<10}{line}")
    for line in result["differences"]:
        lines.append(f"  DIFFERENT {line}")
    for line in result["ignored"]:
        lines.append(f"  ignored   {line}")
    if result.get("rerun_id"):
        lines.append(f"  recorded: tags alignflow.reproduced_by and alignflow.reproduction on run {result['target']}")
    lines.append(result["verdict"])
    return "\n".join(lines)
