"""`minddp calibrate`: what the DDP cost model needs beyond alpha and beta, measured on this
machine and written as JSON for `minddp costmodel --calibration` and `minddp scaling`.

    torchrun --standalone --nproc_per_node=2 -m minddp calibrate --out docs/calibration.json

- alpha and beta: the collective sweep of `minddp bench` (its nccl-tests-style rows), fitted
  per op; the engine's own ZeRO-1 collectives (zero1_*) stand for reduce-scatter/all-gather;
- contention: a 4 MB all-reduce timed alone and launched under the backward of make scaling's
  GPT (every rank computing, as during training), less the completion floor; where
  communication shares cores with compute, the ratio is > 1;
- the engine's CPU cost per bucket (launch, hooks, wait), with communication stubbed out;
- the per-bucket completion floor: the engine at world 1 (each rank in a group of one) on
  make scaling's GPT, busy time per bucket launched under backward (`completion_floor`);
- under backward: the slowdown and delay for which the cost model's bucket simulation gives the
  busy times the engine shows at other caps than make scaling's (`under_backward_fit`).
With --repeats everything is measured that often and each figure is the median. The
measurements and fits are minddp/perf/calibration.py.
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist

from ..perf import calibration
from ..perf.calibration import UNDER_CAPS  # noqa: F401  (the caps of the under-backward fit)
from ..perf.sweep import OPS, run_op, sweep_sizes
from .arguments import (
    choice_list,
    nonnegative_int,
    number,
    parse_size,
    positive_int,
    size,
    tool_parser,
    writable_out,
)
from .bench import parse_sweep
from .cli import start
from .workload import GPT_PRESETS, STUDY, STUDY_BATCH, build


def write_calibration(path, rows, n, device, floor: dict | None = None, under: dict | None = None,
                      more_rows=()) -> dict:
    """perf.calibration.write on make scaling's GPT and micro-batch (what backward runs beside the
    communication decides the floor and the contention); `floor` may give another `model_cfg`
    and `batch` and completion_floor's keywords, `under` under_backward_fit's (quicker, for
    tests); `more_rows`: the sweep repeated. n: the process group's, as measured."""
    floor = dict(floor or {})
    cfg, batch = floor.pop("model_cfg", GPT_PRESETS[STUDY]), floor.pop("batch", STUDY_BATCH[1])
    make = lambda: build(cfg, device, batch)  # noqa: E731
    small = lambda: build(GPT_PRESETS["gpt-small"], device, batch=4)  # noqa: E731
    return calibration.write(path, [rows, *more_rows], device, make, small, floor, under,
                             {"batch": batch, "model": cfg})


def _parser() -> argparse.ArgumentParser:
    ap = tool_parser("calibrate", __doc__)
    ap.add_argument("--out", type=writable_out, default="docs/calibration.json", help="the calibration JSON")
    ap.add_argument("--ops", type=choice_list(OPS),
                    default="all_reduce,zero1_reduce_scatter,zero1_all_gather",
                    help="the collectives swept for alpha and beta (of minddp bench's)")
    ap.add_argument("-b", "--minbytes", type=size, default=8)
    ap.add_argument("-e", "--maxbytes", type=size, default=parse_size("64MiB"))
    ap.add_argument("-f", "--stepfactor", type=number(1.0), default=4, help="> 1")
    ap.add_argument("-w", "--warmup", type=nonnegative_int, default=5)
    ap.add_argument("-n", "--iters", type=positive_int, default=30)
    ap.add_argument("--repeats", type=positive_int, default=3,
                    help="measure everything this often, keep the medians")
    ap.add_argument("--backend", default="auto", choices=["auto", "gloo", "nccl"])
    return ap


def summary(path, cal: dict) -> str:
    floor_ms, engine_us = cal["floor"]["per_bucket_s"] * 1e3, cal["overhead_per_bucket_s"] * 1e6
    lines = [f"# calibration -> {path}: alpha {cal['alpha'] * 1e6:.1f} us, beta {cal['beta'] / 1e9:.3f} "
             f"GB/s, contention x{cal['contention']['factor']:.2f}, engine {engine_us:.0f} us per bucket, "
             f"completion floor {floor_ms:.2f} ms per bucket under backward"]
    for op, fit in cal.get("under_backward", {}).items():
        caps = ", ".join(f"{p['cap_mb']:g}" for p in fit["points"])
        lines.append(f"# {op} under backward (the engine at caps {caps} MB): x{fit['slowdown']:.2f} slower "
                     f"after {fit['delay_s'] * 1e3:.2f} ms per bucket, backward {fit['backward_share']:.2f} "
                     "of forward + backward")
    return "\n".join(lines)


def main(argv=None) -> None:
    args = parse_sweep(_parser(), argv)
    device = start(args.backend).device
    sizes = sweep_sizes(args.minbytes, args.maxbytes, args.stepfactor)
    sweeps = [[r for op in args.ops
               for r in run_op(op, sizes, torch.float32, args.warmup, args.iters, device)]
              for _ in range(args.repeats)]  # everything measured once per sweep, medians kept
    cal = write_calibration(args.out, sweeps[0], dist.get_world_size(), device, more_rows=sweeps[1:])
    if dist.get_rank() == 0:
        print(summary(args.out, cal))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
