"""Replica consistency: data-parallel ranks must hold identical parameters.

A cheap fingerprint per parameter (sum and sum of squares in float64) is gathered over
the data-parallel group; any difference raises on every rank, naming the first differing
parameter and the ranks. Silent divergence (a rank that skipped a step, a non-deterministic
kernel, a bad broadcast) becomes an error at the next check instead of a wrong result.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


class ReplicaDivergenceError(RuntimeError):
    pass


def fingerprint(model) -> torch.Tensor:
    rows = [torch.stack([p.detach().double().sum(), p.detach().double().square().sum()])
            for p in model.parameters()]
    return torch.stack(rows) if rows else torch.zeros(0, 2, dtype=torch.float64)


def check_replicas(model, group=None, extra: float | None = None) -> dict[int, float] | None:
    """Raises on divergence. `extra` (a number of this rank's: its step time) rides along as
    one more row of the same all-gather; returned as {global rank: extra}."""
    group = group or dist.group.WORLD
    mine = fingerprint(model)
    if extra is not None:
        mine = torch.cat([mine, torch.tensor([[extra, 0.0]], dtype=mine.dtype, device=mine.device)])
    everyone = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(everyone, mine, group=group)
    ranks = dist.get_process_group_ranks(group)
    names = [n for n, _ in model.named_parameters()]
    for k, name in enumerate(names):
        differ = [ranks[i] for i, fp in enumerate(everyone) if not torch.equal(fp[k], everyone[0][k])]
        if differ:
            raise ReplicaDivergenceError(
                f"data-parallel replicas diverged: parameter {name!r} differs between rank {ranks[0]} "
                f"and rank(s) {differ} (sum {everyone[0][k, 0].item():.9g} vs "
                f"{everyone[ranks.index(differ[0])][k, 0].item():.9g}). Every rank must apply the same "
                "update: check for rank-dependent code paths or a skipped optimizer step.")
    return None if extra is None else {r: fp[-1, 0].item() for r, fp in zip(ranks, everyone)}
