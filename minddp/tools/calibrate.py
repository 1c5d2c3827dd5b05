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
With --repeats everything is measured that often and each figure is the median.
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.distributed as dist

from ..perf.calibration import combine, measure
from ..perf.sweep import run_op, sweep_sizes
from .cli import parse_size, start
from .workload import GPT_PRESETS, STUDY, STUDY_BATCH, build

# make scaling's GPT and its micro-batch (train.micro_batch_size=2): the floor and the contention
# depend on what backward runs beside the communication
FLOOR_MODEL, FLOOR_BATCH = GPT_PRESETS[STUDY], STUDY_BATCH[1]
# caps the under-backward fit runs the engine at: other bucket layouts than make scaling's caps
# (1, 5, 25, 100 MB) give, so its predictions there are out of sample
UNDER_CAPS = (3.0, 8.0, 12.0, 16.0)


def write_calibration(path, rows, n, device, floor: dict | None = None, under: dict | None = None,
                      more_rows=()) -> dict:
    """alpha and beta from `rows`, then contention, engine cost, the completion floor and the
    under-backward fits on make scaling's GPT (`floor`: its `model_cfg` and `batch`, and
    completion_floor's keywords; `under`: under_backward_fit's; for a quicker measurement in
    tests). With `more_rows` (the sweep repeated), everything is measured once per sweep and
    each figure is the median over the repeats (minddp.perf.calibration)."""
    floor = dict(floor or {})
    cfg, batch = floor.pop("model_cfg", FLOOR_MODEL), floor.pop("batch", FLOOR_BATCH)
    make = lambda: build(cfg, device, batch)  # noqa: E731
    small = lambda: build(GPT_PRESETS["gpt-small"], device, batch=4)  # noqa: E731
    about = {"batch": batch, "model": cfg}
    cal = combine([measure(r, device, make, small, UNDER_CAPS, floor, under, about)
                   for r in [rows, *more_rows]])  # n: the process group's, as measured
    if dist.get_rank() == 0:
        with open(path, "w") as f:
            json.dump(cal, f, indent=1)
    return cal


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="minddp calibrate", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="docs/calibration.json", help="the calibration JSON")
    ap.add_argument("--ops", default="all_reduce,zero1_reduce_scatter,zero1_all_gather",
                    help="the collectives swept for alpha and beta (of minddp bench's)")
    ap.add_argument("-b", "--minbytes", type=parse_size, default=8)
    ap.add_argument("-e", "--maxbytes", type=parse_size, default=parse_size("64MiB"))
    ap.add_argument("-f", "--stepfactor", type=float, default=4)
    ap.add_argument("-w", "--warmup", type=int, default=5)
    ap.add_argument("-n", "--iters", type=int, default=30)
    ap.add_argument("--repeats", type=int, default=3, help="measure everything this often, keep the medians")
    ap.add_argument("--backend", default="auto", choices=["auto", "gloo", "nccl"])
    return ap


def calibrate(path, ops, sizes, warmup: int, iters: int, repeats: int, device, rows=None) -> dict:
    """Sweep `ops` `repeats` times (the first sweep may be given: `rows`), write the calibration."""
    def sweep():
        return [r for op in ops for r in run_op(op, sizes, torch.float32, warmup, iters, device)]

    runs = [rows or sweep()] + [sweep() for _ in range(repeats - 1)]
    cal = write_calibration(path, runs[0], dist.get_world_size(), device, more_rows=runs[1:])
    if dist.get_rank() == 0:
        print(summary(path, cal))
    return cal


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
    args = _parser().parse_args(argv)
    device = start(args.backend).device
    sizes = sweep_sizes(args.minbytes, args.maxbytes, args.stepfactor)
    calibrate(args.out, args.ops.split(","), sizes, args.warmup, args.iters, args.repeats, device)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
