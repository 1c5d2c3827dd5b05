"""All-reduce built from smaller pieces, to see what the library does for you.

- `ring_all_reduce`: the bandwidth-optimal ring from point-to-point messages only.
  The tensor is cut into n chunks; n-1 reduce-scatter steps (each rank sends one chunk
  to its right neighbour and adds the one from its left) leave rank i with the full sum
  of chunk i+1; n-1 all-gather steps pass the finished chunks round. Each rank sends
  2(n-1)/n * M bytes in 2(n-1) messages: the ring cost 2(n-1)a + 2(n-1)/n * M/b.
- `all_reduce_via_rs_ag`: All-Reduce = Reduce-Scatter + All-Gather, with the library's
  `reduce_scatter_tensor` and `all_gather_into_tensor`.
- `tree_all_reduce`: reduce up a binary tree to rank 0, then broadcast back down, from
  point-to-point messages: 2 ceil(log2 n) hops of the whole message. Fewer messages than
  the ring (log n against n), more bytes per link: it wins for small messages
  (`minddp costmodel tree` gives the crossover).
- `hierarchical_all_reduce`: reduce inside each node, all-reduce among one leader per
  node, broadcast back inside the node: the slow inter-node links carry one copy per node.

All work in place on any length and any floating dtype, with op "sum" or "avg", on a
group given by a process group (default: the world).
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from .. import _compat

OPS = ("sum", "avg")


def _check(tensor: torch.Tensor, op: str) -> None:
    if op not in OPS:
        raise ValueError(f"op must be 'sum' or 'avg', got {op!r}")
    if not tensor.is_floating_point():
        raise TypeError(f"expected a floating-point tensor, got {tensor.dtype}")


def _chunks(flat: torch.Tensor, n: int) -> list[torch.Tensor]:
    """n contiguous views covering `flat`, sizes differing by at most one (some may be empty)."""
    base, extra = divmod(flat.numel(), n)
    sizes = [base + (1 if i < extra else 0) for i in range(n)]
    return list(flat.split(sizes))


def ring_all_reduce(tensor: torch.Tensor, group=None, op: str = "sum") -> torch.Tensor:
    """In-place ring all-reduce from `batch_isend_irecv` (no send/recv ordering deadlock)."""
    _check(tensor, op)
    group = group or dist.group.WORLD
    n, me = dist.get_world_size(group), dist.get_rank(group)
    if n > 1:
        ranks = dist.get_process_group_ranks(group)
        right, left = ranks[(me + 1) % n], ranks[(me - 1) % n]
        flat = tensor.view(-1) if tensor.is_contiguous() else tensor.reshape(-1).clone()
        chunks = _chunks(flat, n)
        recv = torch.empty(max(c.numel() for c in chunks), dtype=flat.dtype, device=flat.device)
        # reduce-scatter: at step s, send chunk (me - s), receive and add chunk (me - s - 1)
        for s in range(n - 1):
            send_c, recv_c = chunks[(me - s) % n], chunks[(me - s - 1) % n]
            buf = recv[: recv_c.numel()]
            _exchange(send_c, right, buf, left, group)
            recv_c.add_(buf)
        # all-gather: rank me now owns the full sum of chunk (me + 1); pass finished chunks on
        for s in range(n - 1):
            send_c, recv_c = chunks[(me + 1 - s) % n], chunks[(me - s) % n]
            _exchange(send_c, right, recv_c, left, group)
        if flat.data_ptr() != tensor.data_ptr():
            tensor.copy_(flat.view_as(tensor))
    if op == "avg":
        tensor.div_(n)
    return tensor


def _exchange(send: torch.Tensor, dst: int, recv: torch.Tensor, src: int, group) -> None:
    # An empty chunk is skipped on both ends of its link: the sender's chunk index is
    # the receiver's, so both sides agree without talking.
    ops = ([dist.P2POp(dist.isend, send, dst, group)] if send.numel() else []) + (
        [dist.P2POp(dist.irecv, recv, src, group)] if recv.numel() else [])
    if ops:
        for work in dist.batch_isend_irecv(ops):
            work.wait()


def all_reduce_via_rs_ag(tensor: torch.Tensor, group=None, op: str = "sum") -> torch.Tensor:
    """In-place all-reduce as reduce-scatter then all-gather (padded to a multiple of n)."""
    _check(tensor, op)
    group = group or dist.group.WORLD
    n = dist.get_world_size(group)
    flat = tensor.reshape(-1)
    per = -(-flat.numel() // n)  # ceil
    padded = torch.zeros(per * n, dtype=flat.dtype, device=flat.device)
    padded[: flat.numel()] = flat
    mine = torch.empty(per, dtype=flat.dtype, device=flat.device)
    rop = dist.ReduceOp.SUM
    dist.reduce_scatter_tensor(mine, padded, op=rop, group=group)
    if op == "avg":
        mine.div_(n)
    dist.all_gather_into_tensor(padded, mine, group=group)
    tensor.copy_(padded[: flat.numel()].view_as(tensor))
    return tensor


def tree_all_reduce(tensor: torch.Tensor, group=None, op: str = "sum") -> torch.Tensor:
    """In place. Group rank i's children are 2i+1 and 2i+2: receive and add theirs, send the
    sum to the parent (2 sends/recvs per level), then the root's total flows back down."""
    _check(tensor, op)
    group = group or dist.group.WORLD
    n, me = dist.get_world_size(group), dist.get_rank(group)
    if n > 1:
        ranks = dist.get_process_group_ranks(group)
        flat = tensor.reshape(-1).clone() if not tensor.is_contiguous() else tensor.view(-1)
        children = [c for c in (2 * me + 1, 2 * me + 2) if c < n]
        buf = torch.empty_like(flat)
        for c in children:  # up: the subtree's sum
            dist.recv(buf, src=ranks[c], group=group)
            flat.add_(buf)
        if me:
            dist.send(flat, dst=ranks[(me - 1) // 2], group=group)
            dist.recv(flat, src=ranks[(me - 1) // 2], group=group)  # down: the total
        for c in children:
            dist.send(flat, dst=ranks[c], group=group)
        if flat.data_ptr() != tensor.data_ptr():
            tensor.copy_(flat.view_as(tensor))
    if op == "avg":
        tensor.div_(n)
    return tensor


class NodeGroups:
    """Intra-node and leader groups for a two-level topology, derived from ranks per node.

    Node of a global rank = rank // ranks_per_node (torchrun numbers ranks node by node).
    Every member of `group` constructs it; only the members of each new group take part in
    creating it (use_local_synchronization), so `group` may be a sub-group such as dp.
    """

    def __init__(self, group=None, ranks_per_node: int | None = None):
        group = group or dist.group.WORLD
        k = ranks_per_node or int(os.environ.get("LOCAL_WORLD_SIZE", "0")) or dist.get_world_size(group)
        ranks = dist.get_process_group_ranks(group)
        nodes: dict[int, list[int]] = {}
        for r in ranks:
            nodes.setdefault(r // k, []).append(r)
        me = dist.get_rank()
        self.node_ranks = nodes[me // k]
        self.leaders = [members[0] for members in nodes.values()]
        self.leader = self.node_ranks[0]
        self.size = len(ranks)
        self.intra = dist.new_group(self.node_ranks, use_local_synchronization=True)
        self.inter = (dist.new_group(self.leaders, use_local_synchronization=True)
                      if me in self.leaders else None)


def hierarchical_all_reduce(tensor: torch.Tensor, groups: NodeGroups, op: str = "sum") -> torch.Tensor:
    """In place: reduce to the node leader, all-reduce among leaders, broadcast in the node."""
    _check(tensor, op)
    if len(groups.node_ranks) > 1:
        dist.reduce(tensor, dst=groups.leader, group=groups.intra)
    if dist.get_rank() == groups.leader and len(groups.leaders) > 1:
        dist.all_reduce(tensor, group=groups.inter)
    if len(groups.node_ranks) > 1:
        dist.broadcast(tensor, src=groups.leader, group=groups.intra)
    if op == "avg":
        tensor.div_(groups.size)
    return tensor


# One bucket's worth (torch's default cap; torch's own module sync uses 250 MB): the flattened
# copy each chunk needs stays small. A tensor of 1 MiB or more travels as it is (in place, no
# copy): wrapping then never holds a second copy of the model's large tensors at all.
_BROADCAST_CHUNK_BYTES = 25 * 1024 * 1024
_BROADCAST_ALONE_BYTES = 1024 * 1024


@torch.no_grad()
def broadcast_coalesced(tensors: list[torch.Tensor], group, src: int) -> None:
    """Broadcast `tensors` in place from global rank `src`: large contiguous tensors one by
    one as they are, the small ones as one flat tensor per dtype/device chunk of <= 25 MB."""
    if dist.get_world_size(group) == 1 or not tensors:
        return
    groups: dict[tuple, list[list[torch.Tensor]]] = {}
    for t in tensors:
        if t.is_contiguous() and t.nbytes >= _BROADCAST_ALONE_BYTES:
            dist.broadcast(t, src=src, group=group)
            continue
        chunks = groups.setdefault((t.dtype, t.device), [[]])
        if chunks[-1] and sum(x.nbytes for x in chunks[-1]) + t.nbytes > _BROADCAST_CHUNK_BYTES:
            chunks.append([])
        chunks[-1].append(t)
    is_src = dist.get_rank() == src
    for chunks in groups.values():
        for chunk in chunks:
            flat = _compat.flatten_dense_tensors(chunk)
            dist.broadcast(flat, src=src, group=group)
            if not is_src:
                for t, v in zip(chunk, _compat.unflatten_dense_tensors(flat, chunk)):
                    t.copy_(v)


# ------------------------------------------------- ZeRO-1's collectives, in place
class Works:
    """One or more async Works seen as one future (done()/wait()), as the engine's futures."""

    def __init__(self, works: list):
        self.works = works

    def done(self) -> bool:
        return all(w.is_completed() for w in self.works)

    def wait(self):
        for w in self.works:
            w.wait()  # on CUDA: the current stream waits, the host does not
        return None


def _copies_through_a_temporary(group) -> bool:
    """gloo's reduce_scatter and all_gather copy the whole tensor through a temporary of its
    size (measured: +1x and +1.5x the bucket at their peak); its reduce and broadcast work in
    place. NCCL's are in place."""
    return str(dist.get_backend(group)) == "gloo"


def reduce_scatter_in_place(buffer: torch.Tensor, group, op) -> Works:
    """Async: rank r of the group receives the reduction of its 1/n slice of `buffer`, in
    place (the other slices are left undefined). On gloo: n in-place reduces, one per slice."""
    n = dist.get_world_size(group)
    per, me = buffer.numel() // n, dist.get_group_rank(group, dist.get_rank())
    if not _copies_through_a_temporary(group):
        return Works([_compat.reduce_scatter_single(buffer[me * per:(me + 1) * per], buffer, op=op,
                                                    group=group, async_op=True)])
    ranks = dist.get_process_group_ranks(group)
    return Works([dist.reduce(buffer[r * per:(r + 1) * per], dst=ranks[r], op=op, group=group, async_op=True)
                  for r in range(n)])


def all_gather_in_place(buffer: torch.Tensor, group) -> Works:
    """Async: every rank's 1/n slice of `buffer` to every rank, in place. On gloo: n in-place
    broadcasts, one per slice."""
    n = dist.get_world_size(group)
    per, me = buffer.numel() // n, dist.get_group_rank(group, dist.get_rank())
    if not _copies_through_a_temporary(group):
        return Works([_compat.all_gather_single(buffer, buffer[me * per:(me + 1) * per], group=group,
                                                async_op=True)])
    ranks = dist.get_process_group_ranks(group)
    return Works([dist.broadcast(buffer[r * per:(r + 1) * per], src=ranks[r], group=group, async_op=True)
                  for r in range(n)])
