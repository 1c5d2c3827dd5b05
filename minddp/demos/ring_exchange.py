"""Ring exchange: each rank sends to rank+1 and receives from rank-1."""

import torch
import torch.distributed as dist

from .common import print_table


def run() -> None:
    r, n = dist.get_rank(), dist.get_world_size()
    right, left = (r + 1) % n, (r - 1) % n
    send = torch.tensor([float(r)])

    # 1. batch_isend_irecv posts both at once: no ordering can deadlock
    got = torch.empty(1)
    ops = [dist.P2POp(dist.isend, send, right), dist.P2POp(dist.irecv, got, left)]
    for w in dist.batch_isend_irecv(ops):
        w.wait()
    assert got.item() == left

    # 2. blocking send/recv: if everyone sent first, everyone would wait forever on a
    #    rendezvous transport; even ranks send first, odd ranks receive first
    got2 = torch.empty(1)
    if r % 2 == 0:
        dist.send(send, right)
        dist.recv(got2, left)
    else:
        dist.recv(got2, left)
        dist.send(send, right)
    assert got2.item() == left
    print_table("ring_exchange: received from rank-1", [f"batch_isend_irecv={got.item()}",
                                                        f"parity-ordered={got2.item()}"])
