"""Engine benchmark: minddp vs torch DDP at the same bucket caps, and the per-bucket cost.

    torchrun --standalone --nproc_per_node=2 -m minddp bench-ddp [--repeats 3] [--out docs/bench_ddp.md]

1. Step time. Every configuration wraps its own copy of the same GPT. Each rank is pinned to
   its own core. A repeat runs `--rounds` rounds; a round runs `--steps-per-round` steps of
   every configuration, in an order rotated every round, so machine drift hits all alike.
   Per repeat: the ratio of medians minddp / torch DDP at each cap; reported: the median
   ratio over repeats and its spread (min-max), with both engines' bucket counts.
2. Optimizer setups: minddp DDP + AdamW, torch DDP + AdamW, minddp `shard_optimizer` +
   `ShardedOptimizer(AdamW)`, torch DDP + `ZeroRedundancyOptimizer(AdamW)` (and minddp's
   optimizer overlap, where the engine has it), interleaved the same way, `--repeats` times:
   step time against minddp DDP and torch DDP (median and spread of the per-repeat ratios),
   forward / backward / optimizer-step times, optimizer-state bytes per rank, and ZeRO-1's
   exposed all-gather (its forward minus DDP's: the forward waits for the gathers).
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

from ..ddp import DistributedDataParallel
from ..overlap import OverlappedOptimizer
from ..perf.clock import PhaseClock, interleaved, sync, timed
from ..perf.engine_cost import per_bucket_cost, torch_buckets
from ..perf.memory import state_bytes
from ..train.model import GPT, num_params
from ..zero import ShardedOptimizer
from . import render
from .cli import ranks_phrase, start
from .workload import bench_gpt, lm_loss


def step(model, opt, x) -> float:
    def work():
        opt.zero_grad()
        lm_loss(model, x).backward()
        opt.step()

    return timed(work, x.device)


def interleaved_steps(configs, x, rounds: int, per_round: int) -> list[float]:
    """Median step time (SGD) of each (label, cap, model), in rotated rounds (cli.interleaved)."""
    opts = [torch.optim.SGD(m.parameters(), lr=1e-4) for _, _, m in configs]
    steps = [lambda m=m, o=o: step(m, o, x) for (_, _, m), o in zip(configs, opts)]
    return [m[0] for m in interleaved(steps, rounds, per_round, x.device)]


def optimizer_configs(base, cap):
    """(label, model, optimizer) for the ways to run AdamW data-parallel, minddp DDP first."""
    from torch.distributed.optim import ZeroRedundancyOptimizer

    adamw = {"lr": 1e-4, "fused": True}
    plain = DistributedDataParallel(copy.deepcopy(base), bucket_cap_mb=cap)
    sharded = DistributedDataParallel(copy.deepcopy(base), bucket_cap_mb=cap, shard_optimizer=True)
    theirs = nn.parallel.DistributedDataParallel(copy.deepcopy(base), bucket_cap_mb=cap)
    theirs_zero = nn.parallel.DistributedDataParallel(copy.deepcopy(base), bucket_cap_mb=cap)
    AdamW = torch.optim.AdamW
    configs = [("minddp DDP + AdamW", plain, AdamW(plain.parameters(), **adamw)),
               ("torch DDP + AdamW", theirs, AdamW(theirs.parameters(), **adamw)),
               ("minddp shard_optimizer (ZeRO-1)", sharded, ShardedOptimizer(sharded, AdamW, **adamw)),
               ("torch DDP + ZeroRedundancyOptimizer", theirs_zero,
                ZeroRedundancyOptimizer(theirs_zero.parameters(), optimizer_class=AdamW, **adamw))]
    overlap = overlap_config(base, cap, adamw)
    return configs + [overlap]


def overlap_config(base, cap, adamw):
    """minddp with the optimizer stepped per bucket as its reduction completes (`optimizer_overlap`)."""
    model = DistributedDataParallel(copy.deepcopy(base), bucket_cap_mb=cap, optimizer_overlap=True)
    return ("minddp optimizer_overlap", model, OverlappedOptimizer(model, torch.optim.AdamW, **adamw))


def phased_step(model, opt, x) -> tuple[float, float, float]:
    """Seconds of forward, backward and optimizer step, on the device's clock (CUDA events: a
    sync after the step would move ZeRO-1's all-gathers, which the forward waits for, into it)."""
    opt.zero_grad()
    sync(x.device)
    clock = PhaseClock(x.device)
    loss = lm_loss(model, x)
    clock.mark("forward")
    loss.backward()
    clock.mark("backward")
    opt.step()
    clock.mark("step")
    forward, backward, step = (z - a for _, a, z in clock.spans())
    return forward, backward, step


def interleaved_phases(configs, x, rounds: int, per_round: int) -> list[list[float]]:
    """Per (label, model, optimizer), the medians of [step, forward, backward, optimizer step]."""
    def phases(model, opt):
        p = phased_step(model, opt, x)
        return [sum(p), *p]

    steps = [lambda m=m, o=o: phases(m, o) for _, m, o in configs]
    return interleaved(steps, rounds, per_round, x.device)


def optimizer_section(base, x, args) -> list[dict]:
    """Per AdamW setup: step time against minddp DDP and torch DDP (ratios of medians, one per
    repeat), forward / backward / optimizer-step medians, optimizer-state bytes on this rank."""
    configs = optimizer_configs(base, 25.0)
    rows = [{"label": label, "vs_minddp": [], "vs_torch": [], "phases": [], "state": state_bytes(opt)}
            for label, _, opt in configs]
    for _ in range(args.repeats):
        med = interleaved_phases(configs, x, args.rounds, args.steps_per_round)
        for row, m in zip(rows, med):
            row["vs_minddp"].append(m[0] / med[0][0])
            row["vs_torch"].append(m[0] / med[1][0])
            row["phases"].append(m)
    for row, (_, _, opt) in zip(rows, configs):
        row["state"] = state_bytes(opt)  # after the steps: AdamW's states exist from the first
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--steps-per-round", type=int, default=2)
    ap.add_argument("--caps", default="1,5,25,100", help="bucket caps in MB")
    ap.add_argument("--batch", type=int, default=4, help="sequences per rank")
    ap.add_argument("--n-layer", type=int, default=6)
    ap.add_argument("--n-embd", type=int, default=384)
    ap.add_argument("--out", default=None, help="also write the report here: FILE.md and FILE.json")
    ap.add_argument("--backend", default="auto", choices=["auto", "gloo", "nccl"])
    args = ap.parse_args()

    device = start(args.backend, pin=True).device
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    cfg = bench_gpt(args.n_layer, args.n_embd)
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
        med = interleaved_steps(configs, x, args.rounds, args.steps_per_round)
        by = {(label, cap): m for (label, cap, _), m in zip(configs, med)}
        for cap in caps:
            ratios[cap].append(by[("minddp", cap)] / by[("torch DDP", cap)])
            ours_ms[cap].append(by[("minddp", cap)] * 1e3)
    buckets = {(label, cap): (len(m.bucket_assignment) if label == "minddp" else torch_buckets(m))
               for label, cap, m in configs}
    optim = optimizer_section(base, x, args)
    everyone = [None] * world
    dist.all_gather_object(everyone, [r["state"] for r in optim])  # optimizer-state bytes, per rank
    cost = per_bucket_cost(base, x, lm_loss)
    if rank == 0:
        for k, row in enumerate(optim):
            row["state"] = [e[k] for e in everyone]
        blocks = report(args, base, cfg, world, caps, ratios, buckets, cost, optim, ours_ms)
        print(render.markdown(blocks), flush=True)
        if args.out:
            data = {"ratios": ratios, "minddp_ms": ours_ms, "optimizer": optim,
                    "per_bucket_cost_s": {k: v[0] for k, v in cost.items()},
                    "buckets": {f"{label} {cap:g}": n for (label, cap), n in buckets.items()}}
            render.write(args.out, blocks, data)
    dist.destroy_process_group()


def report(args, base, cfg, world, caps, ratios, buckets, cost, optim, ours_ms) -> list:
    """The report's blocks (render.markdown)."""
    rows = [[f"{cap:g}", f"{buckets[('minddp', cap)]} / {buckets[('torch DDP', cap)]}",
             *render.median_spread(ratios[cap]), f"{statistics.median(ours_ms[cap]):.0f}"] for cap in caps]
    return [
        "Command: `make bench` (`torchrun --standalone --nproc_per_node=2 -m minddp bench-ddp`)",
        f"GPT {num_params(base) / 1e6:.1f}M parameters in {len(list(base.parameters()))} tensors, "
        f"{ranks_phrase(world, next(base.parameters()).device)}, batch {args.batch}x{cfg.block_size} "
        f"per rank; {args.repeats} repeats of {args.rounds} rotated rounds x {args.steps_per_round} "
        "steps per configuration.",
        render.table(["bucket cap (MB)", "buckets minddp / torch", "minddp / torch DDP step time: median",
                      "spread (min-max)", "minddp step (ms)"], rows),
        *optimizer_blocks(args, optim),
        "Per-bucket CPU cost with communication stubbed out (one parameter per bucket; backward minus "
        "an unwrapped backward, per bucket):",
        render.table(["engine", "buckets", "cost per bucket (us)"],
                     [[name, n, f"{seconds * 1e6:.1f}"] for name, (seconds, n) in cost.items()]),
    ]


def optimizer_blocks(args, rows: list[dict]) -> list:
    """Step-time ratios (median and spread over repeats), phases, states; ZeRO-1's exposed all-gather."""
    def row(r):
        med = [statistics.median(col) * 1e3 for col in zip(*r["phases"])]
        return [r["label"], *render.median_spread(r["vs_minddp"]), *render.median_spread(r["vs_torch"]),
                f"{med[0]:.0f}", f"{med[1]:.0f} / {med[2]:.0f} / {med[3]:.0f}",
                " / ".join(f"{b / 2**20:.1f}" for b in r["state"])]

    blocks = [f"Optimizer setups (fused AdamW, cap 25 MB; {args.repeats} repeats of {args.rounds} rotated "
              "rounds; per repeat the ratio of median step times, all setups in the same rounds; phases: "
              "medians over the repeats of the slowest rank's; peak memory per rank: docs/bench_memory.md):",
              render.table(["configuration", "step vs minddp DDP: median", "spread",
                            "step vs torch DDP: median", "spread", "step (ms)",
                            "forward / backward / optimizer step (ms)", "optimizer state per rank (MB)"],
                           [row(r) for r in rows])]
    by = {r["label"]: r for r in rows}
    zero, plain = by.get("minddp shard_optimizer (ZeRO-1)"), by["minddp DDP + AdamW"]
    if zero:  # ZeRO-1's forward waits for the all-gathers its step launched; DDP's waits for nothing
        exposed = [(z[1] - p[1]) * 1e3 for z, p in zip(zero["phases"], plain["phases"])]
        blocks.append(f"ZeRO-1's exposed all-gather per step (its forward minus minddp DDP's, per repeat): "
                      f"median {statistics.median(exposed):.1f} ms, spread {min(exposed):.1f} to "
                      f"{max(exposed):.1f} ms.")
    return blocks


if __name__ == "__main__":
    main()
