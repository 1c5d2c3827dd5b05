"""SPMD: one program, every rank runs it; rank, local rank and world size tell them apart."""

import os

import torch
import torch.distributed as dist

from .common import device, print_table


def run() -> None:
    rank, n = dist.get_rank(), dist.get_world_size()
    local = int(os.environ.get("LOCAL_RANK", rank))
    t = torch.tensor([float(rank)], device=device())
    before = t.item()
    dist.all_reduce(t)  # every rank calls it: the sum of 0 + 1 + ... + (n-1)
    print_table(f"spmd: all_reduce of each rank's own rank (expect n(n-1)/2 = {n * (n - 1) // 2})",
                [f"local_rank={local}", f"world={n}", f"before={before}", f"after={t.item()}"])
    assert t.item() == n * (n - 1) / 2
