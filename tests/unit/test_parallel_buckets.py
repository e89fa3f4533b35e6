"""Weight-sync bucket planning (rlhf_core.distributed.parallel.plan_buckets): consecutive, bounded, nothing lost."""

from rlhf_core.distributed.parallel import plan_buckets


def test_buckets_are_consecutive_and_bounded():
    numels = [4, 3, 2, 6, 1, 1]
    buckets = plan_buckets(numels, max_numel=6)
    assert buckets == [[0], [1, 2], [3], [4, 5]]
    assert [i for b in buckets for i in b] == list(range(len(numels)))
    assert all(sum(numels[i] for i in b) <= 6 for b in buckets)


def test_a_tensor_larger_than_a_bucket_goes_alone():
    assert plan_buckets([2, 10, 2, 2], max_numel=5) == [[0], [1], [2, 3]]
    assert plan_buckets([10], max_numel=5) == [[0]]
    assert plan_buckets([], max_numel=5) == []
