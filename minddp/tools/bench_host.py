"""Host cost where the host paces the step: minddp vs torch DDP on many small tensors.

    torchrun --standalone --nproc_per_node=2 -m minddp bench-host [--repeats 9] [--out docs/bench_host.md]

A GPT of tiny layers (32 wide, 1 head, a vocabulary of 64, one sequence of 8 tokens; 12, 48 and
96 layers: 149, 581 and 1157 parameter tensors), SGD, one bucket (cap 25 MB), gloo ranks pinned
to a core each. Each step is `zero_grad(set_to_none=...)` -> forward -> backward -> `step()`.

1. Step: `none` (no wrapper, no communication), torch DDP and minddp interleaved in an order
   rotated every round; per repeat, what minddp adds to the step over what torch DDP adds (wall
   time, and the process's own CPU time, which other processes do not move), with `.grad` set to
   None each step (the default of `zero_grad()` and of every loop we know) and kept (zeroed in
   place). Reported: the median over repeats and its spread (min-max).
2. The gradient path alone, communication stubbed (a comm hook that returns a finished future, on
   both engines): CPU µs per ready gradient, one forward and backward less the plain model's.
The measurements are minddp/perf/host_bench.py; this is their report.
"""

from __future__ import annotations

import argparse
import statistics

import torch
import torch.distributed as dist

from ..perf import host_bench
from ..model.gpt import GPT, GPTConfig
from . import render
from .arguments import int_list, positive_int, tool_parser, writable_out
from .cli import ranks_phrase, start

MODES = (("None (set_to_none=True)", True), ("kept (set_to_none=False)", False))


def host_model(layers: int) -> GPT:
    """The host-bound GPT: 12 layers have 149 parameter tensors, 48 have 581, 96 have 1157."""
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=host_bench.VOCAB, block_size=host_bench.TOKENS, n_layer=layers,
                         n_head=1, n_embd=32))


def main(argv=None) -> None:
    ap = tool_parser("bench-host", __doc__, argparse.RawTextHelpFormatter)
    ap.add_argument("--repeats", type=positive_int, default=9)
    ap.add_argument("--rounds", type=positive_int, default=8)
    ap.add_argument("--steps-per-round", type=positive_int, default=4)
    ap.add_argument("--layers", type=int_list(), default="12,48,96",
                    help="GPT depths (tensors: 12 per layer + 5)")
    ap.add_argument("--hook-reps", type=positive_int, default=100)
    ap.add_argument("--out", type=writable_out, default=None,
                    help="also write the report here: FILE.md and FILE.json")
    args = ap.parse_args(argv)
    device = start("gloo", pin=True).device
    models = {layers: host_model(layers) for layers in args.layers}
    steps = {(layers, label): [host_bench.step_costs(models[layers], args.rounds, args.steps_per_round, none)
                               for _ in range(args.repeats)]
             for layers in args.layers for label, none in MODES}
    hooks = {(layers, label): host_bench.hook_costs(models[layers], args.hook_reps, none)
             for layers in args.layers for label, none in MODES}
    if dist.get_rank() == 0:
        blocks = report(args, dist.get_world_size(), device, steps, hooks)
        print(render.markdown(blocks), flush=True)
        if args.out:
            data = {f"{layers} layers, {label}": {"steps": steps[key], "hook_us": hooks[key]}
                    for key in steps for layers, label in [key]}
            render.write(args.out, blocks, data)
    dist.destroy_process_group()


def report(args, world, device, steps, hooks) -> list:
    tensors = {layers: host_bench.num_tensors(host_model(layers)) for layers in args.layers}
    return [
        "Command: `make bench-host` (`torchrun --standalone --nproc_per_node=2 -m minddp bench-host`)",
        f"GPT of tiny layers (32 wide, 1 head, vocabulary 64, one sequence of 8 tokens), SGD, one bucket "
        f"(25 MB), {ranks_phrase(world, device)}; {args.repeats} repeats of {args.rounds} rotated rounds x "
        f"{args.steps_per_round} steps per engine. A ratio is what minddp adds to the step over what torch "
        "DDP adds (1.00: the same; below: less).",
        render.table(["tensors", ".grad between steps", "none step (ms)", "torch DDP adds (ms)",
                      "minddp adds (ms)", "ratio, CPU: median", "spread", "ratio, wall: median", "spread"],
                     [step_row(tensors[layers], label, steps[(layers, label)]) for layers, label in steps]),
        "The gradient path alone, communication stubbed on both engines (a comm hook returning a finished "
        f"future): process CPU µs per ready gradient, one forward and backward less the plain model's, median of "
        f"{args.hook_reps}:",
        render.table(["tensors", ".grad between steps", "torch DDP (µs)", "minddp (µs)", "minddp / torch"],
                     [[tensors[layers], label, f"{c['torch DDP']:.2f}", f"{c['minddp']:.2f}",
                       f"{c['minddp'] / c['torch DDP']:.2f}"] for (layers, label), c in hooks.items()]),
    ]


def step_row(tensors: int, label: str, repeats: list[dict]) -> list:
    ms = lambda engine, clock: statistics.median(r[engine][clock] for r in repeats) * 1e3  # noqa: E731
    cpu = [host_bench.added_ratio(r, "cpu") for r in repeats]
    wall = [host_bench.added_ratio(r, "wall") for r in repeats]
    added = lambda engine: f"{ms(engine, 'wall') - ms('none', 'wall'):.1f}"  # noqa: E731
    return [tensors, label, f"{ms('none', 'wall'):.1f}", added("torch DDP"), added("minddp"),
            *render.median_spread(cpu, ".2f"), *render.median_spread(wall, ".2f")]
