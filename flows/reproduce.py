"""Reproduce a run from a commit: rerun every stage with the recorded params, then compare.

``alignflow reproduce RUN_ID`` (an MLflow run of ``align``, ``iterative_dpo`` or ``raft``):
checks out the run's recorded git commit into a temporary worktree, reruns the same flow
there with the exact params and inputs the run logged (its ``reproduce.json`` artifact) and
every cache bypassed (``flow.use_cache: false``: each Prefect task executes, none is
``Cached``), records the rerun in the same MLflow store (tag ``alignflow.reproduces``), and
compares the final metrics and every ``dvc.md5.*`` tag of the two parent runs.

``alignflow reproduce GIT_REV`` (a commit with a ``dvc.lock``): checks the revision out into
a worktree, fetches its DVC data from the remote where present, runs ``dvc repro --force``
(no run cache), and compares every output md5 and metrics file with the ones committed.

Prints each difference; exits 0 when everything is identical, 1 otherwise. A run whose
``git.commit`` ends in ``-dirty`` had uncommitted code: it is rerun from the commit, with a
warning that the code may differ. A run whose ``alignflow.version`` tag is not the installed
alignflow's version is rerun with the installed one (a project made by ``alignflow init`` holds
no alignflow code in its commits), with a warning too.

Nothing read from the tracking store is trusted: anyone who can write to a shared MLflow
server can edit ``reproduce.json`` or the ``git.commit`` tag. So the commit must be a hex sha
of this repository (checked with ``git rev-parse --verify``; every git command gets ``--``
or ``--end-of-options`` before a revision); the stored params are compared with the commit's
own ``params.yaml`` (plus the commit's defaults) and every difference is printed; a
difference in code (``file.py:fn``), output paths, URLs / network addresses, secret names or
tracking settings is refused unless ``--trust`` is given; and an output path that resolves
outside the worktree is refused even with ``--trust``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any, Sequence

import yaml

from rlhf_core.redact import redact_secrets

RUN_ID = re.compile(r"^[0-9a-f]{32}$")
HEX_SHA = re.compile(r"^[0-9a-f]{7,64}$")  # sha-1 or sha-256, possibly abbreviated
FLOWS = ("align", "iterative_dpo", "raft")


def _git(*args: str, cwd: str | Path = ".") -> str:
    proc = subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"reproduce: git {' '.join(args)} failed: {proc.stderr.strip()}")
    return proc.stdout.strip()


def resolve_commit(rev: str, what: str = "revision") -> str:
    """The full sha of ``rev``, which must name a commit of this repository. ``--end-of-options``
    keeps a revision such as ``--output=x`` a revision: git never reads it as an option."""
    proc = subprocess.run(["git", "rev-parse", "--verify", "--quiet", "--end-of-options", f"{rev}^{{commit}}"],
                          capture_output=True, text=True)
    sha = proc.stdout.strip()
    if proc.returncode != 0 or not HEX_SHA.match(sha):
        raise SystemExit(f"reproduce: {what} {rev!r} is not a commit of this repository")
    return sha


def add_worktree(worktree: Path, commit: str) -> None:
    """``git worktree add --detach -- <path> <commit>``: ``--`` ends the options before both."""
    _git("worktree", "add", "--detach", "--", str(worktree), commit)


def remove_worktree(worktree: Path) -> None:
    _git("worktree", "remove", "--force", "--", str(worktree))


def share_dvc_storage(worktree: Path, project: Path, env: dict[str, str]) -> None:
    """Point the worktree's DVC at the project's cache and, by absolute path, at its remotes.

    A git worktree holds no ``.dvc/cache`` (untracked), and a remote given relative to ``.dvc/``
    (the scaffold's ``../.dvc-remote``) resolves inside the worktree, where nothing was pushed:
    without this, data a user ``dvc add``-ed could not be pulled into the rerun. Written to the
    worktree's ``.dvc/config.local``, which git ignores; the commit's files are untouched.
    """
    dvc = [sys.executable, "-P", "-m", "dvc"]

    def run(*args: str, cwd: Path) -> subprocess.CompletedProcess:
        return subprocess.run([*dvc, *args], cwd=cwd, env=env, capture_output=True, text=True)

    run("cache", "dir", "--local", str((project / ".dvc" / "cache").resolve()), cwd=worktree)
    from dvc.config import Config  # DVC's own reading: relative paths resolved against the project's `.dvc/`

    for name, remote in Config(dvc_dir=str(project / ".dvc"))["remote"].items():
        url = str(remote.get("url", ""))
        if url and "://" not in url and Path(url).is_absolute():  # paths, not URLs, are the ones to pin
            run("remote", "modify", "--local", name, "url", url, cwd=worktree)


def _env_for(worktree: Path, tracking_uri: str | None) -> dict[str, str]:
    """The rerun's environment: same MLflow store; in a commit of alignflow's own checkout, that
    commit's code first on the path. A project of the user's own (``alignflow init``) holds no
    alignflow source: it reruns with the installed alignflow, and its own folders (a ``tasks/``
    or ``flows/`` of theirs) must not shadow alignflow's packages, so nothing is prepended."""
    env = dict(os.environ)
    if (worktree / "rlhf_core" / "__init__.py").is_file():
        env["PYTHONPATH"] = f"{worktree}{os.pathsep}{env.get('PYTHONPATH', '')}"
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    env["ALIGNFLOW_HOME"] = str(worktree)
    if tracking_uri:
        env["MLFLOW_TRACKING_URI"] = tracking_uri
    return env


def compare(before: dict[str, Any], after: dict[str, Any], what: str) -> list[str]:
    """Lines naming every key whose value differs (or exists on one side only)."""
    out = []
    for key in sorted(set(before) | set(after)):
        a, b = before.get(key, "<absent>"), after.get(key, "<absent>")
        if a != b:
            out.append(f"{what} {key}: {a} (original) != {b} (rerun)")
    return out


# --------------------------------------------------------------------------------------
# The stored config against the commit's own: what the tracking store may not decide
# --------------------------------------------------------------------------------------

ABSENT = object()  # a field on one side only (not a string: a stored "<absent>" is just a value)
SECRET_WORDS = {"token", "secret", "password", "passwd", "apikey", "credential", "credentials"}
URL = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://|^[^/\s:@]+@[^/\s:]+:")  # scheme://... or scp-like user@host:path
PYTHON_FILE = re.compile(r"\.py(:[A-Za-z_][A-Za-z0-9_.]*)?$")  # a python file, or a function spec file.py:fn
NETWORK_FIELD = re.compile(r"(url|uri|address|host|endpoint)$")
OUTPUT_FIELD = re.compile(r"^(out|output|checkpoint)(_|$)|_dir$|^(pairs|metrics|summary|report)_file$")
# artifact_dir names an MLflow artifact store, often a shared absolute folder; MLflow only adds
# files under <artifact_dir>/<experiment>/<run>, and a change to it is a tracking setting (refused
# without --trust), so it is not confined to the worktree.
UNCONFINED_OUTPUTS = {("tracking", "artifact_dir")}


@dataclasses.dataclass
class ConfigReview:
    """Every stored-vs-commit difference, those refused without ``--trust``, and the output paths
    refused even with it."""

    differences: list[str]
    untrusted: list[str]
    escapes: list[str]


def _strings(value: Any) -> list[str]:
    if isinstance(value, str):
        return [value]
    if isinstance(value, dict):
        return [s for v in value.values() for s in _strings(v)]
    if isinstance(value, (list, tuple)):
        return [s for v in value for s in _strings(v)]
    return []


def inside(worktree: Path, value: str) -> bool:
    """Whether ``value``, relative to the worktree unless absolute, resolves (symlinks followed)
    to the worktree or below it."""
    path = Path(value).expanduser()
    resolved = (path if path.is_absolute() else worktree / path).resolve()
    root = worktree.resolve()
    return resolved == root or root in resolved.parents


def is_output_field(section: str, field: str) -> bool:
    return bool(OUTPUT_FIELD.search(field)) and (section, field) not in UNCONFINED_OUTPUTS


def why_untrusted(section: str, field: str, values: list[Any], worktree: Path) -> str | None:
    """Why a difference in ``section.field`` may only come from a trusted store, or None."""
    strings = [s for v in values for s in _strings(v)]
    if section == "tracking" or field in ("experiment", "registered_model"):
        return "tracking setting"
    if field.endswith("_function") or any(PYTHON_FILE.search(s.strip()) for s in strings):
        return "code: a python file that would be executed"
    if NETWORK_FIELD.search(field) or any(URL.search(s.strip()) for s in strings):
        return "URL / network address"
    if field.endswith("_env") or SECRET_WORDS & set(field.split("_")):  # not max_new_tokens
        return "secret (an environment variable name)"
    if is_output_field(section, field) and strings:
        return "output path"
    looks_like_path = field.endswith(("_path", "_file", "_model")) or any("/" in s or s.startswith(("~", "."))
                                                                         for s in strings)
    if looks_like_path and any(s and not inside(worktree, s) for s in strings):
        return "path outside the worktree"
    return None


def review_config(stored: dict[str, Any], commit: dict[str, Any], worktree: Path) -> ConfigReview:
    """Compare the stored params (``reproduce.json``) with the commit's ``params.yaml`` plus its
    defaults, field by field; check that every output path of the effective config stays in the
    worktree."""
    review = ConfigReview([], [], [])
    for section in sorted(set(stored) | set(commit)):
        ours, theirs = stored.get(section, {}), commit.get(section, {})
        for field in sorted(set(ours) | set(theirs)):
            a, b = ours.get(field, ABSENT), theirs.get(field, ABSENT)
            if a == b:
                continue
            shown = ["<absent>" if v is ABSENT else json.dumps(redact_secrets(v, field))  # never a ?token=
                     for v in (a, b)]
            line = f"{section}.{field}: {shown[0]} (stored) vs {shown[1]} (commit)"
            reason = why_untrusted(section, field, [a, b], worktree)
            review.differences.append(line + (f"  [{reason}]" if reason else ""))
            if reason:
                review.untrusted.append(f"{line}  [{reason}]")
    for section in sorted(set(stored) | set(commit)):
        effective = {**commit.get(section, {}), **stored.get(section, {})}
        for field, value in sorted(effective.items()):
            if is_output_field(section, field) and isinstance(value, str) and value and not inside(worktree, value):
                target = (worktree / Path(value).expanduser()).resolve()
                review.escapes.append(f"{section}.{field}: {json.dumps(redact_secrets(value, field))} "
                                      f"resolves to {redact_secrets(str(target))}")
    return review


def enforce(review: ConfigReview, trust: bool, worktree: Path) -> None:
    """Refuse (SystemExit, listing each field) what the review found: untrusted differences unless
    ``trust``, escaping output paths always."""
    parts = []
    if review.untrusted and not trust:
        parts.append("the stored config (reproduce.json, from the tracking store) differs from the commit's "
                     "params.yaml in fields that run code, write files, reach the network or choose where "
                     "runs are recorded; rerun with --trust only if you trust everyone who can write to this "
                     "tracking store:\n" + "\n".join(f"  {line}" for line in review.untrusted))
    if review.escapes:
        parts.append(f"output paths outside the worktree {worktree} (refused even with --trust: a rerun "
                     "writes, and may remove, only inside its own worktree):\n"
                     + "\n".join(f"  {line}" for line in review.escapes))
    if parts:
        raise SystemExit("reproduce: refusing to rerun: " + "\n\nreproduce: refusing to rerun: ".join(parts))


def commit_config(worktree: Path) -> dict[str, dict[str, Any]]:
    """Every section of the commit's own ``params.yaml`` with the commit's defaults filled in, read
    by the commit's own config code (a field added since then is not a difference)."""
    script = ("import json; from rlhf_core.config import SECTIONS, config_to_dict, load_config; "
              "print(json.dumps({s: config_to_dict(load_config(c, s, 'params.yaml')) for s, c in SECTIONS.items()}))")
    proc = subprocess.run([sys.executable, "-P", "-c", script], cwd=worktree, env=_env_for(worktree, None),
                          capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"reproduce: cannot read the commit's params.yaml:\n{proc.stderr[-2000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


# --------------------------------------------------------------------------------------
# From an MLflow run
# --------------------------------------------------------------------------------------


def stored_commit(run_id: str, tags: dict[str, str]) -> tuple[str, list[str]]:
    """The full sha of the run's ``git.commit`` tag (a hex sha of this repository, nothing else),
    and a warning when the run's code was dirty."""
    tag = tags.get("git.commit", "unknown")
    if tag == "unknown":
        raise SystemExit(f"reproduce: run {run_id} has no git.commit tag (it ran outside a git repository)")
    sha = tag.removesuffix("-dirty")
    if not HEX_SHA.match(sha):
        raise SystemExit(f"reproduce: run {run_id}: git.commit tag {tag!r} is not a commit sha (hex digits); "
                         "refusing to pass it to git")
    warnings = [f"run {run_id} ran with uncommitted changes; rerunning from {sha}, code may differ"] \
        if sha != tag else []
    return resolve_commit(sha, f"run {run_id}'s git.commit"), warnings


def version_warning(run_id: str, tags: dict[str, str]) -> list[str]:
    """A warning when the run's ``alignflow.version`` tag is not the installed alignflow's version:
    the rerun trains with the installed one (a project's commit holds no alignflow code)."""
    from rlhf_core.lineage import package_version

    recorded, installed = tags.get("alignflow.version"), package_version()
    if recorded is None or recorded == installed:
        return []
    return [(f"run {run_id} ran with alignflow {recorded}; the installed alignflow is {installed}: "
             "the rerun uses the installed one, so results may differ")]


def load_recorded(path: Path) -> tuple[str, dict[str, dict[str, Any]], dict[str, Any]]:
    """``(flow, params, inputs)`` of a ``reproduce.json``, its shape checked."""
    try:
        recorded = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise SystemExit(f"reproduce: {path.name}: cannot read it as JSON: {exc}") from None
    if not isinstance(recorded, dict):
        raise SystemExit(f"reproduce: {path.name}: expected a JSON object, got {type(recorded).__name__}")
    flow, params, inputs = recorded.get("flow"), recorded.get("params"), recorded.get("inputs") or {}
    if flow not in FLOWS:
        raise SystemExit(f"reproduce: {path.name}: flow: {flow!r} is not one of {', '.join(FLOWS)}")
    if not isinstance(params, dict) or not all(isinstance(v, dict) for v in params.values()):
        raise SystemExit(f"reproduce: {path.name}: params: expected a mapping of sections to mappings")
    if not isinstance(inputs, dict):
        raise SystemExit(f"reproduce: {path.name}: inputs: expected a mapping, got {type(inputs).__name__}")
    return flow, params, inputs


def flow_command(flow: str, inputs: dict[str, Any], workdir: Path) -> list[str]:
    """The ``alignflow flow`` command line of the rerun; input files as absolute paths (so none
    can read as an option)."""
    # -P: the worktree (the working directory) is not put on sys.path; alignflow's code comes from
    # PYTHONPATH (its own checkout, _env_for) or the installed package.
    cmd = [sys.executable, "-P", "-m", "flows.cli", "flow", flow, "--params", "reproduce_params.yaml",
           "--summary", str(workdir / "summary.json")]
    for name, flag in (("sft_file", "--sft-file"), ("preference_file", "--preference-file"),
                       ("prompts_file", "--prompts-file"), ("eval_file", "--eval-file"),
                       ("base_model", "--base-model")):
        value = inputs.get(name)
        if value:
            if not isinstance(value, str):
                raise SystemExit(f"reproduce: reproduce.json: inputs.{name}: expected a path, got {value!r}")
            cmd += [flag, str(Path(value).resolve())]
    cycles = inputs.get("cycles")
    if flow != "align" and cycles:
        if not isinstance(cycles, int) or isinstance(cycles, bool) or cycles < 1:
            raise SystemExit(f"reproduce: reproduce.json: inputs.cycles: expected an integer >= 1, got {cycles!r}")
        cmd += ["--cycles", str(cycles)]
    return cmd


def check_params(params: dict[str, Any], inputs: dict[str, Any], worktree: Path, commit: str,
                 trust: bool) -> ConfigReview:
    """Print how the stored params differ from the commit's (always), then refuse what ``enforce`` refuses."""
    review = review_config(params, commit_config(worktree), worktree)
    if review.differences:
        print(f"config: reproduce.json (stored) vs params.yaml at {commit[:12]} (commit), "
              f"{len(review.differences)} difference(s):")
        for line in review.differences:
            print(f"  {line}")
    else:
        print(f"config: reproduce.json equals params.yaml at {commit[:12]} (with its defaults)")
    for name, value in sorted(inputs.items()):
        print(f"  input {name}: {value}")
    sys.stdout.flush()  # the difference is on screen before any refusal on stderr
    enforce(review, trust, worktree)
    return review


def reproduce_run(run_id: str, tracking_uri: str, workdir: Path, trust: bool = False) -> dict[str, Any]:
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=tracking_uri)
    run = client.get_run(run_id)
    commit, warnings = stored_commit(run_id, run.data.tags)
    warnings += version_warning(run_id, run.data.tags)
    flow, params, inputs = load_recorded(Path(client.download_artifacts(run_id, "reproduce.json", str(workdir))))

    worktree = workdir / "worktree"
    add_worktree(worktree, commit)
    try:
        review = check_params(params, inputs, worktree, commit, trust)
        params.setdefault("flow", {})["use_cache"] = False  # every task executes: no Prefect cache hits
        if flow != "align":
            params.setdefault("cycles", {})["version"] = False  # a rerun must not commit or push data again
        (worktree / "reproduce_params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
        cmd = flow_command(flow, inputs, workdir)
        env = {**_env_for(worktree, tracking_uri), "ALIGNFLOW_REPRODUCES": run_id}
        proc = subprocess.run(cmd, cwd=worktree, env=env, capture_output=True, text=True)
        if proc.returncode != 0:
            raise SystemExit(f"reproduce: the rerun failed (exit {proc.returncode}):\n"
                             f"{redact_secrets(proc.stderr[-4000:])}")
        summary = json.loads((workdir / "summary.json").read_text())
    finally:
        remove_worktree(worktree)

    rerun = client.get_run(summary["parent_run_id"])
    client.set_tag(rerun.info.run_id, "alignflow.reproduces", run_id)
    md5 = lambda r: {k: v for k, v in r.data.tags.items() if k.startswith("dvc.md5.")}  # noqa: E731
    differences = compare(run.data.metrics, rerun.data.metrics, "metric") + compare(md5(run), md5(rerun), "tag")
    states = task_states(rerun.data.tags.get("prefect.flow_run_id", ""))
    return {"target": run_id, "commit": commit, "flow": flow, "rerun_id": rerun.info.run_id,
            "metrics": {"original": run.data.metrics, "rerun": rerun.data.metrics},
            "md5": {"original": md5(run), "rerun": md5(rerun)}, "task_states": states,
            "config_differences": review.differences, "differences": differences, "warnings": warnings,
            "identical": not differences}


def task_states(flow_run_id: str) -> dict[str, int]:
    """How many of the flow run's task runs ended in each state (``Cached`` would be a cache hit)."""
    if not flow_run_id:
        return {}
    import asyncio

    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    async def fetch() -> dict[str, int]:
        async with get_client() as client:
            runs = await client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id])))
        counts: dict[str, int] = {}
        for tr in runs:
            name = tr.state.name if tr.state else "unknown"
            counts[name] = counts.get(name, 0) + 1
        return counts

    try:
        return asyncio.run(fetch())
    except Exception as exc:  # noqa: BLE001 - the ephemeral server of the rerun may be gone
        return {f"unavailable ({type(exc).__name__})": 0}


# --------------------------------------------------------------------------------------
# From a git revision (the DVC pipeline)
# --------------------------------------------------------------------------------------


def _lock_outs(lock_text: str) -> dict[str, str]:
    lock = yaml.safe_load(lock_text) or {}
    return {f"{stage}:{o['path']}": o["md5"] for stage, body in lock.get("stages", {}).items()
            for o in body.get("outs", [])}


def reproduce_rev(rev: str, workdir: Path) -> dict[str, Any]:
    commit = resolve_commit(rev)
    committed_lock = _git("show", "--end-of-options", f"{commit}:dvc.lock")
    worktree = workdir / "worktree"
    add_worktree(worktree, commit)
    try:
        env = _env_for(worktree, None)
        dvc = [sys.executable, "-P", "-m", "dvc"]
        share_dvc_storage(worktree, Path.cwd(), env)
        subprocess.run([*dvc, "pull", "--quiet"], cwd=worktree, env=env, capture_output=True)  # best effort
        proc = subprocess.run([*dvc, "repro", "--force", "--no-run-cache"], cwd=worktree, env=env,
                              capture_output=True, text=True)
        if proc.returncode != 0:
            raise SystemExit(f"reproduce: dvc repro failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
        rerun_lock = (worktree / "dvc.lock").read_text()
        metrics = {}
        for path in sorted((worktree / "metrics").glob("*.json")):
            rel = f"metrics/{path.name}"
            try:
                original = json.loads(_git("show", "--end-of-options", f"{commit}:{rel}"))
            except SystemExit:
                continue
            metrics[rel] = (original, json.loads(path.read_text()))
    finally:
        remove_worktree(worktree)
    differences = compare(_lock_outs(committed_lock), _lock_outs(rerun_lock), "output md5")
    for rel, (a, b) in metrics.items():
        differences += compare(a, b, f"metric {rel}")
    return {"target": rev, "commit": commit, "flow": "dvc repro", "md5": {"original": _lock_outs(committed_lock),
            "rerun": _lock_outs(rerun_lock)}, "metrics": {k: {"original": a, "rerun": b} for k, (a, b) in metrics.items()},
            "differences": differences, "warnings": [], "identical": not differences}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="alignflow reproduce", description=__doc__.split("\n\n")[0])
    parser.add_argument("target", help="an MLflow run id (32 hex digits) or a git revision "
                                        "(one starting with '-' goes after '--')")
    parser.add_argument("--params", default="params.yaml", help="params file naming the tracking store")
    parser.add_argument("--report", default=None, help="write the comparison as JSON here")
    parser.add_argument("--trust", action="store_true",
                        help="run id: accept stored params that differ from the commit's params.yaml in code "
                             "(file.py:fn), output paths, URLs, secret names or tracking settings (the difference "
                             "is printed either way); output paths outside the worktree stay refused")
    args = parser.parse_args(argv)

    workdir = Path(tempfile.mkdtemp(prefix="alignflow-reproduce-"))
    try:
        if RUN_ID.match(args.target):
            from rlhf_core.config import TrackingConfig, load_config
            from rlhf_core.tracking import resolve_tracking_uri

            tracking = load_config(TrackingConfig, "tracking", args.params if Path(args.params).exists() else None)
            result = reproduce_run(args.target, resolve_tracking_uri(tracking), workdir, trust=args.trust)
        else:
            result = reproduce_rev(args.target, workdir)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    for w in result["warnings"]:
        print(f"warning: {w}")
    print(f"reproduce {result['target']} ({result['flow']} at {result['commit'][:12]}):")
    if result.get("task_states"):
        print("  rerun task states: " + ", ".join(f"{k} {v}" for k, v in sorted(result["task_states"].items())))
    for side in ("original", "rerun"):
        shown = {k: v for k, v in sorted(result["md5"][side].items())}
        print(f"  {side:<8} md5: " + "; ".join(f"{k}={v}" for k, v in shown.items()))
    if result["identical"]:
        n_metrics = len(result["metrics"]["original"]) if "original" in result["metrics"] else len(result["metrics"])
        print(f"  identical: {len(result['md5']['original'])} md5s and {n_metrics} metric sets/values match")
    for line in result["differences"]:
        print(f"  DIFFERENT {line}")
    if args.report:
        Path(args.report).write_text(json.dumps(result, indent=2, sort_keys=True, default=str) + "\n")
    return 0 if result["identical"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
