"""The global gradient norm and clipping, for every layout of the gradients.

One function serves the three places that hold gradients differently:

- DDP: every rank holds the whole averaged gradient (the flat bucket buffers):
  `grad_norm(buffers)`, no communication;
- ZeRO-1: every rank holds its 1/dp shard of it: `grad_norm(shards, dp_group=group)`,
  squares summed over the data-parallel group;
- tensor parallelism: some gradients are slices of a matrix split over the tp group
  (`tp_sharded[k]` true), the others whole on every tp rank: their squares are summed over
  `tp_group`, the replicated ones counted once. Both at once for ZeRO-1 with tp.

No host sync: the norm stays a tensor. `clip_grad_norm_` scales the same tensors in place
by min(1, max_norm / (norm + 1e-6)), as torch.nn.utils.clip_grad_norm_.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def grad_norm(grads: list[torch.Tensor], dp_group=None, tp_group=None,
              tp_sharded: list[bool] | None = None, device: torch.device | None = None) -> torch.Tensor:
    """L2 norm of the whole model's gradient from this rank's tensors `grads`.

    dp_group: the tensors are this rank's shards of a gradient split over that group.
    tp_group, tp_sharded: the tensors flagged in tp_sharded are split over tp_group.
    device: where the norm lives when this rank holds no tensor (a rank's empty shard)."""
    if dp_group is None and tp_group is None:
        # everything local: the norm of per-tensor norms (one kernel per tensor)
        if not grads:
            return torch.zeros((), dtype=torch.float32, device=device)
        return torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g, dtype=torch.float32)
                                                     for g in grads]))
    sharded = tp_sharded if tp_group is not None and tp_sharded is not None else [False] * len(grads)
    device = grads[0].device if grads else device
    sq = torch.zeros(2, dtype=torch.float32, device=device)  # [tp-sharded, replicated] sums of squares
    for g, s in zip(grads, sharded):
        sq[0 if s else 1] += g.detach().float().square().sum()
    if dp_group is not None:
        dist.all_reduce(sq, group=dp_group)
    if tp_group is not None:
        tp_part = sq[:1].clone()
        dist.all_reduce(tp_part, group=tp_group)
        sq = torch.cat([tp_part, sq[1:]])
    return sq.sum().sqrt()


def clip_grad_norm_(grads: list[torch.Tensor], max_norm: float, dp_group=None, tp_group=None,
                    tp_sharded: list[bool] | None = None, device: torch.device | None = None) -> torch.Tensor:
    """Scale `grads` in place so that the global norm is at most max_norm; returns the norm
    before clipping."""
    total = grad_norm(grads, dp_group, tp_group, tp_sharded, device)
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for g in grads:
        g.mul_(coef.to(g.dtype))
    return total
