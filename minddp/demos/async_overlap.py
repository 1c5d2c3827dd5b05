"""Overlap: start an all-reduce with async_op=True, compute, then wait."""

import time

import torch
import torch.distributed as dist

from .common import device, print_table, sync


def run(size: int = 2**21, mat: int = 384, late_s: float = 0.5) -> dict:
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
    # the overlap itself, without a stopwatch race (on shared cores the times above may not show
    # it): the last rank joins `late_s` late, so no one's all-reduce can finish before it; every
    # other rank computes while its own is still in flight
    late = dist.get_world_size() - 1
    grad.fill_(1.0)
    dist.barrier()
    if dist.get_rank() == late:
        time.sleep(late_s)
    work = dist.all_reduce(grad, async_op=True)
    compute().item()  # its result on the host: waits for the matmul only, not the collective
    pending = not work.is_completed()  # the matmul finished first: it ran under the collective
    work.wait()
    sync()
    assert torch.all(grad == dist.get_world_size())
    assert pending or dist.get_rank() == late, "the all-reduce finished before the late rank joined"
    print_table("async: blocking all_reduce + matmul vs async all_reduce overlapped with the matmul",
                [f"blocking {blocking * 1e3:.1f} ms", f"overlapped {overlapped * 1e3:.1f} ms",
                 f"matmul done while the all-reduce waited for rank {late}: {pending}"])
    return {"blocking_s": blocking, "overlapped_s": overlapped, "computed_while_pending": pending}
