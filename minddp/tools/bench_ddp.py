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
3. Whole-model torch.compile (`--compile-backend`, aot_eager by default: inductor takes minutes
   to compile on a small CPU machine): minddp and torch DDP around `torch.compile(model)`, minddp
   around per-block compile and around one whole graph, interleaved the same way: step time
   against torch DDP compiled, and the exposed communication (backward minus the same backward
   under no_sync). `--compile only` runs this section alone, `--compile skip` leaves it out.
   `--link-gbps G` (0: off) sends every configuration's buckets over a modelled link of G Gbit/s
   and 50 us per bucket instead of gloo (minddp.perf.link: a comm hook through both engines'
   `register_comm_hook`, completed by a timer thread; wall time, no CPU; the gradients are
   divided by the world size, not averaged across ranks: a timing model). The compute stays
   real, so the exposed communication is what each engine's overlap leaves of the transfer
   (with overlap: about the last bucket's; without: all of it), which gloo's sums, competing
   with backward for the same core, hide here. Also reported: how long the link still
   transferred after the last bucket left (ms). `make bench-compile`: docs/bench_compile.md.
4. Per-bucket CPU cost, which noise cannot move: communication stubbed out (a comm hook
   that returns a finished future) at a cap of one parameter per bucket, backward time
   minus the same model's backward without any wrapper, divided by the number of buckets.
The measurements are minddp/perf/engine_bench.py and engine_cost.py; this is their report.
"""

from __future__ import annotations

import argparse
import statistics

import torch
import torch.distributed as dist

from ..model.gpt import GPT, num_params
from ..perf.engine_bench import cap_sweep, compile_section, exposed_gather, optimizer_section
from ..perf.engine_cost import per_bucket_cost
from . import render
from .arguments import float_list, nonnegative_float, positive_float, positive_int, tool_parser, writable_out
from .cli import ranks_phrase, start
from .workload import add_gpt_size, bench_gpt, lm_loss, parse_gpt_size


def main(argv=None) -> None:
    ap = tool_parser("bench-ddp", __doc__, argparse.RawTextHelpFormatter)
    ap.add_argument("--repeats", type=positive_int, default=3)
    ap.add_argument("--rounds", type=positive_int, default=6)
    ap.add_argument("--steps-per-round", type=positive_int, default=2)
    ap.add_argument("--caps", type=float_list(), default="1,5,25,100", help="bucket caps in MB")
    ap.add_argument("--batch", type=positive_int, default=4, help="sequences per rank")
    add_gpt_size(ap)
    ap.add_argument("--out", type=writable_out, default=None,
                    help="also write the report here: FILE.md and FILE.json")
    ap.add_argument("--backend", default="auto", choices=["auto", "gloo", "nccl"])
    ap.add_argument("--compile", default="with", choices=["with", "skip", "only"],
                    help="the whole-model torch.compile section: with the others, left out, or alone")
    ap.add_argument("--compile-backend", default="aot_eager", help="torch.compile's backend there")
    ap.add_argument("--compile-cap", type=positive_float, default=None,
                    help="bucket cap (MB) there; default torch's: 25 MB after a 1 MB first bucket")
    ap.add_argument("--link-gbps", type=nonnegative_float, default=0.0,
                    help="the compile section's buckets over a modelled link of this many Gbit/s (0: gloo)")
    args = parse_gpt_size(ap, argv)

    device = start(args.backend, pin=True).device
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    cfg = bench_gpt(args.n_layer, args.n_embd)
    base = GPT(cfg).to(device)
    caps = args.caps
    g = torch.Generator().manual_seed(rank)
    x = torch.randint(0, 256, (args.batch, cfg.block_size + 1), generator=g).to(device)
    compiled = [] if args.compile == "skip" else compile_section(
        base, x, args.compile_backend, args.compile_cap, args.repeats, args.rounds, args.steps_per_round,
        args.link_gbps)
    if args.compile == "only":
        if rank == 0:
            blocks = [*command_line(args), setup_line(args, base, cfg, world),
                      *compile_blocks(args, compiled)]
            print(render.markdown(blocks), flush=True)
            if args.out:
                render.write(args.out, blocks, {"compile": compiled})
        dist.destroy_process_group()
        return
    ratios, ours_ms, buckets = cap_sweep(base, x, caps, args.repeats, args.rounds, args.steps_per_round)
    optim = optimizer_section(base, x, args.repeats, args.rounds, args.steps_per_round)
    cost = per_bucket_cost(base, x, lm_loss)
    if rank == 0:
        blocks = report(args, base, cfg, world, caps, ratios, buckets, cost, optim, ours_ms, compiled)
        print(render.markdown(blocks), flush=True)
        if args.out:
            data = {"ratios": ratios, "minddp_ms": ours_ms, "optimizer": optim, "compile": compiled,
                    "per_bucket_cost_s": {k: v[0] for k, v in cost.items()},
                    "buckets": {f"{label} {cap:g}": n for (label, cap), n in buckets.items()}}
            render.write(args.out, blocks, data)
    dist.destroy_process_group()


def setup_line(args, base, cfg, world) -> str:
    return (f"GPT {render.count(num_params(base))} parameters in {len(list(base.parameters()))} tensors, "
            f"{ranks_phrase(world, next(base.parameters()).device)}, batch {args.batch}x{cfg.block_size} "
            f"per rank; {args.repeats} repeats of {args.rounds} rotated rounds x {args.steps_per_round} "
            "steps per configuration.")


def command_line(args) -> list[str]:
    """`make bench-compile`'s command, for its report alone."""
    if not args.link_gbps:
        return []
    return ["Command: `make bench-compile` (`torchrun --standalone --nproc_per_node=2 -m minddp bench-ddp "
            f"--compile only --link-gbps {args.link_gbps:g}`)"]


def report(args, base, cfg, world, caps, ratios, buckets, cost, optim, ours_ms, compiled) -> list:
    """The report's blocks (render.markdown)."""
    return [
        "Command: `make bench` (`torchrun --standalone --nproc_per_node=2 -m minddp bench-ddp`)",
        setup_line(args, base, cfg, world),
        render.table(["bucket cap (MB)", "buckets minddp / torch", "minddp / torch DDP step time: median",
                      "spread (min-max)", "minddp step (ms)"], cap_rows(caps, ratios, buckets, ours_ms)),
        *optimizer_blocks(args, optim),
        *compile_blocks(args, compiled),
        "Per-bucket CPU cost with communication stubbed out (one parameter per bucket; backward minus "
        "an unwrapped backward, per bucket):",
        render.table(["engine", "buckets", "cost per bucket (us)"],
                     [[name, n, per_bucket(seconds)] for name, (seconds, n) in cost.items()]),
    ]


def cap_rows(caps, ratios, buckets, ours_ms) -> list[list]:
    """Per cap: the bucket counts (torch logs none where it did not rebuild: one bucket), the step ratio."""
    return [[f"{cap:g}", f"{buckets[('minddp', cap)]} / {buckets[('torch DDP', cap)] or 'not logged'}",
             *render.median_spread(ratios[cap]), f"{statistics.median(ours_ms[cap]):.0f}"] for cap in caps]


def per_bucket(seconds: float) -> str:
    """A cost below zero is the timer's noise (a small model's backward), not a saving."""
    return f"{seconds * 1e6:.1f}" if seconds >= 0 else "under the timer's noise"


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
    exposed = [s * 1e3 for s in exposed_gather(rows)]
    if exposed:
        blocks.append(f"ZeRO-1's exposed all-gather per step (its forward minus minddp DDP's, per repeat): "
                      f"median {statistics.median(exposed):.1f} ms, spread {min(exposed):.1f} to "
                      f"{max(exposed):.1f} ms.")
    return blocks


def compile_blocks(args, rows: list[dict]) -> list:
    """Whole-model compile: step time against torch DDP compiled, step and exposed communication;
    over a modelled link, the link's own tail and the backward under no_sync too."""
    if not rows:
        return []

    def wait(r):  # minddp's own; torch DDP does not say
        return render.median_spread(r["wait_ms"], ".1f") if r["wait_ms"][0] == r["wait_ms"][0] else ["-", "-"]

    def linked(r):
        return [*render.median_spread(r["tail_ms"], ".1f"), *render.median_spread(r["local_ms"], ".0f")]

    table = [[r["label"], *render.median_spread(r["vs_torch"]), *render.median_spread(r["step_ms"], ".0f"),
              *render.median_spread(r["exposed_ms"], ".1f"), *wait(r), *(linked(r) if args.link_gbps else [])]
             for r in rows]
    header = ["configuration", "step vs torch DDP compiled: median", "spread", "step (ms)", "spread",
              "exposed communication (ms)", "spread", "end-of-backward wait (ms)", "spread"]
    if args.link_gbps:
        header += ["link busy after the last bucket (ms)", "spread", "backward under no_sync (ms)", "spread"]
    caps = "1 MB first bucket, then 25 MB" if args.compile_cap is None else f"cap {args.compile_cap:g} MB"
    return [f"Whole-model torch.compile (backend {args.compile_backend}, {caps}; per repeat the medians "
            "over its rounds; exposed communication: the synchronised backward minus the same backward "
            "under no_sync; end-of-backward wait: how long minddp's finalize blocked on buckets still "
            f"in flight){link_phrase(args, rows)}:", render.table(header, table)]


def link_phrase(args, rows: list[dict]) -> str:
    """The modelled link's parameters and its transfer of a whole step against the backward."""
    if not args.link_gbps:
        return ""
    transfer = statistics.median(t for r in rows for t in r["transfer_ms"])
    backward = statistics.median(t for r in rows for t in r["local_ms"])
    return (f"; communication over a modelled link, not gloo: {args.link_gbps:g} Gbit/s, 50 us per bucket, "
            f"every configuration's buckets through `register_comm_hook` (minddp.perf.link: a timer "
            f"completes each bucket's future; wall time, no CPU; gradients divided by the world size, not "
            f"averaged across ranks: a timing model). The transfer of all buckets of a step takes "
            f"{transfer:.0f} ms, {transfer / backward:.0%} of the backward under no_sync ({backward:.0f} ms, "
            "median over the configurations); link busy after the last bucket: the link's own exposed "
            "transfer, from the bucket launch times alone")


if __name__ == "__main__":
    main()
