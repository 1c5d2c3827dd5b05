"""The trainer against hand-written loops on the same work: `make bench-trainer`.

    torchrun --standalone --nproc_per_node=2 -m minddp bench-trainer [--rounds 6] [--out FILE]

Three loops run in the same processes, on the same GPT, the same data path and batches:
- the trainer: `Trainer.run_step`, exactly what `train.py` runs each step (minddp engine,
  fused AdamW, clipping, the step's agreement all-reduce, a metrics row every step);
- a bare loop: torch DDP, fused AdamW, accumulation by `require_backward_grad_sync`, no
  logging, no clipping: the least a data-parallel loop can do;
- a nanoGPT-style loop: torch DDP, AdamW with its default (foreach) kernel, clipping, and
  `loss.item()` every step, as nanoGPT's train.py does with its defaults.
Ranks are pinned to a core each; rounds of `--steps` steps per loop in a rotated order;
ratios of medians. The trainer's own per-step costs are timed method by method. The loops
and the comparison are minddp/perf/loops.py.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile

import torch
import torch.distributed as dist
from hydra import compose, initialize_config_dir

from ..model.build import build_model
from ..parallel.dist import exit_worker
from ..perf.clock import Clock, timed_methods
from ..perf.loops import HandLoop, compare
from ..train.config import register
from ..train.trainer import Trainer
from . import render
from .arguments import positive_int, tool_parser, writable_out
from .cli import pin_to_core, ranks_phrase
from .workload import GPT_PRESETS, overrides

WORKLOAD = [*overrides(GPT_PRESETS["gpt-trainer"]), "train.global_batch_size=32", "train.micro_batch_size=8",
            "data=text", "wandb.mode=disabled", "train.eval_every=0", "train.ckpt_every=0",
            "train.max_steps=100000"]


def make_trainer(extra: list[str], run_dir: str) -> Trainer:
    import pathlib

    register()
    conf = str(pathlib.Path(__file__).resolve().parents[2] / "conf")  # the repository's conf/
    with initialize_config_dir(config_dir=conf, version_base="1.3"):
        cfg = compose("config", overrides=WORKLOAD + extra)
    trainer = Trainer(cfg, run_dir)
    trainer.setup()
    return trainer


def main(argv=None) -> None:
    ap = tool_parser("bench-trainer", __doc__, argparse.RawTextHelpFormatter)
    ap.add_argument("--repeats", type=positive_int, default=5)
    ap.add_argument("--rounds", type=positive_int, default=6)
    ap.add_argument("--steps", type=positive_int, default=3, help="steps of each loop per round")
    ap.add_argument("--out", type=writable_out, default=None,
                    help="also write the report here: FILE.md and FILE.json")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():  # GPU ranks are never pinned (see cli.start)
        pin_to_core()
    torch.set_num_threads(1)
    run_dir = tempfile.mkdtemp(prefix="bench-trainer-")  # the trainer's own files: none is kept
    try:
        measure(args, run_dir)
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)
    dist.destroy_process_group()
    exit_worker()  # the trainer turned torch's flight recorder on: see minddp.parallel.dist.exit_worker


def measure(args, run_dir: str) -> None:
    """The three loops in rotated rounds; rank 0 prints (and with --out writes) the report."""
    trainer = make_trainer([], run_dir)
    cfg, device = trainer.cfg, trainer.info.device

    def hand_loop(fused: bool, nanogpt: bool) -> HandLoop:
        torch.manual_seed(cfg.seed)
        model = build_model(cfg.model, trainer.vocab_size).to(device)
        return HandLoop(model, trainer.batches, trainer.accum, cfg.optim.lr, fused, nanogpt)

    loops = {"trainer": trainer.run_step, "bare loop": hand_loop(True, False).step,
             "nanoGPT-style loop": hand_loop(False, True).step}
    clock = Clock(device)
    marks = timed_methods({"opt.clip_grad_norm_": (trainer.opt, "clip_grad_norm_"),
                           "agree": (trainer, "agree"), "opt.step": (trainer.opt, "step"),
                           "log": (trainer, "log")}, clock)
    medians, ratios = compare(loops, device, args.repeats, args.rounds, args.steps)
    spent = {k: [clock.seconds(a, z) for a, z in v] for k, v in marks.items()}
    if dist.get_rank() == 0:
        blocks = report(args, trainer, medians, ratios, spent)
        print(render.markdown(blocks), flush=True)
        if args.out:
            render.write(args.out, blocks, {"ratios": ratios, "medians_s": medians, "parts_s": spent})
    trainer.tracker.close()


def report(args, trainer, medians, ratios, spent) -> list:
    """The report's blocks (render.markdown)."""
    step, gpt = statistics.median(medians["trainer"]), GPT_PRESETS["gpt-trainer"]
    loops = [[k, f"{statistics.median(medians[k]) * 1e3:.1f}", *render.median_spread(ratios[k])]
             for k in medians]
    parts = [[f"`{name}`", f"{statistics.mean(v) * 1e3:.2f}", f"{statistics.mean(v) / step:.1%}"]
             for name, v in spent.items()]
    rest = step - sum(statistics.mean(v) for v in spent.values())
    parts.append(["the rest (forward, backward, scheduler, zero_grad, timing)", f"{rest * 1e3:.2f}",
                  f"{rest / step:.1%}"])
    return [
        "# The trainer against hand-written loops",
        "Command: `make bench-trainer` (`torchrun --standalone --nproc_per_node=2 -m minddp bench-trainer`). "
        f"GPT {trainer.num_params / 1e6:.2f}M parameters ({gpt['n_layer']} layers, {gpt['n_embd']} wide, "
        f"block {gpt['block_size']}, bytes), global batch {trainer.cfg.train.global_batch_size}, micro-batch "
        f"{trainer.cfg.train.micro_batch_size}, fp32 eager, "
        f"{ranks_phrase(trainer.info.world_size, trainer.info.device)}; "
        f"{args.repeats} repeats of {args.rounds} rotated rounds x {args.steps} steps per loop. Per repeat "
        "the ratio of median steps (each step's time the max over ranks); below, the median and "
        "spread (min-max) of those ratios over the repeats.",
        render.table(["loop", "median step (ms)", "trainer / loop: median", "spread"], loops),
        "Where the trainer's step goes (its own methods, timed; share of the median step):",
        render.table(["part", "mean (ms)", "share"], parts),
    ]


if __name__ == "__main__":
    main()
