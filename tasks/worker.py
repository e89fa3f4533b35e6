"""Run one training stage in a child process, so a crash of the trainer is a retryable task failure.

A trainer that dies — SIGKILL, the kernel's out-of-memory killer, a segfault in a native
kernel — takes its process with it. Run inline, that process is the flow itself; run here,
the Prefect task sees the child's exit status, raises :class:`StageProcessDied`, Prefect
retries the task, and the new child resumes from the stage's last checkpoint
(:mod:`rlhf_core.tracking.checkpoint`). A child also hands all its memory back to the system (GPU
memory included) when the stage ends.

Why a plain subprocess and not Ray: this is the local default and needs nothing running;
the request/response are small JSON files (config dicts in, paths and md5s out), exactly what
the task passes anyway.

The child is ``python -m tasks.worker REQUEST RESULT``; its pid is written to
``<project>/.alignflow/workers/<stage>.pid`` while it runs (operators and tests use it).
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import tempfile
import traceback
from pathlib import Path
from typing import Any

import rlhf_core  # noqa: F401  (offline switches first)
from rlhf_core.config import GuardsConfig, TrackingConfig, build_config, stage_registry as registry
from rlhf_core.tracking.mlflow_runs import project_root
from tasks.common import PERMANENT_ERRORS
from tasks.errors import StageProcessDied, StageRejected

log = logging.getLogger(__name__)


def run_inline(stage: str, params: dict[str, Any], tracking: dict[str, Any],
               parent_run_id: str | None, guards: dict[str, Any] | None = None) -> dict[str, Any]:
    """Build the stage's typed config and run its entry (rlhf_core/config/stage_registry.py) in this process; returns its
    result dict. ``guards``: the ``guards`` section for a policy stage (None: no guards)."""
    spec = registry.get(stage)
    extra = ({"guards": build_config(GuardsConfig, "guards", guards)}
             if guards is not None and spec.guarded else {})
    return spec.entry_function()(build_config(spec.config_class(), spec.section, params),
                                 build_config(TrackingConfig, "tracking", tracking), parent_run_id, **extra).to_dict()


def pid_file(stage: str) -> Path:
    return project_root() / ".alignflow" / "workers" / f"{stage}.pid"


def run_in_child(stage: str, params: dict[str, Any], tracking: dict[str, Any],
                 parent_run_id: str | None, guards: dict[str, Any] | None = None) -> dict[str, Any]:
    """Run the stage in ``python -m tasks.worker``; raise StageRejected / StageProcessDied on failure."""
    with tempfile.TemporaryDirectory(prefix=f"alignflow-{stage}-") as tmp:
        request, result = Path(tmp) / "request.json", Path(tmp) / "result.json"
        request.write_text(json.dumps({"stage": stage, "params": params, "tracking": tracking,
                                       "parent_run_id": parent_run_id, "guards": guards}))
        # -P: the project folder (cwd) is not put on sys.path, so a `tasks/` folder of the user's
        # own cannot shadow alignflow's tasks package; the code comes from where this process's did.
        proc = subprocess.Popen([sys.executable, "-P", "-m", "tasks.worker", str(request), str(result)],
                                cwd=os.getcwd(), env=dict(os.environ))
        pid_path = pid_file(stage)
        pid_path.parent.mkdir(parents=True, exist_ok=True)
        pid_path.write_text(f"{proc.pid}\n")
        log.info("%s: training in process %d", stage, proc.pid)
        try:
            code = proc.wait()
        except BaseException:  # the task itself is cancelled: do not leave the trainer running
            proc.terminate()  # SIGTERM: the trainer checkpoints its step and stops
            proc.wait(timeout=600)
            raise
        finally:
            pid_path.unlink(missing_ok=True)
        reply = json.loads(result.read_text()) if result.exists() else None
    if code == 0 and reply is not None and "ok" in reply:
        return reply["ok"]
    if reply is not None and "error" in reply:
        cls = StageRejected if reply.get("permanent") else StageProcessDied
        raise cls(f"{stage}: {reply['error']}")
    how = f"killed by {signal.Signals(-code).name}" if code < 0 else f"exited with status {code}"
    raise StageProcessDied(f"{stage}: training process {proc.pid} {how} before it finished; a retry resumes "
                           f"from the stage's last checkpoint")


def main(argv: list[str]) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    request_path, result_path = Path(argv[0]), Path(argv[1])
    request = json.loads(request_path.read_text())
    try:
        reply: dict[str, Any] = {"ok": run_inline(request["stage"], request["params"], request["tracking"],
                                                  request["parent_run_id"], request.get("guards"))}
        code = 0
    except PERMANENT_ERRORS as exc:
        report = getattr(exc, "report", None)
        reply, code = {"error": report.render() if report is not None else str(exc), "permanent": True}, 1
    except Exception as exc:  # noqa: BLE001 - reported to the parent, which decides on retries
        traceback.print_exc()
        reply, code = {"error": f"{type(exc).__name__}: {exc}", "permanent": False}, 1
    tmp = result_path.with_name(result_path.name + ".tmp")
    tmp.write_text(json.dumps(reply))
    tmp.replace(result_path)
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
