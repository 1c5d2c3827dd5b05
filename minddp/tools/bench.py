"""Collective benchmark in the style of NVIDIA's nccl-tests, plus an alpha-beta fit.

    torchrun --standalone --nproc_per_node=2 -m minddp bench -b 8 -e 64M -f 4 --op all_reduce
    torchrun ... -m minddp bench --op all          # every op, one table each
    torchrun ... -m minddp bench --op ring_all_reduce --csv out.csv --json out.json

Columns as nccl-tests: size (bytes), count (elements), type, time (us: the median of the
timed iterations on the slowest rank; nccl-tests takes the mean, which one stall on a
shared VM ruins), algbw = size / time, busbw = algbw * the op's factor (all-reduce
2(n-1)/n; reduce-scatter, all-gather, all-to-all (n-1)/n; broadcast, reduce 1), and
#wrong: elements that differ from the closed-form result of one checked call with known
inputs. "size" is the largest buffer involved (the input of reduce-scatter, the output
of all-gather).
Then t = ca*alpha + cb*size/beta (the op's own cost coefficients) is fitted by least
squares, and the machine's memory-copy bandwidth is printed as the physical reference.
The sweep and the fit are minddp/perf/sweep.py; `minddp calibrate` (make calibrate) measures
what the DDP cost model needs beyond alpha and beta.
"""

from __future__ import annotations

import argparse
import csv
import json

import torch.distributed as dist

from ..perf.sweep import DTYPES, OPS, fit_alpha_beta, memcpy_bandwidth, run_op, sweep_sizes
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
from .cli import start


def _parser() -> argparse.ArgumentParser:
    ap = tool_parser("bench", __doc__)
    ap.add_argument("-b", "--minbytes", type=size, default=8)
    ap.add_argument("-e", "--maxbytes", type=size, default=parse_size("64MiB"))
    ap.add_argument("-f", "--stepfactor", type=number(1.0), default=4, help="> 1")
    ap.add_argument("--op", type=choice_list(OPS, every="all"), default="all_reduce",
                    help=f"one of {OPS}, or all")
    ap.add_argument("-d", "--dtype", default="float32", choices=sorted(DTYPES))
    ap.add_argument("-w", "--warmup", type=nonnegative_int, default=3)
    ap.add_argument("-n", "--iters", type=positive_int, default=10)
    ap.add_argument("--backend", default="auto", choices=["auto", "gloo", "nccl"],
                    help="auto: nccl on CUDA (device cuda:LOCAL_RANK), else gloo on CPU")
    ap.add_argument("--csv", type=writable_out)
    ap.add_argument("--json", type=writable_out)
    return ap


def parse_sweep(ap: argparse.ArgumentParser, argv=None) -> argparse.Namespace:
    """The arguments of a size sweep (bench, calibrate): -b no larger than -e."""
    args = ap.parse_args(argv)
    if args.minbytes > args.maxbytes:
        ap.error(f"-b/--minbytes {args.minbytes:g} is more than -e/--maxbytes {args.maxbytes:g}")
    return args


def main(argv=None) -> None:
    args = parse_sweep(_parser(), argv)
    device = start(args.backend).device
    n, rank = dist.get_world_size(), dist.get_rank()
    sizes = sweep_sizes(args.minbytes, args.maxbytes, args.stepfactor)
    all_rows = []
    for op in args.op:
        rows = run_op(op, sizes, DTYPES[args.dtype], args.warmup, args.iters, device)
        all_rows += rows
        if rank == 0:
            print(f"\n# {op}, {n} ranks ({dist.get_backend()}), {args.warmup} warm-up + {args.iters} timed")
            print(f"{'size':>12} {'count':>12} {'type':>9} {'time(us)':>11} {'algbw(GB/s)':>12} "
                  f"{'busbw(GB/s)':>12} {'#wrong':>7}")
            for r in rows:
                print(f"{r['size']:>12} {r['count']:>12} {r['type']:>9} {r['time_us']:>11.1f} "
                      f"{r['algbw']:>12.3f} {r['busbw']:>12.3f} {r['wrong']:>7}")
            if n > 1 and len(rows) >= 2:
                alpha, beta = fit_alpha_beta(rows, n)
                print(f"# alpha-beta fit ({op}): alpha = {alpha * 1e6:.1f} us, beta = {beta / 1e9:.3f} GB/s")
    bw = memcpy_bandwidth(device=device) if rank == 0 else 0.0
    if rank == 0:
        print(f"\n# memory copy bandwidth ({device.type}, 256 MiB): {bw / 1e9:.2f} GB/s")
        _write_rows(args, all_rows, n, bw)
    bad = sum(r["wrong"] for r in all_rows)
    dist.destroy_process_group()
    if bad:
        raise SystemExit(f"{bad} wrong elements")


def _write_rows(args, all_rows: list[dict], n: int, bw: float) -> None:
    if args.csv:  # the columns of the printed table, in its order
        with open(args.csv, "w", newline="") as f:
            w = csv.DictWriter(f, ["op", "size", "count", "type", "time_us", "algbw", "busbw", "wrong"],
                               extrasaction="ignore", lineterminator="\n")
            w.writeheader()
            w.writerows(all_rows)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"world_size": n, "rows": all_rows, "memcpy_gbs": bw / 1e9}, f, indent=1)


if __name__ == "__main__":
    main()
