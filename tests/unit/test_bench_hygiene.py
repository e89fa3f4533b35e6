"""The side-by-side harness's hygiene (``bench/side_by_side_parts/hygiene.py`` and its use): a call below the
minimums is refused before any child starts, a row's median / min / max come from its timed steps over every
round, a row whose max/min exceeds 1.5 is flagged, rows run in ABBA order, and the TRL search's winner is never
slower than trl-default. Small hand-made inputs, on the CPU.
"""

from __future__ import annotations

import importlib
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
if str(REPO / "bench") not in sys.path:
    sys.path.insert(0, str(REPO / "bench"))

hygiene = importlib.import_module("side_by_side_parts.hygiene")
settings = importlib.import_module("side_by_side_parts.settings")
summary = importlib.import_module("side_by_side_parts.summary")
search = importlib.import_module("side_by_side_parts.search")
step_profiles = importlib.import_module("side_by_side_parts.step_profiles")


@pytest.fixture(scope="module")
def script():
    """``bench/side_by_side.py`` as a module (its parser and ``_plan``)."""
    spec = importlib.util.spec_from_file_location("side_by_side_script", REPO / "bench" / "side_by_side.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_the_gpu_variants_defaults_meet_the_minimums():
    """0.5B: 8 steps a child, 2 warm-up, 2 rounds: (8 - 2) x 2 = 12 >= 8 timed offline steps; GRPO 5 steps:
    (5 - 2) x 2 = 6 >= 5."""
    s = settings.SETTINGS["gpu"]
    steps = {b: s[b]["steps"] for b in settings.BENCHES}
    assert hygiene.plan_problems(steps, warmup=2, rounds=2) == []


@pytest.mark.parametrize("steps,warmup,rounds,needle", [
    ({"sft": 8}, 1, 2, "--warmup 1"),  # one warm-up step
    ({"sft": 8}, 2, 1, "--rounds 1"),  # one round: 6 timed steps too
    ({"grpo": 4}, 2, 2, "grpo: 4 timed steps"),  # (4 - 2) x 2 = 4 < 5
    ({"dpo": 5}, 2, 2, "dpo: 6 timed steps"),  # (5 - 2) x 2 = 6 < 8
])
def test_a_call_below_the_minimums_is_refused_unless_waived(steps, warmup, rounds, needle):
    problems = hygiene.plan_problems(steps, warmup, rounds)
    assert any(needle in p for p in problems), problems
    with pytest.raises(SystemExit, match="refused by the harness's hygiene minimums"):
        hygiene.enforce(problems, waive=False)
    record = hygiene.enforce(problems, waive=True)
    assert record["waived"] is True and record["problems"] == problems


def test_the_script_refuses_before_any_child(script):
    """``--rounds 1 --warmup 1`` on the 0.5B SFT bench: SystemExit from ``_plan`` (no model is built)."""
    ap = script._parser()
    args = ap.parse_args(["--variant", "gpu", "--bench", "sft", "--rounds", "1", "--warmup", "1"])
    with pytest.raises(SystemExit, match="hygiene"):
        script._plan(ap, args)
    args = ap.parse_args(["--variant", "gpu", "--bench", "sft", "--rounds", "1", "--warmup", "1", "--waive-hygiene"])
    _, _, record = script._plan(ap, args)
    assert record["waived"] and record["threads"] == settings.SETTINGS["gpu"]["threads"]


def test_the_search_needs_one_round_but_the_same_steps():
    """The search ranks configurations: 1 round of 10 steps (8 timed) passes, 1 round of 8 (6 timed) does not."""
    assert hygiene.plan_problems({"sft": 10}, 2, 1, search=True) == []
    assert hygiene.plan_problems({"sft": 8}, 2, 1, search=True) == ["sft: 6 timed steps a row (1 rounds x (8 steps "
                                                                    "- 2 warm-up)); at least 8"]


def test_spread_median_min_max_and_the_flag():
    """[0.10, 0.12, 0.16, 0.11]: median (0.11 + 0.12) / 2 = 0.115, min 0.10, max 0.16, max/min 1.6 > 1.5:
    flagged; [0.10, 0.14, 0.12]: 1.4, not flagged."""
    s = hygiene.spread([0.10, 0.12, 0.16, 0.11])
    assert s == {"median_step_s": 0.115, "min_step_s": 0.1, "max_step_s": 0.16, "max_over_min": 1.6, "flagged": True}
    assert hygiene.spread([0.10, 0.14, 0.12])["flagged"] is False
    assert hygiene.spread([0.10, 0.15])["flagged"] is False  # exactly 1.5 is not above it


def test_row_summary_drops_each_childs_warmup_and_pools_the_rounds():
    """Two children of 5 steps, warm-up 2: timed [0.2, 0.21, 0.22] and [0.2, 0.5, 0.21] -> median 0.21, min
    0.2, max 0.5, max/min 2.5: flagged; round medians 0.21 and 0.21. The warm-up's 9.0 s is in no figure."""
    runs = [{"step_s": [9.0, 1.0, 0.2, 0.21, 0.22], "peak_memory_gb": 1.0, "hygiene": {"intra_op_threads": 8}},
            {"step_s": [9.0, 1.0, 0.2, 0.5, 0.21], "peak_memory_gb": 1.2, "hygiene": {"intra_op_threads": 8}}]
    facts = {"tokens_per_row": {"sft": 100.0}, "flop_params": 1e6, "rm_flop_params": 1e5}
    e = summary.row_summary("sft", runs, 2, {"matmul_flops": 1e12}, facts, "gpu")
    assert (e["median_step_s"], e["min_step_s"], e["max_step_s"]) == (0.21, 0.2, 0.5)
    assert e["max_over_min"] == 2.5 and e["flagged"] is True
    assert e["round_medians_s"] == [0.21, 0.21] and e["timed_steps"] == 6 and e["enough_timed_steps"] is False
    assert e["hygiene"] == {"intra_op_threads": 8} and "hygiene_by_run" not in e


def test_abba_order():
    """Two rounds over [a, b, c]: a b c, then c b a."""
    assert settings.schedule(["a", "b", "c"], 2) == [(0, "a"), (0, "b"), (0, "c"), (1, "c"), (1, "b"), (1, "a")]
    assert [r for _, r in settings.schedule(["a", "b"], 4)] == ["a", "b", "b", "a", "a", "b", "b", "a"]


def test_rows_with_different_threads_or_allocator_are_reported():
    same = {"intra_op_threads": 8, "OMP_NUM_THREADS": "8", "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True",
            "sdpa": hygiene.SDPA["ours"]}
    other = {**same, "intra_op_threads": 16, "sdpa": hygiene.SDPA["torch-default"]}
    assert hygiene.compare_rows({"ours-bf16": same, "trl-ours-backend": same})["problems"] == []
    report = hygiene.compare_rows({"ours-bf16": same, "trl-default": other})
    assert report["same"]["intra_op_threads"] is False and "intra_op_threads differs" in report["problems"][0]
    assert hygiene.same_backend(same, other) is False and hygiene.same_backend(same, dict(same)) is True


def test_trl_rows_options():
    """trl-ours-backend: TRL's defaults with cuDNN's SDPA off; trl-best from a search: default + the winner's."""
    assert settings.trl_options("trl-ours-backend")["sdpa"] == "ours"
    assert settings.trl_options("trl-default") == {"liger": False, "padding_free": False, "attn": "sdpa",
                                                   "sdpa": "torch-default", "grad_ckpt": None, "static_cache": False}
    best = settings.trl_options("trl-best", {"liger": True})
    assert best["liger"] is True and best["padding_free"] is False and best["sdpa"] == "torch-default"
    assert settings.trl_options("trl-best")["padding_free"] is True  # no search given: the legacy set



def test_a_trl_row_with_an_earlier_rows_options_shares_its_runs():
    """trl-best of a search won by cuDNN's SDPA off runs what trl-ours-backend runs: one of them runs, in the
    ABBA order; a liger winner is a row of its own."""
    rows = ["ours-bf16-packed", "trl-default", "trl-ours-backend", "trl-best"]
    assert settings.shared_runs(rows, {"sdpa": "ours"}) == {"trl-best": "trl-ours-backend"}
    assert settings.shared_runs(rows[::-1], {"sdpa": "ours"}) == {"trl-ours-backend": "trl-best"}
    assert settings.shared_runs(rows, {"liger": True}) == {}
    assert settings.shared_runs(rows, {}) == {"trl-best": "trl-default"}  # no configuration beat trl-default
    assert settings.shared_runs(rows) == {}  # no search given: the legacy trl-best (liger, padding-free)
    assert settings.shared_runs(["trl-default", "trl-mixed"]) == {}  # another dtype and regime

def _search_results(medians: dict[str, float]) -> dict:
    rows = {r: {"median_step_s": m, "min_step_s": m, "max_step_s": m} for r, m in medians.items()}
    return {"sft": {"runs": {r: [] for r in medians}, "summary": {"rows": rows}}}


def test_the_search_winner_is_never_slower_than_default():
    won = search.search_table(_search_results({"trl-default": 0.19, "trl-liger": 0.14, "trl-eager": 0.27}))
    assert won["winner"] == "trl-liger" and won["winner_options"] == {"liger": True}
    assert won["winner_over_default"] == round(0.14 / 0.19, 3) and won["ranking"][0] == "trl-liger"
    none = search.search_table(_search_results({"trl-default": 0.19, "trl-eager": 0.27, "trl-ckpt-on": 0.23}))
    assert none["winner"] == "trl-default" and none["winner_options"] == {}
    assert "no configuration beat trl-default" in none["note"]


def test_the_deadline_stops_launching_and_records_what_it_skipped():
    d = hygiene.Deadline(10, started=time.perf_counter() - 9.0)
    assert d.allows(0.5, "short") is True
    assert d.allows(5, "sft round 1 trl-default") is False
    assert d.record() == {"deadline_s": 10, "skipped": ["sft round 1 trl-default"], "stopped_early": True}
    assert hygiene.Deadline(0).allows(1e9, "x") is True  # no deadline


def test_step_profiles_keep_the_slowest_and_fastest_timed_step():
    """Four steps of one profiler run, timed 0.3 (warm-up), 0.1, 0.4 and 0.2 s, warm-up 1: slowest index 2,
    fastest 1; the third step's 3 matmuls are counted in its own step, not the others'."""
    import torch

    p = step_profiles.StepProfiles()
    p.start()
    for i, step_s in enumerate((0.3, 0.1, 0.4, 0.2)):
        for _ in range(3 if i == 2 else 1):
            torch.ones(64, 64) @ torch.ones(64, 64)
        p.mark(step_s)
    p.stop()
    ex = p.extremes(warmup=1)
    assert ex["slowest"]["index"] == 2 and ex["fastest"]["index"] == 1 and ex["step_s"] == [0.3, 0.1, 0.4, 0.2]
    mm = {s["index"]: next(op["calls"] for op in s["top_host_ops"] if op["op"] == "aten::matmul")
          for s in (ex["slowest"], ex["fastest"])}
    assert mm == {2: 3, 1: 1}


def test_kernels_go_to_the_step_of_their_device_side_range():
    """On a GPU kineto records each ``bench#step`` range twice, on the host and on the device (later: kernels
    run behind their launches). Host ranges [0, 10) and [10, 20) ms, device ranges [2, 12) and [12, 25): a kernel
    starting at 11 belongs to step 0 (the device range), though it starts inside the host range of step 1; host
    ops go by the host ranges. Mixing the two lists (the first version) misnumbered the steps. Device busy:
    1 ms of kernel in step 0, 4 ms in step 1."""
    from types import SimpleNamespace as NS

    from torch.autograd import DeviceType

    def ev(name, start, end, cuda=False, self_us=0.0):
        tr = NS(start=start, end=end, elapsed_us=lambda: end - start)
        return NS(name=name, time_range=tr, device_type=DeviceType.CUDA if cuda else DeviceType.CPU,
                  self_cpu_time_total=self_us)

    step = step_profiles.STEP
    ms = 1000  # the profiler's times are in microseconds
    events = [ev(step, 0, 10 * ms), ev(step, 10 * ms, 20 * ms), ev(step, 2 * ms, 12 * ms, cuda=True),
              ev(step, 12 * ms, 25 * ms, cuda=True), ev("aten::mm", 5 * ms, 6 * ms, self_us=1.0),
              ev("aten::add", 15 * ms, 16 * ms, self_us=2.0), ev("gemm_kernel", 11 * ms, 12 * ms, cuda=True),
              ev("add_kernel", 13 * ms, 17 * ms, cuda=True)]
    p = step_profiles.StepProfiles()
    p.walls = [0.1, 0.2]
    split = p._split(events)
    assert [s["top_host_ops"][0]["op"] for s in split] == ["aten::mm", "aten::add"]
    assert [s["top_device_ops"][0]["op"] for s in split] == ["gemm_kernel", "add_kernel"]
    assert [s["device_busy_s"] for s in split] == [0.001, 0.004]


def test_the_grpo_search_has_its_own_configurations_and_names_their_options():
    assert set(settings.SEARCHES) == {"sft", "grpo"}
    assert not any(o.get("padding_free") for o in settings.SEARCH_GRPO.values())  # no such option in GRPO's step
    medians = {"trl-default": 9.1, "trl-static-cache": 7.5, "trl-liger": 12.5}
    table = search.search_table({"grpo": {"runs": {r: [] for r in medians},
                                          "summary": {"rows": {r: {"median_step_s": m} for r, m in medians.items()}}}})
    assert table["bench"] == "grpo" and table["winner"] == "trl-static-cache"
    assert table["winner_options"] == {"static_cache": True}
    best = settings.trl_options("trl-best", table["winner_options"])
    assert best["static_cache"] is True and best["liger"] is False
