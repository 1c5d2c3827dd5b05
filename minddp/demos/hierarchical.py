"""Two-level all-reduce: reduce inside the node, all-reduce among leaders, broadcast back."""

import torch
import torch.distributed as dist

from .common import device, print_table


def run(ranks_per_node: int = 2) -> None:
    dev = device()  # every tensor names it: no default-device context needed
    r, n = dist.get_rank(), dist.get_world_size()
    k = ranks_per_node
    nodes = [list(range(s, min(s + k, n))) for s in range(0, n, k)]
    # new_group is collective: every rank creates every group, in the same order
    node_groups = [dist.new_group(members) for members in nodes]
    leaders = [members[0] for members in nodes]
    leader_group = dist.new_group(leaders)
    my_node = r // k
    intra, leader = node_groups[my_node], nodes[my_node][0]

    x = torch.tensor([float(r + 1)] * 3, device=dev)
    ref = x.clone()
    dist.all_reduce(ref)

    dist.reduce(x, dst=leader, group=intra)  # 1. node sum at the leader (global rank!)
    if r == leader:
        dist.all_reduce(x, group=leader_group)  # 2. leaders exchange node sums
    dist.broadcast(x, src=leader, group=intra)  # 3. back to every rank of the node

    assert torch.equal(x, ref), (x, ref)
    print_table(f"hierarchical ({len(nodes)} nodes x {k}): result == all_reduce",
                [f"node {my_node}", f"leader {leader}", f"result {x[0].item()}"])
