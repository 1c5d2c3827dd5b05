"""All-Reduce = Reduce-Scatter + All-Gather, by hand, against dist.all_reduce."""

import torch
import torch.distributed as dist

from minddp._compat import all_gather_single, reduce_scatter_single

from .common import as_list, device, print_table


def run(numel: int = 10) -> None:
    dev = device()  # every tensor names it: no default-device context needed
    r, n = dist.get_rank(), dist.get_world_size()
    x = torch.arange(numel, dtype=torch.float32, device=dev) * (r + 1)
    ref = x.clone()
    dist.all_reduce(ref)

    per = -(-numel // n)  # pad to a multiple of n
    padded = torch.zeros(per * n, device=dev)
    padded[:numel] = x
    mine = torch.empty(per, device=dev)
    reduce_scatter_single(mine, padded)  # step 1: each rank owns the sum of one chunk
    all_gather_single(padded, mine)  # step 2: everyone collects every chunk
    result = padded[:numel]

    torch.testing.assert_close(result, ref)
    print_table("manual_all_reduce: reduce_scatter + all_gather == all_reduce",
                [f"my chunk {as_list(mine)}", f"result {as_list(result)}"])
