"""Pure bucket-assignment logic: no processes."""

import pytest
import torch

from minddp.buckets import MiB, TensorSpec, assign_buckets, make_buckets

CPU = torch.device("cpu")


def spec(numel, dtype=torch.float32):
    return TensorSpec(numel, dtype, CPU)


def test_small_first_bucket_then_cap():
    specs = [spec(MiB // 4 // 2)] * 6  # 0.5 MiB each in fp32
    buckets = assign_buckets(specs, list(reversed(range(6))), cap_mb=1.5, first_cap_mb=1.0)
    assert buckets == [[5, 4], [3, 2, 1], [0]]


def test_cap_is_strict_but_big_tensor_gets_its_own_bucket():
    specs = [spec(10), spec(MiB), spec(10)]  # the middle one is 4 MiB
    buckets = assign_buckets(specs, [2, 1, 0], cap_mb=1.0)
    assert buckets == [[2], [1], [0]]
    for b in buckets:
        total = sum(specs[i].nbytes for i in b)
        assert total <= MiB or len(b) == 1


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


def test_rejects_nonpositive_cap():
    with pytest.raises(ValueError, match="bucket_cap_mb"):
        assign_buckets([spec(1)], [0], cap_mb=0)


def test_flat_buffer_views_cover_parameters_and_tail():
    params = [torch.zeros(2, 3), torch.zeros(4), torch.zeros(5)]
    buckets = make_buckets(params, [[2, 1], [0]], tail_numel=3)
    assert buckets[0].buffer.numel() == 9 and buckets[1].buffer.numel() == 6 + 3
    v = buckets[1].view(0, params[0].shape)
    v.fill_(7)
    assert buckets[1].buffer[:6].eq(7).all() and buckets[1].buffer[6:].eq(0).all()
    assert buckets[0].grad_nbytes == 9 * 4


def test_union_of_bucket_intervals():
    from minddp.ddp import _union_length

    assert _union_length([]) == 0.0
    assert _union_length([(0.0, 1.0), (0.5, 2.0), (3.0, 4.0)]) == 3.0
    assert _union_length([(0.0, 5.0), (1.0, 2.0)]) == 5.0
