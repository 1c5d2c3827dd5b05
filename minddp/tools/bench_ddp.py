"""Engine benchmark: minddp vs torch DDP at the same bucket caps, and the per-bucket cost.

    torchrun --standalone --nproc_per_node=2 -m minddp bench-ddp [--repeats 3] [--out docs/bench_ddp.md]

1. Step time. Every configuration wraps its own copy of the same GPT. Each rank is pinned to
   its own core. A repeat runs `--rounds` rounds; a round runs `--steps-per-round` steps of
   every configuration, in an order rotated every round, so machine drift hits all alike.
   Per repeat: the ratio of medians minddp / torch DDP at each cap; reported: the median
   ratio over repeats and its spread (min-max), with both engines' bucket counts.
2. ZeRO-1: minddp DDP + AdamW, minddp `shard_optimizer` + `ShardedOptimizer(AdamW)` and torch
   DDP + `ZeroRedundancyOptimizer(AdamW)`, interleaved the same way: step time against
   minddp DDP, optimizer-state bytes per rank, and resident memory added by the first step.
3. Per-bucket CPU cost, which noise cannot move: communication stubbed out (a comm hook
   that returns a finished future) at a cap of one parameter per bucket, backward time
   minus the same model's backward without any wrapper, divided by the number of buckets.
"""

from __future__ import annotations

import argparse
import copy
import statistics

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks.debugging_hooks import noop_hook
from torch.nn import functional as F

from .. import _compat
from ..ddp import DistributedDataParallel
from ..train.model import GPT, GPTConfig, num_params
from ..zero import ShardedOptimizer
from .cli import start, timed


def step(model, opt, x) -> float:
    def work():
        opt.zero_grad()
        F.cross_entropy(model(x[:, :-1]).flatten(0, 1), x[:, 1:].flatten()).backward()
        opt.step()

    return timed(work, x.device)


def torch_buckets(model) -> int:
    """torch DDP's bucket count after its rebuild (from its logging data)."""
    sizes = _compat.ddp_rebuilt_bucket_sizes(model)
    return len(sizes.split(",")) if sizes else -1


def interleaved(configs, x, rounds: int, per_round: int, opts=None) -> list[float]:
    """Median step time of each configuration; each step's time is the max over ranks."""
    opts = opts or [torch.optim.SGD(m.parameters(), lr=1e-4) for _, _, m in configs]
    times = [[] for _ in configs]
    for r in range(rounds + 1):  # round 0 warms up (and rebuilds every engine's buckets)
        shift = r % len(configs)
        for k in [(i + shift) % len(configs) for i in range(len(configs))]:
            for _ in range(per_round):
                dist.barrier()
                dt = step(configs[k][2], opts[k], x)
                if r:
                    times[k].append(dt)
    t = torch.tensor(times, dtype=torch.float64, device=x.device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return [statistics.median(row) for row in t.tolist()]


def zero_configs(base, cap):
    """(label, model, optimizer) for the three ways to run AdamW data-parallel."""
    from torch.distributed.optim import ZeroRedundancyOptimizer

    plain = DistributedDataParallel(copy.deepcopy(base), bucket_cap_mb=cap)
    sharded = DistributedDataParallel(copy.deepcopy(base), bucket_cap_mb=cap, shard_optimizer=True)
    theirs = nn.parallel.DistributedDataParallel(copy.deepcopy(base), bucket_cap_mb=cap)
    return [("minddp DDP + AdamW", plain, torch.optim.AdamW(plain.parameters(), lr=1e-4, fused=True)),
            ("minddp shard_optimizer (ZeRO-1)", sharded,
             ShardedOptimizer(sharded, torch.optim.AdamW, lr=1e-4, fused=True)),
            ("torch DDP + ZeroRedundancyOptimizer", theirs,
             ZeroRedundancyOptimizer(theirs.parameters(), optimizer_class=torch.optim.AdamW, lr=1e-4,
                                     fused=True))]


def state_bytes(opt) -> int:
    if isinstance(opt, ShardedOptimizer):
        return opt.state_bytes()
    inner = getattr(opt, "optim", opt)  # ZeroRedundancyOptimizer keeps its shard's optimizer there
    return sum(v.numel() * v.element_size() for st in inner.state.values() for v in st.values()
               if isinstance(v, torch.Tensor))


def zero_section(base, x, args) -> list:
    """[(label, step time vs minddp DDP, optimizer-state bytes)] for the three AdamW setups."""
    configs = zero_configs(base, 25.0)
    med = interleaved([(label, 25.0, m) for label, m, _ in configs], x, args.rounds, args.steps_per_round,
                      [o for _, _, o in configs])
    return [(label, m / med[0], state_bytes(opt)) for (label, _, opt), m in zip(configs, med)]


def per_bucket_cost(base, x, reps: int = 20) -> dict[str, tuple[float, int]]:
    """{engine: (seconds of engine CPU work per bucket, buckets)} with communication stubbed out."""
    plain = copy.deepcopy(base)
    ours = DistributedDataParallel(copy.deepcopy(base), bucket_cap_mb=1e-6)
    ours.register_comm_hook(None, lambda state, b: _done(b.buffer()))
    theirs = nn.parallel.DistributedDataParallel(copy.deepcopy(base), bucket_cap_mb=1e-6)
    theirs.register_comm_hook(None, noop_hook)
    models = {"plain": plain, "minddp": ours, "torch DDP": theirs}
    times = {k: [] for k in models}
    for r in range(reps + 2):
        for name, m in models.items():
            loss = F.cross_entropy(m(x[:, :-1]).flatten(0, 1), x[:, 1:].flatten())
            seconds = timed(loss.backward, x.device)
            if r >= 2:
                times[name].append(seconds)
            m.zero_grad()
    med = {k: statistics.median(v) for k, v in times.items()}
    n = {"minddp": len(ours.bucket_assignment), "torch DDP": torch_buckets(theirs)}
    return {k: ((med[k] - med["plain"]) / n[k], n[k]) for k in n}


def _done(t):
    f = torch.futures.Future()
    f.set_result(t)
    return f


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--steps-per-round", type=int, default=2)
    ap.add_argument("--caps", default="1,5,25,100", help="bucket caps in MB")
    ap.add_argument("--batch", type=int, default=4, help="sequences per rank")
    ap.add_argument("--n-layer", type=int, default=6)
    ap.add_argument("--n-embd", type=int, default=384)
    ap.add_argument("--out", default=None, help="also write the table (markdown) here")
    ap.add_argument("--backend", default="auto", choices=["auto", "gloo", "nccl"])
    args = ap.parse_args()

    device = start(args.backend, pin=True).device
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    cfg = GPTConfig(n_layer=args.n_layer, n_head=6, n_embd=args.n_embd, block_size=128)
    base = GPT(cfg).to(device)
    caps = [float(c) for c in args.caps.split(",")]
    configs = []  # (label, cap, model)
    for cap in caps:
        theirs = nn.parallel.DistributedDataParallel(copy.deepcopy(base), bucket_cap_mb=cap)
        configs.append(("torch DDP", cap, theirs))
        configs.append(("minddp", cap, DistributedDataParallel(copy.deepcopy(base), bucket_cap_mb=cap)))
    g = torch.Generator().manual_seed(rank)
    x = torch.randint(0, 256, (args.batch, cfg.block_size + 1), generator=g).to(device)

    ratios, ours_ms = {cap: [] for cap in caps}, {cap: [] for cap in caps}
    for _ in range(args.repeats):
        med = interleaved(configs, x, args.rounds, args.steps_per_round)
        by = {(label, cap): m for (label, cap, _), m in zip(configs, med)}
        for cap in caps:
            ratios[cap].append(by[("minddp", cap)] / by[("torch DDP", cap)])
            ours_ms[cap].append(by[("minddp", cap)] * 1e3)
    buckets = {(label, cap): (len(m.bucket_assignment) if label == "minddp" else torch_buckets(m))
               for label, cap, m in configs}
    zero = zero_section(base, x, args)
    everyone = [None] * world
    dist.all_gather_object(everyone, [z[2] for z in zero])  # optimizer-state bytes, per rank
    cost = per_bucket_cost(base, x)
    if rank == 0:
        zero = [(label, ratio, [e[k] for e in everyone]) for k, (label, ratio, _) in enumerate(zero)]
        table = report(args, base, cfg, world, caps, ratios, buckets, cost, zero, ours_ms)
        print(table, flush=True)
        if args.out:
            with open(args.out, "w") as f:
                f.write("Command: `make bench` (`torchrun --standalone --nproc_per_node=2 "
                        "-m minddp bench-ddp`)\n\n" + table + "\n")
    dist.destroy_process_group()


def report(args, base, cfg, world, caps, ratios, buckets, cost, zero, ours_ms) -> str:
    lines = [
        f"GPT {num_params(base) / 1e6:.1f}M parameters in {len(list(base.parameters()))} tensors, "
        f"{world} gloo ranks pinned to one core each, 1 thread, batch {args.batch}x{cfg.block_size} "
        f"per rank; {args.repeats} repeats of {args.rounds} rotated rounds x {args.steps_per_round} "
        "steps per configuration.",
        "",
        "| bucket cap (MB) | buckets minddp / torch | minddp / torch DDP step time: median "
        "| spread (min-max) | minddp step (ms) |",
        "|---|---|---|---|---|",
    ]
    for cap in caps:
        r = ratios[cap]
        lines.append(f"| {cap:g} | {buckets[('minddp', cap)]} / {buckets[('torch DDP', cap)]} | "
                     f"{statistics.median(r):.3f} | {min(r):.3f}-{max(r):.3f} | "
                     f"{statistics.median(ours_ms[cap]):.0f} |")
    lines += ["", "ZeRO-1 (AdamW, cap 25 MB; ratio of median step times against minddp DDP, same rounds; "
              "optimizer state per rank; peak memory per rank: the table at the end):", "",
              "| configuration | step time vs minddp DDP | optimizer state per rank (MB) |", "|---|---|---|"]
    for label, ratio, state in zero:
        lines.append(f"| {label} | {ratio:.3f} | {' / '.join(f'{b / 2**20:.1f}' for b in state)} |")
    lines += ["", "Per-bucket CPU cost with communication stubbed out (one parameter per bucket; "
              "backward minus an unwrapped backward, per bucket):", "",
              "| engine | buckets | cost per bucket (us) |", "|---|---|---|"]
    for name, (seconds, n) in cost.items():
        lines.append(f"| {name} | {n} | {seconds * 1e6:.1f} |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
