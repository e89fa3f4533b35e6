"""Helpers for end-to-end tests: micro params and running the real CLI."""

from __future__ import annotations

import itertools
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import yaml

from conftest import REPO

MICRO_PARAMS = {
    "generate": {"n_sft": 400, "n_preference": 60, "n_prompts": 60, "n_eval": 60, "sft_noise": 0.2, "seed": 5},
    "model": {"hidden_size": 32, "num_layers": 2, "num_heads": 2, "num_kv_heads": 1, "intermediate_size": 64,
              "vocab_size": 280},
    "sft": {"max_steps": 12, "batch_size": 32, "warmup_steps": 2, "eval_items": 40},
    "reward": {"max_steps": 6, "batch_size": 16, "warmup_steps": 1},
    "dpo": {"max_steps": 6, "batch_size": 16, "warmup_steps": 1, "eval_items": 40},
    "kto": {"max_steps": 6, "batch_size": 16, "warmup_steps": 1, "eval_items": 40},
    "rejection": {"n_samples": 4, "max_prompts": 30},
    "raft": {"max_steps": 6, "batch_size": 16, "warmup_steps": 1, "eval_items": 40},
    "distill": {"max_steps": 6, "batch_size": 16, "warmup_steps": 1, "eval_items": 40},
    "rl": {"max_steps": 2, "rollout": {"prompts_per_step": 4, "group_size": 4}, "eval_items": 40,
           "algorithm": {"mini_batch_size": 16}, "save_every": 0},
    "evaluate": {"max_items": 40},
    "tracking": {"experiment": "alignflow-test"},
    # Micro models cannot gain 2 standard errors in a few steps: the guards are computed and logged (and the
    # model card shows them) but champion moves on the accuracy comparison alone, as before the gate.
    "guards": {"gate": False},
    # Training in the flow's process keeps micro flows fast; test_flow and test_retry_resume
    # run the default (a child process per stage).
    "flow": {"isolation": "inline"},
}


def write_micro_params(folder: Path) -> Path:
    """The shipped params.yaml with micro sizes merged in."""
    params = yaml.safe_load((REPO / "params.yaml").read_text())
    for section, values in MICRO_PARAMS.items():
        for key, value in values.items():  # a section within one (rl's rollout) merged, not replaced
            params[section][key] = {**params[section].get(key, {}), **value} if isinstance(value, dict) else value
    out = folder / "params.yaml"
    out.write_text(yaml.safe_dump(params, sort_keys=False))
    return out


def copy_project(dest: Path, *, lock: bool = False, micro: bool = True) -> Path:
    """The checkout's tracked and untracked-not-ignored files in ``dest`` (no tests, no pipeline data or models),
    a git repository of its own; with ``lock``, the committed dvc.lock too; with ``micro``, micro params."""
    files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], cwd=REPO, capture_output=True,
                           text=True, check=True).stdout.split()
    for rel in files:
        if rel.startswith(("tests/", "data/", "models/", "metrics/", "reports/")) or (rel == "dvc.lock" and not lock):
            continue
        if (REPO / rel).is_file():  # a file deleted in the working tree is still listed until committed
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / rel, dest / rel)
    if micro:
        write_micro_params(dest)
    subprocess.run(["git", "init", "-q"], cwd=dest, check=True)
    return dest


def team_section(base: Path) -> dict:
    """A ``team`` params section for the services of one test: free ports, one GPU slot, the services' data under
    ``base/services``, and a start timeout long enough for the Prefect server's first start, which migrates its
    database (minutes on busy cores)."""
    return {"postgres_port": free_port(), "object_store_port": free_port(), "mlflow_port": free_port(),
            "prefect_port": free_port(), "gpu_devices": 1, "data_dir": str(base / "services"),
            "start_timeout_s": 900}


def team_clone(base: Path, name: str, team: dict) -> Path:
    """A project clone in ``base/name`` (:func:`copy_project`) whose params' ``team`` section is ``team``."""
    (base / name).mkdir()
    project = copy_project(base / name)
    params = yaml.safe_load((project / "params.yaml").read_text())
    params["team"] = team
    (project / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    return project


def registry_store(project: Path, micro_model: Path, experiment: str) -> tuple:
    """(MLflow client on the project's sqlite store, a new experiment's id, the project's own copy of the micro
    model at models/policy): the registry tests' starting point."""
    from mlflow import MlflowClient  # lazy: the helpers module is imported by tests that never touch MLflow

    client = MlflowClient(tracking_uri=f"sqlite:///{project / 'mlflow.db'}")
    exp = client.create_experiment(experiment, artifact_location=(project / "mlartifacts").as_uri())
    model = project / "models" / "policy"
    shutil.copytree(micro_model, model)
    return client, exp, model


def cli_env(project: Path) -> dict[str, str]:
    env = dict(os.environ)
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    env["ALIGNFLOW_HOME"] = str(project)
    env["MLFLOW_TRACKING_URI"] = f"sqlite:///{project / 'mlflow.db'}"
    env.setdefault("PREFECT_HOME", str(project / ".prefect"))
    return env


def run_cli(args: list[str], project: Path, timeout: int = 600) -> subprocess.CompletedProcess:
    """Run ``alignflow ARGS`` in ``project`` as a user would (a fresh process)."""
    return subprocess.run([sys.executable, "-m", "flows.cli", *args], cwd=project, env=cli_env(project),
                          capture_output=True, text=True, timeout=timeout)


def one_error(proc: subprocess.CompletedProcess, code: int, *needles: str) -> str:
    """``proc`` failed with exit ``code`` and one error as flows/errors.py prints it: no traceback, the
    ``error:`` block at most 5 lines and 400 characters, printed once, holding every needle. Returns it."""
    err = proc.stderr
    assert proc.returncode == code, (proc.returncode, err[-3000:])
    assert "Traceback" not in err, err[-3000:]
    lines = err[err.rindex("error: "):].splitlines()  # up to the next log record (Prefect's server stopping)
    block = "\n".join(itertools.takewhile(lambda line: not line.startswith(("INFO ", "WARNING ", "DEBUG ")),
                                          lines)).strip()
    assert len(block.splitlines()) <= 5 and len(block) <= 400, block
    assert err.count(block.splitlines()[0]) == 1, err[-3000:]
    for needle in needles:
        assert needle in block, (needle, block)
    return block


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Forwarder:
    """A TCP forwarder from loopback port ``port`` to ``target``: the network path to a real service, which a test
    can cut (:meth:`cut`: the port closes and every connection through it drops, so a client is refused at once)
    and restore (:meth:`restore`) while the service itself runs on and keeps what it holds."""

    def __init__(self, port: int, target: int):
        self.port, self.target = port, target
        self._lock = threading.Lock()
        self._sockets: list[socket.socket] = []
        self._listener: socket.socket | None = None
        self.restore()

    def restore(self) -> None:
        if self._listener is not None:
            return
        listener = socket.socket()
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", self.port))
        listener.listen(64)
        self._listener = listener
        threading.Thread(target=self._accept, args=(listener,), daemon=True).start()

    def cut(self) -> None:
        with self._lock:
            doomed, self._sockets = [s for s in (self._listener, *self._sockets) if s is not None], []
            self._listener = None
        for sock in doomed:
            try:
                sock.shutdown(socket.SHUT_RDWR)  # wakes the thread blocked in accept() or recv()
            except OSError:
                pass
            sock.close()

    def _accept(self, listener: socket.socket) -> None:
        while True:
            try:
                client, _ = listener.accept()
            except OSError:
                return
            upstream = socket.create_connection(("127.0.0.1", self.target))
            with self._lock:
                self._sockets += [client, upstream]
            for src, dst in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(src, dst), daemon=True).start()

    @staticmethod
    def _pump(src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(65536):
                dst.sendall(data)
        except OSError:
            pass
        for sock in (src, dst):
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass


def wait_for(check, timeout: float, what: str):
    deadline = time.time() + timeout
    while time.time() < deadline:
        result = check()
        if result:
            return result
        time.sleep(1.0)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")


def stop_group(proc: subprocess.Popen, sig: int = signal.SIGINT, timeout: float = 60) -> None:
    """Signal the process group (Ctrl-C by default: serve pauses its schedules on the way out);
    kill it if it has not exited after ``timeout`` seconds."""
    os.killpg(proc.pid, sig)
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)


def start_mlflow_server(root: Path, port: int, *, store: str = "mlflow.db", artifacts: str = "artifacts",
                        workers: int | None = None) -> subprocess.Popen:
    """A real ``mlflow server`` on 127.0.0.1:``port`` over ``root/store`` (sqlite), up within 120 s."""
    import requests

    extra = ["--workers", str(workers)] if workers else []
    proc = subprocess.Popen([str(Path(sys.executable).parent / "mlflow"), "server", "--host", "127.0.0.1",
                             "--port", str(port), "--backend-store-uri", f"sqlite:///{root / store}",
                             "--artifacts-destination", str(root / artifacts), *extra],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    deadline = time.time() + 120
    while time.time() < deadline:
        try:
            if requests.get(f"http://127.0.0.1:{port}/health", timeout=2).ok:
                return proc
        except requests.RequestException:
            pass
        assert proc.poll() is None, "mlflow server exited"
        time.sleep(0.5)
    stop_group(proc, signal.SIGTERM, timeout=30)
    raise AssertionError("mlflow server did not come up in 120 s")


def git(root: Path, *args: str) -> str:
    return subprocess.run(["git", *args], cwd=root, capture_output=True, text=True, check=True).stdout.strip()


def seed_versioned_project(root: Path, remote: Path) -> None:
    """Make ``root`` (its params.yaml written) a project as ``alignflow init`` makes one (git + DVC),
    its DVC remote moved to ``remote``, its params committed, and run ``generate``, ``init-model``,
    ``sft`` and ``reward`` there: what an iterative flow starts from."""
    params = (root / "params.yaml").read_text()
    (root / "params.yaml").unlink()  # init refuses to overwrite a file: it writes the template's
    proc = run_cli(["init", "."], root)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (root / "params.yaml").write_text(params)
    git(root, "config", "user.name", "Test User")
    git(root, "config", "user.email", "test@example.com")
    proc = subprocess.run([sys.executable, "-m", "dvc", "remote", "modify", "local", "url", str(remote)], cwd=root,
                          env=cli_env(root), capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    git(root, "commit", "-q", "-am", "project")
    for cmd in (["generate"], ["init-model"], ["sft"], ["reward"]):
        proc = run_cli(cmd, root)
        assert proc.returncode == 0, proc.stderr[-3000:]


# ---- the network watch (tests/e2e/netwatch; test_no_network*.py) ---------------------------------------------------

NETWATCH = Path(__file__).resolve().parent / "netwatch"
_STRACE_ADDRESS = re.compile(r'inet_addr\("([^"]+)"\)|inet_pton\(AF_INET6, "([^"]+)"')


def watched_env(env: dict[str, str], attempts: Path, procs: Path | None = None) -> dict[str, str]:
    """``env`` with every Python process it starts watched by the audit hook (netwatch/sitecustomize.py): attempts
    to reach a host outside loopback go to ``attempts``; with ``procs``, each watched process's command line too."""
    out = {**env, "PYTHONPATH": os.pathsep.join([str(NETWATCH), env.get("PYTHONPATH", "")]).rstrip(os.pathsep),
           "ALIGNFLOW_TEST_NET_LOG": str(attempts)}
    if procs is not None:
        out["ALIGNFLOW_TEST_NET_PROCS"] = str(procs)
    return out


def in_network_namespace(script: str, trace: Path | None = None) -> list[str]:
    """argv that runs shell ``script`` in a network namespace of its own (only a loopback, brought up first); with
    ``trace``, under strace following every process (Python or not: PostgreSQL, git), its socket calls to ``trace``."""
    argv = ["unshare", "--net", "sh", "-c", f"ip link set lo up && {script}"]
    if trace is None:
        return argv
    return ["strace", "-f", "--seccomp-bpf", "-qq", "-e", "signal=none", "-e",
            "trace=connect,sendto,sendmsg,sendmmsg", "-o", str(trace), *argv]


def outside_addresses(trace: Path) -> list[str]:
    """The strace lines of ``trace`` whose IPv4/IPv6 address is not loopback (Unix and netlink sockets are local)."""
    outside = []
    for line in trace.read_text(errors="replace").splitlines():
        for v4, v6 in _STRACE_ADDRESS.findall(line):
            address = v4 or v6
            if not (address.startswith(("127.", "::ffff:127.")) or address in ("::1", "0.0.0.0", "::")):
                outside.append(line[:300])
    return outside
