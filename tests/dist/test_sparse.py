"""Sparse gradients (nn.Embedding / nn.EmbeddingBag with sparse=True) against torch DDP on two
gloo ranks: each such parameter is its own bucket, divided by the world size and all-reduced as a
sparse tensor, in bucket order with the dense buckets; also with find_unused_parameters, no_sync
(accumulated sparse gradients), a comm hook (its GradBucket's buffer is the sparse gradient) and
torch's gradient_as_bucket_view variant. Options that need flat dense buckets are refused."""

import pytest
import torch
from torch import nn

import minddp
from tests import launch

TORCH_DDP = nn.parallel.DistributedDataParallel


class Recommender(nn.Module):
    """A sparse embedding, a sparse embedding bag and a dense head."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(50, 8, sparse=True)
        self.bag = nn.EmbeddingBag(40, 8, mode="sum", sparse=True)
        self.head = nn.Linear(16, 3)

    def forward(self, ids, bag_ids):
        return self.head(torch.cat([self.emb(ids).mean(1), self.bag(bag_ids)], dim=1))


def _hook(state, bucket):
    """torch's allreduce_hook, written out: the 1/n, then SUM, the tensor itself as the result."""
    t = bucket.buffer().div_(torch.distributed.get_world_size())
    return torch.distributed.all_reduce(t, async_op=True).get_future().then(lambda f: f.value()[0])


def _train(rank, world_size, cls, variant):
    torch.manual_seed(0)
    options = {"find_unused": {"find_unused_parameters": True}, "view": {"gradient_as_bucket_view": True}}
    model = cls(Recommender(), **options.get(variant, {}))
    if variant == "hook":
        model.register_comm_hook(None, _hook)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    seen = []
    for step in range(4):
        micro = 2 if variant == "no_sync" else 1
        for m in range(micro):
            g = torch.Generator().manual_seed(100 * step + 10 * m + rank)
            ids, bag = torch.randint(0, 50, (6, 3), generator=g), torch.randint(0, 40, (6, 4), generator=g)
            sync = m == micro - 1
            model.require_backward_grad_sync = sync  # nanoGPT's way: accumulate, then reduce
            model(ids, bag).pow(2).mean().backward()
        seen.append([p.grad.to_dense().clone() for p in model.parameters()])
        opt.step()
        opt.zero_grad()
    return seen, [p.detach().clone() for p in model.parameters()]


def _both(variant):
    def run(rank, world_size):
        return {name: _train(rank, world_size, cls, variant)
                for name, cls in (("torch", TORCH_DDP), ("minddp", minddp.DDP))}
    return run


@pytest.mark.parametrize("variant", ["plain", "find_unused", "no_sync", "hook", "view"])
def test_sparse_gradients_are_averaged_as_torch_ddp(variant):
    per_rank = launch.ranks(_both(variant), 2, timeout=120)
    for got in per_rank:
        (ref_grads, ref_params), (grads, params) = got["torch"], got["minddp"]
        for step, (a, b) in enumerate(zip(ref_grads, grads)):
            for k, (x, y) in enumerate(zip(a, b)):
                assert torch.equal(x, y), (step, k)
        for x, y in zip(ref_params, params):
            assert torch.equal(x, y)
    assert torch.equal(per_rank[0]["minddp"][1][0], per_rank[1]["minddp"][1][0])  # replicas equal


def _still_sparse(rank, world_size):
    model = minddp.DDP(Recommender())
    ids, bag = torch.randint(0, 50, (6, 3)), torch.randint(0, 40, (6, 4))
    model(ids, bag).sum().backward()
    grads = {n: p.grad.is_sparse for n, p in model.module.named_parameters()}
    with pytest.raises(ValueError, match=r"sparse=True.*shard_optimizer=True"):
        minddp.DDP(Recommender(), shard_optimizer=True)
    with pytest.raises(ValueError, match=r"compress='fp16'"):
        minddp.DDP(Recommender(), compress="fp16")
    with pytest.raises(RuntimeError, match="sparse gradient has none"):
        model.grad_norm()
    return grads, model.bucket_assignment


def test_sparse_parameters_get_buckets_of_their_own_and_refuse_flat_only_options():
    grads, buckets = launch.ranks(_still_sparse, 2)[0]
    assert grads == {"emb.weight": True, "bag.weight": True, "head.weight": False, "head.bias": False}
    assert ["emb.weight"] in buckets and ["bag.weight"] in buckets
    assert buckets[0] == ["head.bias", "head.weight"]  # dense buckets first, the flags ride there
