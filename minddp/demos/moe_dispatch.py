"""Mixture-of-experts dispatch: tokens travel to their expert's rank and back with all_to_all."""

import torch
import torch.distributed as dist

from .common import device, generator, print_table

D = 4  # token width


def expert(e: int, x: torch.Tensor) -> torch.Tensor:
    """Expert e (lives on rank e): a different, easy-to-check function per expert."""
    return x * (e + 1) + e


def run(tokens_per_rank: int = 6) -> None:
    dev = device()  # every tensor names it: no default-device context needed
    r, n = dist.get_rank(), dist.get_world_size()
    g = generator(100 + r)
    x = torch.randn(tokens_per_rank, D, generator=g, device=dev)
    dest = torch.randint(0, n, (tokens_per_rank,), generator=g, device=dev)  # one expert per rank

    # 1. group my tokens by destination and tell everyone how many are coming
    order = torch.argsort(dest, stable=True)
    send_counts = torch.bincount(dest, minlength=n)
    recv_counts = torch.empty_like(send_counts)
    dist.all_to_all_single(recv_counts, send_counts)

    # 2. dispatch with uneven split sizes
    recv = torch.empty(int(recv_counts.sum()), D, device=dev)
    dist.all_to_all_single(recv, x[order], recv_counts.tolist(), send_counts.tolist())

    # 3. the local expert works on what arrived
    out = expert(r, recv)

    # 4. combine: the reverse all_to_all, then undo the sort
    back = torch.empty(tokens_per_rank, D, device=dev)
    dist.all_to_all_single(back, out, send_counts.tolist(), recv_counts.tolist())
    result = torch.empty_like(back)
    result[order] = back

    # check against one process doing it all locally
    expected = torch.stack([expert(int(e), t) for t, e in zip(x, dest)])
    torch.testing.assert_close(result, expected)
    print_table("moe_dispatch: tokens sent to each expert / received by mine",
                [f"send {send_counts.tolist()}", f"recv {recv_counts.tolist()}"])
