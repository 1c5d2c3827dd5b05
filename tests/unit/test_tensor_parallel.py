"""Tensor-parallel layers and GPT against their unsplit versions (gloo, 2 ranks = one tp group)."""


import pytest
import torch

from minddp.parallel import tensor_parallel as tp


@pytest.mark.parametrize("parts", [1, 3])
@pytest.mark.parametrize("dim", [0, 1])
def test_shard_unshard_roundtrip(parts, dim):
    full = torch.arange(12 * 6, dtype=torch.float32).view(12, 6)
    if dim == 1:
        full = full.t().contiguous()
    shards = [tp.shard(full, dim, 2, r, parts) for r in range(2)]
    assert all(s.shape[dim] == full.shape[dim] // 2 for s in shards)
    assert torch.equal(tp.unshard(shards, dim, parts), full)


def test_fused_qkv_shard_takes_whole_heads_of_q_k_and_v():
    q, k, v = torch.zeros(4, 2), torch.ones(4, 2), torch.full((4, 2), 2.0)
    s1 = tp.shard(torch.cat([q, k, v]), 0, 2, 1, parts=3)
    assert torch.equal(s1, torch.cat([q[2:], k[2:], v[2:]]))
