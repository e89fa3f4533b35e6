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


def _flow_holding(name: str, holding: threading.Event, asking: threading.Event):
    from prefect import flow

    from flows.gpu_limit import gpu_stages

    @flow(name="hold-gpus")
    def hold(first: bool) -> tuple[float, float, float, float]:
        """The first run keeps the slot for HOLD_S seconds after the second has started asking for it, so the two
        contend however long Prefect takes to start a flow run on a loaded machine."""
        entered = time.monotonic()
        if not first:
            asking.set()
        with gpu_stages(FlowConfig(gpu_limit=name)) as waited:
            start = time.monotonic()
            if first:
                holding.set()
                assert asking.wait(60), "the second run never started"
            time.sleep(HOLD_S)
            return waited, entered, start, time.monotonic()

    return hold


def test_two_flow_runs_take_turns_on_one_slot(prefect_server):
    from flows.gpu_limit import ensure_gpu_limit, limit_state

    name = f"test-gpus-{uuid.uuid4().hex[:8]}"
    assert ensure_gpu_limit(name, 1) == 1
    holding, asking = threading.Event(), threading.Event()
    hold = _flow_holding(name, holding, asking)
    results: dict[str, tuple[float, float, float, float]] = {}

    def second() -> None:
        assert holding.wait(60), "the first run never held the slot"
        results["second"] = hold(first=False)

    threads = [threading.Thread(target=lambda: results.update(first=hold(first=True))), threading.Thread(target=second)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert set(results) == {"first", "second"}
    first, second = results["first"], results["second"]
    assert second[2] >= first[3] - 0.2, "the second run held the slot only after the first let it go"
    assert first[0] < HOLD_S - 1.0, first
    assert second[0] >= first[3] - second[1] - 0.3 >= HOLD_S - 0.3, (first, second)
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
