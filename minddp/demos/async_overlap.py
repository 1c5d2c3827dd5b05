"""Overlap: start an all-reduce with async_op=True, compute, then wait."""

import time

import torch
import torch.distributed as dist

from .common import device, print_table, sync


def run(size: int = 2**21, mat: int = 384) -> None:
    dev = device()  # every tensor names it: no default-device context needed
    grad = torch.ones(size, device=dev)
    a = torch.randn(mat, mat, device=dev)

    def compute():
        return (a @ a @ a).sum()

    dist.barrier()
    t0 = time.perf_counter()
    dist.all_reduce(grad)  # blocking: compute waits for communication
    compute()
    sync()
    blocking = time.perf_counter() - t0

    grad.fill_(1.0)
    dist.barrier()
    t0 = time.perf_counter()
    work = dist.all_reduce(grad, async_op=True)  # returns at once; the comm thread does the work
    compute()  # meanwhile, compute
    work.wait()  # only now must the result be there
    sync()
    overlapped = time.perf_counter() - t0

    assert torch.all(grad == dist.get_world_size())  # the result is right either way
    print_table("async: blocking all_reduce + matmul vs async all_reduce overlapped with the matmul",
                [f"blocking {blocking * 1e3:.1f} ms", f"overlapped {overlapped * 1e3:.1f} ms"])
