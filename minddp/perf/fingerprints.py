"""What the never-hang machinery costs per collective: 1 KB all-reduces on a plain group against
a group created under TORCH_DISTRIBUTED_DEBUG=DETAIL (torch's collective fingerprints, checked
before each collective), on the device's clock (on nccl the host clock would time the enqueue)."""

from __future__ import annotations

import statistics

import torch
import torch.distributed as dist

from .clock import timed


def per_collective_us(group, t: torch.Tensor, n: int) -> float:
    """Microseconds per all-reduce over `n` back to back."""
    dist.barrier()
    return timed(lambda: [dist.all_reduce(t, group=group) for _ in range(n)], t.device) / n * 1e6


def fingerprint_cost(device: torch.device, iters: int, block: int) -> dict[str, float]:
    """{"plain_us", "detail_us"}: median microseconds per collective, the two groups interleaved
    in blocks of `block` (alternating which goes first), `iters` collectives in all."""
    plain = dist.new_group()
    level = dist.get_debug_level()
    dist.set_debug_level(dist.DebugLevel.DETAIL)
    detail = dist.new_group()  # wrapped: fingerprints checked before each collective
    dist.set_debug_level(level)
    t = torch.ones(256, device=device)  # 1 KB
    times = {"plain": [], "detail": []}
    for k in range(iters // block):
        for name in (("plain", "detail") if k % 2 == 0 else ("detail", "plain")):
            times[name].append(per_collective_us(plain if name == "plain" else detail, t, block))
    return {f"{k}_us": round(statistics.median(v), 1) for k, v in times.items()}
