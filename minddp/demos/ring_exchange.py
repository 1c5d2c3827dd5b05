"""Ring exchange: each rank sends to rank+1 and receives from rank-1.

Point-to-point has a rule collectives hide: the receiver allocates the buffer, and it must
have exactly the sender's shape and dtype (the transport moves bytes; a wrong size hangs or
fails, a wrong dtype silently reinterprets them). Part 3 sends the shape and dtype first,
allocates from them, and checks what arrived.
"""

import torch
import torch.distributed as dist

from .common import device, print_table


def run() -> None:
    dev = device()  # every tensor names it: no default-device context needed
    r, n = dist.get_rank(), dist.get_world_size()
    right, left = (r + 1) % n, (r - 1) % n
    send = torch.tensor([float(r)], device=dev)

    # 1. batch_isend_irecv posts both at once: no ordering can deadlock
    got = torch.empty(1, device=dev)
    ops = [dist.P2POp(dist.isend, send, right), dist.P2POp(dist.irecv, got, left)]
    for w in dist.batch_isend_irecv(ops):
        w.wait()
    assert got.item() == left

    # 2. blocking send/recv: if everyone sent first, everyone would wait forever on a
    #    rendezvous transport; even ranks send first, odd ranks receive first
    got2 = torch.empty(1, device=dev)
    if r % 2 == 0:
        dist.send(send, right)
        dist.recv(got2, left)
    else:
        dist.recv(got2, left)
        dist.send(send, right)
    assert got2.item() == left

    # 3. the receiver allocates the exact shape and dtype: send them first
    payload = torch.arange(6, dtype=torch.bfloat16, device=dev).view(2, 3) + r
    got3 = exchange_with_header(payload, right, left)
    expected = torch.arange(6, dtype=torch.bfloat16, device=dev).view(2, 3) + left
    if got3.shape != expected.shape or got3.dtype != expected.dtype or not torch.equal(got3, expected):
        raise AssertionError(f"rank {r}: received {got3.dtype} {list(got3.shape)}, expected "
                             f"{expected.dtype} {list(expected.shape)}: the receiver must allocate "
                             "the sender's exact shape and dtype")
    print_table("ring_exchange: received from rank-1", [f"batch_isend_irecv={got.item()}",
                                                        f"parity-ordered={got2.item()}",
                                                        f"with header: {got3.dtype} {list(got3.shape)}"])


DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.int64]


def exchange_with_header(t: torch.Tensor, dst: int, src: int) -> torch.Tensor:
    """Send `t` to dst and receive from src a tensor whose shape and dtype arrive first."""
    header = torch.tensor([DTYPES.index(t.dtype), t.dim(), *t.shape, *[0] * (4 - t.dim())], device=t.device)
    theirs = torch.empty(6, dtype=torch.int64, device=t.device)
    ops = [dist.P2POp(dist.isend, header, dst), dist.P2POp(dist.irecv, theirs, src)]
    for w in dist.batch_isend_irecv(ops):
        w.wait()
    code, ndim, *dims = theirs.tolist()
    out = torch.empty(dims[:ndim], dtype=DTYPES[code], device=t.device)  # exactly what the sender has
    for w in dist.batch_isend_irecv([dist.P2POp(dist.isend, t.contiguous(), dst),
                                     dist.P2POp(dist.irecv, out, src)]):
        w.wait()
    return out
