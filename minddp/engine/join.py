"""Uneven inputs: `with ddp.join(): ...` (torch's `Join` for one DDP model).

A rank that runs out of data leaves the loop and keeps shadowing the others' collectives
until every rank is done: at each of their forwards one small all-gather tells every rank
who still trains, whether this iteration reduces gradients and broadcasts buffers (and
from whom: the highest rank still training, since the first may have run out). When they
reduce, the joined rank takes part with zeros for its gradients, bucket by bucket in the
same order, through the engine's own reduction. At the end every rank takes the model of
the rank that trained longest (ties: the highest rank), as torch's Join does.

Gradients are averaged over the initial world size (torch's default) or, with
divide_by_initial_world_size=False, over the ranks still training (`grad_scale`).

torch's other two arguments: `enable=False` makes the context a no-op (the inputs are known
to be even: no all-gather per forward); `throw_on_early_termination=True` makes every rank
raise torch's RuntimeError once one rank runs out of inputs (the rank that ran out:
"Rank r exhausted all inputs."; the others at their next forward: "Detected at least one
rank that exhausted inputs. Throwing across all ranks."), for models with collectives of
their own (SyncBatchNorm) that a joined rank cannot shadow. It costs the same one
all-gather per forward; nothing is shadowed and no final model is broadcast unless every
rank ran out at once (then the model sync below runs, as torch's post-hook does).

The wrapper's `join()` holds a `Join` while the loop runs and calls it at one point only, its
forward: `on_forward` (the all-gather) and `grad_scale`, which it hands to the iteration the
forward starts (`reducer.prepare_for_backward(grad_scale)`); nothing is written into the reducer.
A rank out of data drives the engine through the reducer's public `shadow_iteration()` (zeros in
every bucket, in order, and the one rebuild).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .. import _compat
from ..comm.collectives import broadcast_coalesced
from .replicas import broadcast_buffers


class Join:
    """One `join()`: who still trains (`active`), how many iterations this rank trained."""

    def __init__(self, ddp, divide: bool, throw: bool = False):
        self.ddp, self.divide, self.throw = ddp, divide, throw
        self.iters, self.active = 0, ddp.world_size
        self.ranks = dist.get_process_group_ranks(ddp.process_group)

    def exchange(self, active: int, sync: bool, bcast: bool) -> tuple[int, bool, bool, int]:
        """One all-gather: (ranks still training, reduce?, broadcast buffers?, from whom)."""
        n = self.ddp.world_size
        mine = torch.tensor([active, int(sync), int(bcast)], dtype=torch.int64, device=self.ddp.device)
        every = torch.empty(n * 3, dtype=torch.int64, device=self.ddp.device)
        _compat.all_gather_single(every, mine, group=self.ddp.process_group)
        every = every.view(n, 3)
        alive = [self.ranks[i] for i, a in enumerate(every[:, 0].tolist()) if a]
        self.active = len(alive)
        if active:
            self.iters += 1
        return len(alive), bool(every[:, 1].any()), bool(every[:, 2].any()), max(alive, default=-1)

    def on_forward(self, sync: bool, bcast: bool) -> int:
        """A training rank's forward: returns the rank to broadcast buffers from."""
        active, _, _, src = self.exchange(1, sync, bcast)
        if self.throw and active < self.ddp.world_size:  # torch's text (Join.notify_join_context)
            raise RuntimeError("Detected at least one rank that exhausted inputs. Throwing across all ranks.")
        return src

    def grad_scale(self) -> float | None:
        """Factor for the reduced gradients: average over the ranks still training."""
        if self.divide or self.ddp.reduce_op != "avg" or self.active == self.ddp.world_size:
            return None
        return self.ddp.world_size / self.active

    def shadow_until_all_joined(self) -> None:
        ddp = self.ddp
        while True:
            active, sync, bcast, src = self.exchange(0, False, False)
            if active == 0:
                break
            if self.throw:  # the others raise at this forward's exchange (on_forward)
                raise RuntimeError(f"Rank {dist.get_rank(ddp.process_group)} exhausted all inputs.")
            if bcast:
                broadcast_buffers(ddp.module_buffers, ddp.process_group, src)
            if sync:  # the others reduce their gradients now: take part with zeros, in order
                ddp.reducer.shadow_iteration()
        self.sync_final_model()

    def sync_final_model(self) -> None:
        """Everyone is done: the rank that trained longest has the model the others take."""
        ddp = self.ddp
        me = self.ranks.index(dist.get_rank())
        key = torch.tensor([self.iters * ddp.world_size + me], device=ddp.device)
        dist.all_reduce(key, op=dist.ReduceOp.MAX, group=ddp.process_group)
        last = self.ranks[int(key.item()) % ddp.world_size]
        broadcast_coalesced([p.detach() for p in ddp.module.parameters()], ddp.process_group, last)
        broadcast_coalesced(ddp.module_buffers, ddp.process_group, last)


def check_joinable(reduction) -> None:
    if not reduction.joinable:
        raise RuntimeError(
            f"minddp: join() does not combine with shard_optimizer=True ({type(reduction).__name__}, "
            "ZeRO-1): a rank that ran out of data would also have to take part in ShardedOptimizer's "
            "step (its all-gather) and gradient-norm all-reduce. Give every rank the same number of "
            "batches (drop_last=True / DistributedSampler), or use shard_optimizer=False with join().")
