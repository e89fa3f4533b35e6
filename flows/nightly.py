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
"""

from __future__ import annotations

import argparse
from typing import Any, Sequence

DEFAULT_CRON = "0 2 * * *"


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
    args = parser.parse_args(argv)

    from prefect import serve  # lazy: prefect (light `nightly --help`)

    serve(*build_deployments(args.flow or ["align"], args.cron, args.timezone, args.params))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
