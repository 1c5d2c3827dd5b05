"""The textbook DDP loop by hand, next to minddp.DistributedDataParallel."""

import time

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from minddp import DistributedDataParallel

from .common import generator, print_table, sync


def make_model():
    torch.manual_seed(dist.get_rank())  # different on purpose: the broadcast fixes it
    return nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 1))


def train(model, loader, step_fn, epochs=2):
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    times = []
    for epoch in range(epochs):
        loader.sampler.set_epoch(epoch)  # a new shuffle every epoch
        for x, y in loader:
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
    data = TensorDataset(torch.randn(256, 16, generator=g), torch.randn(256, 1, generator=g))

    def loader():
        return DataLoader(data, batch_size=16, sampler=DistributedSampler(data, seed=0))

    # 1. by hand: broadcast the initial weights, then all-reduce every gradient with AVG
    manual = make_model()
    for p in manual.parameters():
        dist.broadcast(p.data, src=0)

    def average_grads(model):
        for p in model.parameters():
            dist.all_reduce(p.grad, op=dist.ReduceOp.AVG)

    t_manual = train(manual, loader(), average_grads)

    # 2. the engine: same thing, bucketed and overlapped with backward
    engine = DistributedDataParallel(make_model())
    t_engine = train(engine, loader(), lambda m: None)

    for a, b in zip(manual.parameters(), engine.module.parameters()):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)
    print_table("minimal_ddp: same parameters; median step time",
                [f"by hand {t_manual * 1e3:.2f} ms", f"minddp {t_engine * 1e3:.2f} ms",
                 f"{len(list(manual.parameters()))} all-reduces vs "
                 f"{len(engine.bucket_assignment)} bucket(s)"])
