"""What the never-hang machinery costs per collective: `make bench-debug`.

    TORCH_FR_BUFFER_SIZE=2000 torchrun --standalone --nproc_per_node=2 -m minddp bench-debug

Times `--iters` 1 KB all-reduces on a plain group and on a group created under
TORCH_DISTRIBUTED_DEBUG=DETAIL (torch's collective fingerprints), interleaved in blocks of
`--block`; prints one JSON line: median microseconds per collective for each, and whether
torch's flight recorder was recording (TORCH_FR_BUFFER_SIZE, process-wide, so `make
bench-debug` runs this with it off and on, alternately).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics

import torch
import torch.distributed as dist

from ..perf.clock import timed
from .cli import start


def per_collective_us(group, t: torch.Tensor, n: int) -> float:
    """Microseconds per all-reduce over `n` back to back, on the device's clock (on nccl the
    host clock would time the enqueue)."""
    dist.barrier()
    return timed(lambda: [dist.all_reduce(t, group=group) for _ in range(n)], t.device) / n * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--iters", type=int, default=2000)
    ap.add_argument("--block", type=int, default=100)
    args = ap.parse_args()
    device = start(pin=True).device
    plain = dist.new_group()
    level = dist.get_debug_level()
    dist.set_debug_level(dist.DebugLevel.DETAIL)
    detail = dist.new_group()  # wrapped: fingerprints checked before each collective
    dist.set_debug_level(level)
    t = torch.ones(256, device=device)  # 1 KB
    times = {"plain": [], "detail": []}
    for k in range(args.iters // args.block):
        for name in (("plain", "detail") if k % 2 == 0 else ("detail", "plain")):
            times[name].append(per_collective_us(plain if name == "plain" else detail, t, args.block))
    if dist.get_rank() == 0:
        fr = int(os.environ.get("TORCH_FR_BUFFER_SIZE", "0") or 0)
        medians = {f"{k}_us": round(statistics.median(v), 1) for k, v in times.items()}
        print(json.dumps({"flight_recorder": fr, **medians}))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
