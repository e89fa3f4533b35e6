"""Offline by default, proven: the micro align flow in a network namespace of its own (only a
loopback; DNS and every outside address unreachable), every Python process of it watched by an
audit hook (tests/e2e/netwatch/sitecustomize.py), attempts nothing outside localhost and succeeds.

The namespace makes an attempt fail; the hook makes it visible, since a library that swallows the
failure (a telemetry ping, a model-card look-up) would otherwise pass unseen. Needs root (CI runs
as root) for ``unshare --net``.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

from helpers import cli_env, in_network_namespace, outside_addresses, watched_env, write_micro_params


@pytest.mark.slow  # a whole micro align flow in a fresh process (about 3 minutes on 2 cores)
def test_micro_align_flow_attempts_nothing_outside_localhost(tmp_path):
    assert shutil.which("unshare") and shutil.which("ip"), "util-linux's unshare and iproute2's ip are needed"
    write_micro_params(tmp_path)
    log = tmp_path / "network_attempts.log"
    env = watched_env(cli_env(tmp_path), log)
    env.pop("PREFECT_API_URL", None)  # the flow starts its own server inside the namespace
    env["PREFECT_HOME"] = str(tmp_path / ".prefect")
    proc = subprocess.run(in_network_namespace(f"exec {sys.executable} -m flows.cli flow align"), cwd=tmp_path,
                          env=env, capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, proc.stderr[-3000:]
    attempts = log.read_text() if log.exists() else ""
    assert attempts == "", attempts[:3000]
    assert (tmp_path / "metrics" / "align_summary.json").exists()


def test_the_watch_sees_an_attempt(tmp_path):
    """The hook itself: a look-up of an outside name and a connect to an outside address are logged
    (in a namespace, so nothing leaves this machine), loopback is not."""
    log = tmp_path / "attempts.log"
    env = watched_env(dict(os.environ), log)
    code = ("import socket\n"
            "for target in (lambda: socket.getaddrinfo('example.invalid', 443),\n"
            "               lambda: socket.create_connection(('192.0.2.1', 80), timeout=1),\n"
            "               lambda: socket.getaddrinfo('localhost', 80)):\n"
            "    try:\n        target()\n    except OSError:\n        pass\n")
    proc = subprocess.run(["unshare", "--net", sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0, proc.stderr
    lines = log.read_text().splitlines()
    assert any("socket.getaddrinfo example.invalid" in line for line in lines), lines
    assert any("socket.connect 192.0.2.1" in line for line in lines), lines
    assert not any("localhost" in line for line in lines), lines


def test_the_trace_sees_a_program_that_is_not_python(tmp_path):
    """The strace layer, for programs the audit hook cannot watch (PostgreSQL, git): a shell's connect to an outside
    address is listed, its connect to loopback is not."""
    trace = tmp_path / "trace.log"
    script = ("bash -c 'echo > /dev/tcp/192.0.2.1/80' 2>/dev/null; bash -c 'echo > /dev/tcp/127.0.0.1/9' 2>/dev/null; "
              "true")
    proc = subprocess.run(in_network_namespace(script, trace), capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    outside = outside_addresses(trace)
    assert len(outside) == 1 and "192.0.2.1" in outside[0], outside
    assert "127.0.0.1" in trace.read_text(), "the loopback connect was traced, and passed as local"
