"""The GPU limit (flows/gpu_limit.py) on a real Prefect server (the test session's temporary one): two flow runs
that each hold the limit's one slot take turns, the second waiting for the first; a missing limit is made with
one slot per device; no name, no limit; asking for more slots than the limit has is a config error."""

from __future__ import annotations

import threading
import time
import uuid

import pytest

from rlhf_core.config import ConfigError, FlowConfig

HOLD_S = 3.0


def _flow_holding(name: str):
    from prefect import flow

    from flows.gpu_limit import gpu_stages

    @flow(name="hold-gpus")
    def hold() -> tuple[float, float, float]:
        with gpu_stages(FlowConfig(gpu_limit=name)) as waited:
            start = time.monotonic()
            time.sleep(HOLD_S)
            return waited, start, time.monotonic()

    return hold


def test_two_flow_runs_take_turns_on_one_slot(prefect_server):
    from flows.gpu_limit import ensure_gpu_limit, limit_state

    name = f"test-gpus-{uuid.uuid4().hex[:8]}"
    assert ensure_gpu_limit(name, 1) == 1
    hold = _flow_holding(name)
    results: list[tuple[float, float, float]] = []
    threads = [threading.Thread(target=lambda: results.append(hold())) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert len(results) == 2
    first, second = sorted(results, key=lambda r: r[1])
    assert second[1] >= first[2] - 0.2, "the second run held the slot only after the first let it go"
    assert second[0] >= HOLD_S - 1.0 and first[0] < HOLD_S - 1.0, (first[0], second[0])
    assert limit_state(name) == {"limit": 1, "active_slots": 0, "active": True}


def test_a_missing_limit_is_made_with_one_slot_per_device(prefect_server):
    from flows.gpu_limit import device_count, gpu_stages, limit_state

    name = f"test-gpus-{uuid.uuid4().hex[:8]}"
    with gpu_stages(FlowConfig(gpu_limit=name)) as waited:
        assert waited < HOLD_S
        assert limit_state(name)["active_slots"] == 1
    assert limit_state(name) == {"limit": device_count(), "active_slots": 0, "active": True}


def test_no_name_no_limit():
    from flows.gpu_limit import gpu_stages

    with gpu_stages(FlowConfig(gpu_limit="")) as waited:
        assert waited == 0.0


def test_more_slots_than_the_limit_has_is_refused(prefect_server):
    from flows.gpu_limit import ensure_gpu_limit, gpu_stages

    name = f"test-gpus-{uuid.uuid4().hex[:8]}"
    ensure_gpu_limit(name, 1)
    with pytest.raises(ConfigError, match=rf"flow.gpu_slots: 2 slots asked of Prefect limit '{name}', which has 1"):
        with gpu_stages(FlowConfig(gpu_limit=name, gpu_slots=2)):
            pass


@pytest.mark.parametrize("values, message", [
    ({"gpu_slots": 0}, "flow.gpu_slots: must be >= 1"),
    ({"gpu_limit": "gpus/a"}, "flow.gpu_limit: a Prefect limit name has none of"),
])
def test_bad_gpu_settings_name_the_field(values, message):
    with pytest.raises(ConfigError, match=message):
        FlowConfig(**values)
