"""Engine benchmark: minddp vs torch DDP, overlap vs no overlap, bucket caps.

    torchrun --standalone --nproc_per_node=2 -m minddp.bench_ddp [--steps 12] [--out docs/bench_ddp.md]

Every configuration wraps its own copy of the same GPT; steps are interleaved
round-robin (one step of each configuration per round, the order flipped every
round), so machine noise hits all of them alike. Reported: median step time,
its ratio to torch DDP with the same bucket cap, and for minddp the exposed-communication fraction (time the
end-of-backward wait blocked / step time) and the communication time.
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F

from .ddp import DistributedDataParallel
from .model import GPT, GPTConfig, num_params


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--steps", type=int, default=12, help="timed steps per configuration")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--caps", default="1,5,25,100", help="bucket caps in MB")
    ap.add_argument("--batch", type=int, default=4, help="sequences per rank")
    ap.add_argument("--n-layer", type=int, default=6)
    ap.add_argument("--n-embd", type=int, default=384)
    ap.add_argument("--out", default=None, help="also write the table (markdown) here")
    args = ap.parse_args()

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    cfg = GPTConfig(n_layer=args.n_layer, n_head=6, n_embd=args.n_embd, block_size=128)
    base = GPT(cfg)
    caps = [float(c) for c in args.caps.split(",")]

    configs = []  # (label, cap, model)
    for cap in caps:
        configs.append(("torch DDP", cap, nn.parallel.DistributedDataParallel(
            copy.deepcopy(base), bucket_cap_mb=cap)))
        configs.append(("minddp", cap, DistributedDataParallel(copy.deepcopy(base), bucket_cap_mb=cap)))
    configs.append(("minddp overlap=False", 25.0, DistributedDataParallel(
        copy.deepcopy(base), bucket_cap_mb=25.0, overlap=False)))
    opts = [torch.optim.SGD(m.parameters(), lr=1e-4) for _, _, m in configs]

    g = torch.Generator().manual_seed(rank)
    x = torch.randint(0, 256, (args.batch, cfg.block_size + 1), generator=g)
    times = [[] for _ in configs]
    exposed = [[] for _ in configs]
    comm = [[] for _ in configs]
    for step in range(args.warmup + args.steps):
        # alternate the order each round so no configuration always runs first
        order = range(len(configs)) if step % 2 == 0 else reversed(range(len(configs)))
        for k in order:
            model, opt = configs[k][2], opts[k]
            dist.barrier()
            t0 = time.perf_counter()
            opt.zero_grad()
            logits = model(x[:, :-1])
            F.cross_entropy(logits.flatten(0, 1), x[:, 1:].flatten()).backward()
            opt.step()
            dt = time.perf_counter() - t0
            if step >= args.warmup:
                times[k].append(dt)
                if isinstance(model, DistributedDataParallel):
                    exposed[k].append(model.comm_stats.exposed_wait_s)
                    comm[k].append(model.comm_stats.comm_time_s)

    # the slowest rank sets the pace: take each step's max over ranks
    t = torch.tensor(times, dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    if rank == 0:
        med = [statistics.median(row) for row in t.tolist()]
        torch_med = {cap: m for (label, cap, _), m in zip(configs, med) if label == "torch DDP"}
        lines = [
            f"GPT {num_params(base) / 1e6:.1f}M parameters in {len(list(base.parameters()))} "
            f"tensors, {world} gloo ranks x {torch.get_num_threads()} thread(s), batch "
            f"{args.batch}x{cfg.block_size} per rank, {args.steps} interleaved steps each",
            "",
            "| implementation | bucket cap (MB) | buckets | median step (ms) | ratio vs torch DDP "
            "| exposed comm / step | comm time (ms) |",
            "|---|---|---|---|---|---|---|",
        ]
        for k, (label, cap, model) in enumerate(configs):
            ours = isinstance(model, DistributedDataParallel)
            nb = len(model.bucket_assignment) if ours else _torch_buckets(model)
            frac = f"{statistics.median(exposed[k]) / med[k]:.1%}" if ours else "-"
            ctime = f"{statistics.median(comm[k]) * 1e3:.1f}" if ours else "-"
            lines.append(f"| {label} | {cap:g} | {nb} | {med[k] * 1e3:.1f} | "
                         f"{med[k] / torch_med[cap]:.3f} | {frac} | {ctime} |")
        table = "\n".join(lines)
        print(table, flush=True)
        if args.out:
            with open(args.out, "w") as f:
                f.write("Command: `make bench` (`torchrun --standalone --nproc_per_node=2 "
                        "-m minddp.bench_ddp`)\n\n" + table + "\n")
    dist.destroy_process_group()


def _torch_buckets(model) -> str:
    """torch DDP's bucket count after its rebuild (from its logging data)."""
    sizes = model._get_ddp_logging_data().get("rebuilt_bucket_sizes", "")
    return str(len(sizes.split(","))) if sizes else "?"


if __name__ == "__main__":
    main()
