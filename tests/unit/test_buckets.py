"""Pure bucket-assignment logic: no processes."""


import pytest
import torch
import torch.distributed as dist

from minddp.engine.buckets import Layout, MiB, TensorSpec, assign_buckets, bucket_limits

CPU = torch.device("cpu")


def spec(numel, dtype=torch.float32):
    return TensorSpec(numel, dtype, CPU)


def test_torch_rule_closes_a_bucket_once_it_reaches_the_cap():
    specs = [spec(MiB // 4 // 2)] * 6  # 0.5 MiB each in fp32
    # explicit cap: every bucket (the first too) closes at >= 1.5 MiB
    assert assign_buckets(specs, list(reversed(range(6))), cap_mb=1.5) == [[5, 4, 3], [2, 1, 0]]
    # 1 MiB first bucket, then 1.5 MiB
    assert assign_buckets(specs, list(reversed(range(6))), cap_mb=1.5, first_cap_mb=1.0) == \
        [[5, 4], [3, 2, 1], [0]]


def test_default_cap_is_torchs_25_mib_after_a_1_mib_first_bucket():
    assert bucket_limits(None) == (MiB, 25 * MiB)
    assert bucket_limits(5) == (5 * MiB, 5 * MiB)


def test_strict_cap_never_exceeds_it_but_big_tensor_gets_its_own_bucket():
    specs = [spec(10), spec(MiB), spec(10)]  # the middle one is 4 MiB
    buckets = assign_buckets(specs, [2, 1, 0], cap_mb=1.0, strict=True)
    assert buckets == [[2], [1], [0]]
    for b in buckets:
        total = sum(specs[i].nbytes for i in b)
        assert total <= MiB or len(b) == 1
    # torch's rule puts the small one before it in the same bucket
    assert assign_buckets(specs, [2, 1, 0], cap_mb=1.0) == [[2, 1], [0]]


def test_tiny_cap_gives_one_parameter_per_bucket_and_huge_cap_one_bucket():
    specs = [spec(100)] * 5
    assert assign_buckets(specs, [4, 3, 2, 1, 0], cap_mb=1e-6) == [[4], [3], [2], [1], [0]]
    assert assign_buckets(specs, [4, 3, 2, 1, 0], cap_mb=1e6) == [[4, 3, 2, 1, 0]]


def test_one_dtype_per_bucket_and_order_by_first_ready():
    specs = [spec(10), spec(10, torch.float64), spec(10), spec(10, torch.float64)]
    buckets = assign_buckets(specs, [3, 2, 1, 0], cap_mb=25)
    assert buckets == [[3, 1], [2, 0]]
    for b in buckets:
        assert len({specs[i].dtype for i in b}) == 1


@pytest.mark.parametrize("cap_mb", [None, 0.001, 0.01, 1, 5, 25])
@pytest.mark.parametrize("sizes", [[100] * 40, [7, 300_000, 5, 1_000_000, 64, 2_000_000, 3] * 3,
                                   [262_144] * 30, [1_500_000, 10, 1_500_000, 10, 400_000]])
def test_same_buckets_as_torchs_own_assignment(cap_mb, sizes):
    """torch's C++ `compute_bucket_assignment_by_size`, called the way its reducer rebuilds
    buckets (gradient-ready order as tensor_indices, limits [first cap, cap])."""
    order = list(reversed(range(len(sizes))))
    tensors = [torch.empty(sizes[i]) for i in order]
    first, cap = bucket_limits(cap_mb)
    theirs, _ = dist._compute_bucket_assignment_by_size(tensors, [first, cap], [False] * len(order), order)
    ours = assign_buckets([spec(n) for n in sizes], order, cap_mb)
    assert ours == [list(b) for b in theirs]


def test_rejects_nonpositive_cap():
    with pytest.raises(ValueError, match="bucket_cap_mb"):
        assign_buckets([spec(1)], [0], cap_mb=0)


def test_flat_buffer_views_cover_parameters_and_tail():
    params = [torch.zeros(2, 3), torch.zeros(4), torch.zeros(5)]
    buckets = Layout.build(params, [[2, 1], [0]], tail_numel=3).buckets
    assert buckets[0].buffer.numel() == 9 and buckets[1].buffer.numel() == 6 + 3
    v = buckets[1].view(0, params[0].shape)
    v.fill_(7)
    assert buckets[1].buffer[:6].eq(7).all() and buckets[1].buffer[6:].eq(0).all()
    assert buckets[0].grad_nbytes == 9 * 4


def test_union_of_bucket_intervals():
    from minddp.engine.observer import _union_length

    assert _union_length([]) == 0.0
    assert _union_length([(0.0, 1.0), (0.5, 2.0), (3.0, 4.0)]) == 3.0
    assert _union_length([(0.0, 5.0), (1.0, 2.0)]) == 5.0
