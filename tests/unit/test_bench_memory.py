"""``bench/side_by_side.py``'s concurrent peak: what processes sharing a GPU held at one moment.

The bench's ``peak_memory_gb`` sums each process's whole-run peak; a colocated rollout replica that frees its
weights after the rollout (``rl.rollout_sleep``) peaks while the learner does not, so only the sum at one moment
(``peak_memory_gb_concurrent``) shows what the GPU held. Hand-made windows, values worked out below; and the
files the peak writer leaves, read back.
"""

from __future__ import annotations

import json


def test_concurrent_peak_sums_the_windows_that_hold_each_moment(bench):
    """Learner windows (s, GB): [0,1) 10, [1,2) 30 (its update), [2,3) 10; replica: [0,1) 20 (rollout), [1,2) 2
    (released), [2,3) 20. At t = 0: 10 + 20 = 30; t = 1: 30 + 2 = 32; t = 2: 10 + 20 = 30, so 32 GB at one moment,
    where the whole-run peaks sum to 30 + 20 = 50. Windows that do not line up count what overlaps: the replica's
    [0.25, 1.25) 20 overlaps the learner's [1, 2) 30 at t = 1, so 50 there (an upper bound, never above the sum
    of peaks). A process with no window at t adds nothing."""
    learner = [[0.0, 1.0, 10.0], [1.0, 2.0, 30.0], [2.0, 3.0, 10.0]]
    replica = [[0.0, 1.0, 20.0], [1.0, 2.0, 2.0], [2.0, 3.0, 20.0]]
    assert bench.measure.concurrent_peak_gb([learner, replica]) == 32.0
    shifted = [[0.25, 1.25, 20.0], [1.25, 2.25, 2.0]]
    assert bench.measure.concurrent_peak_gb([learner, shifted]) == 50.0
    assert bench.measure.concurrent_peak_gb([learner, [[2.5, 3.0, 1.0]]]) == 30.0
    assert bench.measure.concurrent_peak_gb([]) == 0.0


def test_peak_files_give_the_sum_of_peaks_and_the_concurrent_peak(bench, tmp_path):
    """Two writers' files on one GPU (the format ``_write_peak`` leaves) and a host-only one: the sum of peaks is
    30 + 20 = 50 GB, the concurrent peak 32 GB (the first test's windows); a CPU process has no windows."""
    gpu = "GPU-0"
    records = [{"pid": 1, "peak_gb": {gpu: 30.0}, "windows_gb": {gpu: [[0, 1, 10.0], [1, 2, 30.0], [2, 3, 10.0]]}},
               {"pid": 2, "peak_gb": {gpu: 20.0}, "windows_gb": {gpu: [[0, 1, 20.0], [1, 2, 2.0], [2, 3, 20.0]]}},
               {"pid": 3, "peak_gb": {"host:3": 1.5}}]
    for r in records:
        (tmp_path / f"{r['pid']}.json").write_text(json.dumps(r))
    (tmp_path / "4.json").write_text("{not json")  # a file cut off as its process was killed: skipped
    by_device, concurrent = bench.measure.read_peaks(tmp_path)
    assert by_device == {gpu: 50.0, "host:3": 1.5}
    assert concurrent == {gpu: 32.0}
