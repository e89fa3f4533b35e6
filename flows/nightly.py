"""Nightly alignment: the ``align`` and ``iterative_dpo`` flows as cron-scheduled deployments.

``alignflow nightly`` serves the deployments from this process (Prefect's ``serve``: no
work pool or worker needed): it registers them with the Prefect server named by
``PREFECT_API_URL``, then waits and runs each scheduled (or manually triggered) flow run in
a subprocess, in this project folder. The default schedule is 02:00 UTC every day.

Set-up, in two terminals of the project folder::

    .venv/bin/prefect server start                      # UI and API on 127.0.0.1:4200
    PREFECT_API_URL=http://127.0.0.1:4200/api .venv/bin/alignflow nightly

Trigger one run now: ``.venv/bin/prefect deployment run align/nightly-align``. Teams with a
work pool deploy the same flows from ``prefect.yaml`` with ``prefect deploy --all`` instead.

With a webhook URL in ``ALIGNFLOW_NOTIFY_WEBHOOK`` (the environment or ``team.env_file``), it first makes the
automations that post to it when a nightly run fails, crashes or is not finished ``--deadline`` seconds after it
started or was marked late (flows/nightly_alerts.py).
"""

from __future__ import annotations

import argparse
from typing import Any, Sequence

from flows import errors
from rlhf_core.common.project import project_root
from rlhf_core.config import TeamConfig, load_config

DEFAULT_CRON = "0 2 * * *"
DEFAULT_DEADLINE_S = 6 * 3600.0


def build_deployments(flows: Sequence[str], cron: str = DEFAULT_CRON, timezone: str = "UTC",
                      params_file: str = "params.yaml", paused: bool = False) -> list[Any]:
    """Runner deployments ``<flow>/nightly-<flow>`` with a cron schedule in ``timezone``."""
    from prefect.schedules import Cron  # lazy: prefect (light `nightly --help`)

    from flows.align import align  # lazy: prefect (light `nightly --help`)
    from flows.cycles import iterative_dpo  # lazy: prefect (light `nightly --help`)

    known = {"align": align, "iterative_dpo": iterative_dpo}
    unknown = [f for f in flows if f not in known]
    if unknown:
        raise ValueError(f"unknown flow(s) {unknown}; nightly serves {sorted(known)}")
    return [known[name].to_deployment(name=f"nightly-{name.replace('_', '-')}",
                                      schedule=Cron(cron, timezone=timezone),
                                      parameters={"params_file": params_file}, paused=paused,
                                      tags=["alignflow", "nightly"],
                                      description=f"alignflow {name}, {cron} ({timezone})")
            for name in flows]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="alignflow nightly", description=__doc__.split("\n\n")[0])
    parser.add_argument("--flow", action="append", choices=["align", "iterative_dpo"],
                        help="flow(s) to schedule (repeatable; default: align)")
    parser.add_argument("--cron", default=DEFAULT_CRON, help=f"cron expression (default: {DEFAULT_CRON!r})")
    parser.add_argument("--timezone", default="UTC", help="time zone of the cron expression (default: UTC)")
    parser.add_argument("--params", default="params.yaml", help="params file the scheduled runs read")
    parser.add_argument("--deadline", type=float, default=DEFAULT_DEADLINE_S, metavar="SECONDS",
                        help="alert when a nightly run is not finished this long after it started or was marked late "
                             f"(default {DEFAULT_DEADLINE_S:.0f}: six hours; size it to a run's usual length plus a "
                             "margin); alerts need ALIGNFLOW_NOTIFY_WEBHOOK")
    args = parser.parse_args(argv)

    from prefect import serve  # lazy: prefect (light `nightly --help`)

    deployments = build_deployments(args.flow or ["align"], args.cron, args.timezone, args.params)
    try:
        make_alerts(args.params, args.deadline)
    except Exception as exc:  # noqa: BLE001 - a bad URL, deadline or team section is one message
        code = errors.report(exc, debug=False)
        if code is None:
            raise
        return code
    serve(*deployments)
    return 0


def make_alerts(params: str, deadline_s: float) -> bool:
    """The nightly alerts on the Prefect server when a webhook URL is set (flows/nightly_alerts.py); says which."""
    from flows import nightly_alerts as alerts  # lazy: prefect (light `nightly --help`)

    url = alerts.webhook_url(load_config(TeamConfig, "team", params), project_root())
    if url is None:
        print(f"nightly alerts: off ({alerts.WEBHOOK_ENV} not set)")
        return False
    alerts.ensure_nightly_alerts(url, deadline_s)
    print(f"nightly alerts: failed, crashed or not finished within {deadline_s:g} s -> {alerts.shown(url)}")
    return True


if __name__ == "__main__":
    raise SystemExit(main())
