"""Nightly alerts: Prefect automations that tell a webhook when a nightly run fails, crashes or misses its deadline.

``alignflow nightly`` makes them on the Prefect server it serves to, when a webhook URL is set
(:data:`WEBHOOK_ENV` in the environment, else in ``team.env_file``): a notification block :data:`BLOCK_NAME`
(Prefect's Custom Webhook, the URL kept among its secret values) and two automations on the runs that carry the
``nightly`` tag (every deployment ``alignflow nightly`` serves):

- :data:`FAILED`: reactive, on a nightly flow run's ``Failed`` or ``Crashed`` event.
- :data:`MISSED`: proactive, a nightly run that started (``Pending``) or was marked ``Late`` (not started on time:
  Prefect's late-runs service marks it, so the run that never started counts) and is in no final state
  ``deadline_s`` seconds later. A run that failed is :data:`FAILED`'s alone.

The Prefect server evaluates both and calls the webhook itself, so an alert goes out while the machine that serves
the deployments is down. Both are replaced by name on every ``alignflow nightly`` start, so a new deadline or URL
takes effect. The webhook gets a JSON body ``{"subject": ..., "text": ...}`` naming the flow run, its deployment and
its state.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit
from uuid import UUID

from prefect import get_client
from prefect.blocks.notifications import CustomWebhookNotificationBlock
from prefect.events.actions import SendNotification
from prefect.events.schemas.automations import AutomationCore, EventTrigger, Posture
from prefect.types import SecretDict

from flows.services.credentials import credentials_path, read_credentials
from rlhf_core.config import ConfigError, TeamConfig

WEBHOOK_ENV = "ALIGNFLOW_NOTIFY_WEBHOOK"
"""The webhook URL's variable (environment or ``team.env_file``): a credential, as a chat webhook's URL holds its
token."""
BLOCK_NAME = "alignflow-nightly-webhook"
FAILED = "alignflow nightly failed"
MISSED = "alignflow nightly missed its deadline"
TAG = "nightly"
FINAL = ("Completed", "Failed", "Crashed", "Cancelled")
"""The final states of a flow run: reaching any of them in time meets the deadline."""

_RUN = ("flow run {{ flow_run.name }} ({{ flow_run.id }}) of {{ flow.name }}/{{ deployment.name }}, "
        "state {{ flow_run.state.name }}")


def webhook_url(team: TeamConfig, project: Path) -> str | None:
    """:data:`WEBHOOK_ENV` from the environment, else from ``team.env_file``; None when neither sets it."""
    url = os.environ.get(WEBHOOK_ENV) or read_credentials(credentials_path(team, project)).get(WEBHOOK_ENV)
    if url and urlsplit(url).scheme not in ("http", "https"):
        raise ConfigError(f"{WEBHOOK_ENV}: must be an http(s) URL (its value is not shown: it may hold a token)")
    return url or None


def shown(url: str) -> str:
    """The URL as printed: scheme and host only (a chat webhook's path and query are its token)."""
    parts = urlsplit(url)
    return f"{parts.scheme}://{parts.hostname}{f':{parts.port}' if parts.port else ''}/…"


def save_webhook_block(url: str) -> UUID:
    """The Custom Webhook block :data:`BLOCK_NAME` posting ``{"subject", "text"}`` to ``url`` (saved over any older
    one); returns its id. The URL sits in the block's secret values, masked in the UI and the API's answers."""
    block = CustomWebhookNotificationBlock(name="alignflow nightly", url="{{webhook_url}}",
                                           json_data={"subject": "{{subject}}", "text": "{{body}}"},
                                           secrets=SecretDict({"webhook_url": url}))
    return block.save(BLOCK_NAME, overwrite=True)


def nightly_triggers(deadline_s: float) -> dict[str, Any]:
    """The two automations' triggers by name (Prefect event triggers on the flow runs tagged :data:`TAG`)."""
    runs = {"match": {"prefect.resource.id": "prefect.flow-run.*"},
            "match_related": {"prefect.resource.role": "tag", "prefect.resource.id": f"prefect.tag.{TAG}"}}
    return {
        FAILED: EventTrigger(**runs, expect={"prefect.flow-run.Failed", "prefect.flow-run.Crashed"},
                             posture=Posture.Reactive, threshold=1),
        MISSED: EventTrigger(**runs, after={"prefect.flow-run.Late", "prefect.flow-run.Pending"},
                             expect={f"prefect.flow-run.{state}" for state in FINAL},
                             for_each={"prefect.resource.id"}, posture=Posture.Proactive, threshold=1,
                             within=deadline_s),
    }


def ensure_nightly_alerts(url: str, deadline_s: float) -> dict[str, UUID]:
    """The webhook block and the two automations on the Prefect server of ``PREFECT_API_URL``, each replacing one
    of the same name; returns the automations' ids by name."""
    if deadline_s < 10:
        raise ConfigError(f"nightly --deadline: at least 10 seconds (Prefect's shortest proactive window), got "
                          f"{deadline_s:g}")
    block_id = save_webhook_block(url)
    texts = {FAILED: ("alignflow nightly {{ flow_run.name }}: {{ flow_run.state.name }}",
                      _RUN + ": {{ flow_run.state.message }}"),
             MISSED: ("alignflow nightly {{ flow_run.name }}: not finished within its deadline",
                      _RUN + f", not finished {deadline_s:g} s after it started or was marked late")}
    made = {}
    with get_client(sync_client=True) as client:
        for name, trigger in nightly_triggers(deadline_s).items():
            for old in client.read_automations_by_name(name):
                client.delete_automation(old.id)
            subject, body = texts[name]
            made[name] = client.create_automation(AutomationCore(
                name=name, description=f"alignflow nightly alerts ({__name__})", trigger=trigger,
                actions=[SendNotification(block_document_id=block_id, subject=subject, body=body)]))
    return made
