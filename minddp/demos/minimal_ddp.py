"""The textbook DDP loop by hand, next to minddp.DistributedDataParallel."""

import time

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DistributedSampler, TensorDataset

from minddp import DistributedDataParallel

from .common import device, generator, print_table, sync


def make_model():
    torch.manual_seed(dist.get_rank())  # different on purpose: the broadcast fixes it
    dev = device()
    return nn.Sequential(nn.Linear(16, 64, device=dev), nn.Tanh(), nn.Linear(64, 64, device=dev), nn.Tanh(),
                         nn.Linear(64, 1, device=dev))


def batches(data, sampler, size=16):
    """This rank's shard in batches of `size` (what a DataLoader with this sampler yields; its
    start-up seed draw would follow torch's default device, these indices do not)."""
    with torch.device("cpu"):  # the shuffle is host work: randperm on its CPU generator, whatever
        idx = list(sampler)    # default device the caller set (torch.set_default_device("cuda"))
    for i in range(0, len(idx), size):
        yield data[idx[i:i + size]]


def train(model, data, step_fn, epochs=2):
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    sampler = DistributedSampler(data, seed=0)  # same shuffle on every rank, disjoint shards
    times = []
    for epoch in range(epochs):
        sampler.set_epoch(epoch)  # a new shuffle every epoch
        for x, y in batches(data, sampler):
            t0 = time.perf_counter()
            opt.zero_grad()
            nn.functional.mse_loss(model(x), y).backward()
            step_fn(model)
            opt.step()
            sync()
            times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


def run() -> None:
    g = generator(0)
    data = TensorDataset(torch.randn(256, 16, generator=g, device=g.device),
                         torch.randn(256, 1, generator=g, device=g.device))

    # 1. by hand: broadcast the initial weights, then all-reduce every gradient with AVG
    manual = make_model()
    for p in manual.parameters():
        dist.broadcast(p.data, src=0)

    def average_grads(model):
        for p in model.parameters():
            dist.all_reduce(p.grad, op=dist.ReduceOp.AVG)

    t_manual = train(manual, data, average_grads)

    # 2. the engine: same thing, bucketed and overlapped with backward
    engine = DistributedDataParallel(make_model())
    t_engine = train(engine, data, lambda m: None)

    for a, b in zip(manual.parameters(), engine.module.parameters()):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)
    print_table("minimal_ddp: same parameters; median step time",
                [f"by hand {t_manual * 1e3:.2f} ms", f"minddp {t_engine * 1e3:.2f} ms",
                 f"{len(list(manual.parameters()))} all-reduces vs "
                 f"{len(engine.bucket_assignment)} bucket(s)"])
