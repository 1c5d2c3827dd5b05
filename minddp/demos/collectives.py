"""The six collectives on tiny tensors, each checked against its closed form."""

import torch
import torch.distributed as dist

from minddp._compat import all_gather_single, reduce_scatter_single

from .common import as_list, device, print_table


def run() -> None:
    dev = device()  # every tensor names it: no default-device context needed
    r, n = dist.get_rank(), dist.get_world_size()
    ar = torch.arange(n, dtype=torch.float32, device=dev) + r

    b = torch.tensor([float(r)] * 2, device=dev)
    dist.broadcast(b, src=0)  # everyone gets rank 0's tensor
    assert b.tolist() == [0.0, 0.0]

    red = ar.clone()
    dist.reduce(red, dst=0)  # only rank 0's result is defined: sum over ranks
    if r == 0:
        assert red.tolist() == [n * i + n * (n - 1) / 2 for i in range(n)]

    allr = ar.clone()
    dist.all_reduce(allr)  # everyone gets the sum: n*i + n(n-1)/2 at position i
    assert allr.tolist() == [n * i + n * (n - 1) / 2 for i in range(n)]

    rs = torch.empty(1, device=dev)
    reduce_scatter_single(rs, ar.clone())  # rank i keeps element i of the sum
    assert rs.item() == n * r + n * (n - 1) / 2  # 6, 10, 14, 18 for n=4

    ag = torch.empty(n, device=dev)
    all_gather_single(ag, torch.tensor([float(r * r)], device=dev))  # everyone gets [0, 1, 4, ...]
    assert ag.tolist() == [float(i * i) for i in range(n)]

    a2a_in = torch.tensor([10.0 * r + j for j in range(n)], device=dev)  # element j goes to rank j
    a2a = torch.empty(n, device=dev)
    dist.all_to_all_single(a2a, a2a_in)  # rank r receives 10*j + r from every rank j: a transpose
    assert a2a.tolist() == [10.0 * j + r for j in range(n)]

    print_table("collectives (input arange(n) + rank):",
                [f"broadcast={as_list(b)}", f"all_reduce={as_list(allr)}", f"reduce_scatter={rs.item()}",
                 f"all_gather={as_list(ag)}", f"all_to_all={as_list(a2a)}"]
                + ([f"reduce={as_list(red)}"] if r == 0 else []))
