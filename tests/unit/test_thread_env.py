"""The math libraries' dynamic threading is off in every process that imports rlhf_core, before torch loads.

With it on, MKL picks each call's thread count from the machine's load and a CPU run's weights differed in their
last bits beside other work (rlhf_core/common/offline.py, DETERMINISM_ENV). A child process is used because the
libraries read these variables once, when they load."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from rlhf_core.common.offline import DETERMINISM_ENV, child_env

_PROBE = ("import os, sys, json; import rlhf_core; torch_first = 'torch' in sys.modules; "
          "print(json.dumps({'torch_first': torch_first, **{k: os.environ.get(k) for k in %r}}))")


def _probe(env: dict[str, str]) -> dict:
    out = subprocess.run([sys.executable, "-c", _PROBE % sorted(DETERMINISM_ENV)], env=env, check=True,
                         capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def _env_without(*names: str) -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k not in names}


def test_set_before_torch_loads_and_a_users_value_is_kept():
    seen = _probe(_env_without(*DETERMINISM_ENV))
    assert seen == {"torch_first": False, "MKL_DYNAMIC": "FALSE", "OMP_DYNAMIC": "FALSE"}
    seen = _probe({**_env_without(*DETERMINISM_ENV), "MKL_DYNAMIC": "TRUE"})
    assert seen["MKL_DYNAMIC"] == "TRUE" and seen["OMP_DYNAMIC"] == "FALSE"


def test_child_processes_get_this_processes_choice(monkeypatch):
    monkeypatch.setenv("OMP_DYNAMIC", "TRUE")
    env = child_env()
    assert env["OMP_DYNAMIC"] == "TRUE" and env["MKL_DYNAMIC"] == os.environ["MKL_DYNAMIC"]
    assert env["HF_HUB_OFFLINE"] == "1"
