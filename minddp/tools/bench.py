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

`--calibrate FILE` goes on to `minddp calibrate` (make calibrate) after the sweep: what the DDP
cost model needs beyond alpha and beta.
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch
import torch.distributed as dist

from .. import collectives as C
from ..costmodel import busbw_factor, coefficients, parse_size
from .cli import start, timed

OPS = ["all_reduce", "reduce_scatter", "all_gather", "broadcast", "reduce", "all_to_all",
       "ring_all_reduce", "rs_ag_all_reduce", "tree_all_reduce",
       "zero1_reduce_scatter", "zero1_all_gather"]  # ZeRO-1's in place (minddp.collectives)
DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16,
          "float16": torch.float16}


class _Inputs:
    """One size's buffers on known values (small integers: exact in every dtype), so a check
    can count the wrong elements after one call."""

    def __init__(self, nbytes: int, dtype, n: int, r: int, device):
        esize = torch.empty((), dtype=dtype).element_size()
        self.count = max(n, nbytes // esize // n * n)  # a multiple of n elements
        self.n, self.r, self.per, self.dtype, self.device = n, r, self.count // n, dtype, device
        self.x = torch.ones(self.count, dtype=dtype, device=device)
        self.pos = torch.arange(self.count, device=device) % 3
        self.block = torch.arange(self.count, device=device) // self.per  # whose slice an element is in
        self.mine = slice(r * self.per, (r + 1) * self.per)

    def summed(self, pos=None):  # what a sum of pos + rank + 1 over the ranks gives
        pos = self.pos if pos is None else pos
        return (self.n * pos + self.n * (self.n + 1) / 2).to(self.dtype)

    def wrong(self, got, want) -> int:
        return (got != want.to(self.dtype)).sum().item()


def _sum_of_ranks(c: _Inputs, fn, got=None, want=None):
    """(fn, check) for a reduction of pos + rank + 1: `got` (default the whole buffer) must hold
    `want` (default the sum everywhere)."""
    def check():
        c.x.copy_(c.pos + c.r + 1)
        fn()
        return c.wrong(c.x if got is None else got(), c.summed() if want is None else want())
    return fn, check


def _gathered(c: _Inputs, fn, fill):
    """(fn, check) for a gather: after `fill()`, every element must be its owner's rank + 1."""
    def check():
        fill()
        fn()
        return c.wrong(c.x, c.block + 1)
    return fn, check


def _reduce_scatter(c):
    out = torch.empty(c.per, dtype=c.dtype, device=c.device)
    return _sum_of_ranks(c, lambda: dist.reduce_scatter_tensor(out, c.x), lambda: out,
                         lambda: c.summed(c.pos[c.mine]))


def _all_gather(c):
    mine = torch.empty(c.per, dtype=c.dtype, device=c.device)
    return _gathered(c, lambda: dist.all_gather_into_tensor(c.x, mine), lambda: mine.fill_(c.r + 1))


def _zero1_all_gather(c):
    def fill():
        c.x.fill_(-1)
        c.x[c.mine] = c.r + 1
    return _gathered(c, lambda: C.all_gather_in_place(c.x, dist.group.WORLD).wait(), fill)


def _broadcast(c):
    def check():
        c.x.copy_(c.pos + c.r)
        fn()
        return c.wrong(c.x, c.pos)
    fn = lambda: dist.broadcast(c.x, src=0)  # noqa: E731
    return fn, check


def _all_to_all(c):
    out = torch.empty_like(c.x)
    fn = lambda: dist.all_to_all_single(out, c.x)  # noqa: E731

    def check():
        c.x.copy_(c.block * 10 + c.r)  # block j of rank r: 10j + r
        fn()
        return c.wrong(out, c.r * 10 + c.block)
    return fn, check


# op -> (fn, check) builder over _Inputs
_CASES = {
    "all_reduce": lambda c: _sum_of_ranks(c, lambda: dist.all_reduce(c.x)),
    "ring_all_reduce": lambda c: _sum_of_ranks(c, lambda: C.ring_all_reduce(c.x)),
    "rs_ag_all_reduce": lambda c: _sum_of_ranks(c, lambda: C.all_reduce_via_rs_ag(c.x)),
    "tree_all_reduce": lambda c: _sum_of_ranks(c, lambda: C.tree_all_reduce(c.x)),
    "reduce_scatter": _reduce_scatter,
    "zero1_reduce_scatter": lambda c: _sum_of_ranks(  # the engine's own: in place, this rank's slice
        c, lambda: C.reduce_scatter_in_place(c.x, dist.group.WORLD, dist.ReduceOp.SUM).wait(),
        lambda: c.x[c.mine], lambda: c.summed(c.pos[c.mine])),
    "zero1_all_gather": _zero1_all_gather,
    "all_gather": _all_gather,
    "broadcast": _broadcast,
    "reduce": lambda c: _sum_of_ranks(c, lambda: dist.reduce(c.x, dst=0), lambda: c.x,
                                      lambda: c.summed() if c.r == 0 else c.x),
    "all_to_all": _all_to_all,
}


def _setup(op: str, nbytes: int, dtype, n: int, r: int, device=None):
    """(element count, callable, check) for one size: check() runs one call on known inputs and
    returns the number of wrong elements."""
    if op not in _CASES:
        raise ValueError(f"unknown op {op!r}; one of {OPS}")
    c = _Inputs(nbytes, dtype, n, r, device)
    return (c.count, *_CASES[op](c))


def sweep_sizes(minbytes: int, maxbytes: int, factor: float) -> list[int]:
    """nccl-tests' -b/-e/-f: sizes from minbytes, times factor, up to maxbytes."""
    sizes, s = [], int(minbytes)
    while s <= maxbytes:
        sizes.append(s)
        s = max(s + 1, int(s * factor))
    return sizes


def run_op(op, sizes, dtype, warmup, iters, device=None):
    device = device or torch.device("cpu")  # called outside a job (tests)
    n, r = dist.get_world_size(), dist.get_rank()
    rows = []
    for nbytes in sizes:
        count, fn, check = _setup(op, nbytes, dtype, n, r, device)
        size = count * torch.empty((), dtype=dtype).element_size()
        for _ in range(warmup):
            fn()
        dist.barrier()
        # synchronised on CUDA: a collective returns once enqueued (cli.timing_strategy)
        times = [timed(fn, device) for _ in range(iters)]
        # the median iteration: on a shared 2-core VM single iterations stall for milliseconds
        t = torch.tensor([statistics.median(times)], dtype=torch.float64, device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)  # the slowest rank sets the time
        wrong = torch.tensor([check()], dtype=torch.int64, device=device)
        dist.all_reduce(wrong)
        sec = t.item()
        algbw = size / sec / 1e9
        rows.append({"op": op, "size": size, "count": count, "type": str(dtype).removeprefix("torch."),
                     "time_us": sec * 1e6, "algbw": algbw, "busbw": algbw * busbw_factor(op, n),
                     "wrong": int(wrong.item())})
    return rows


def fit_alpha_beta(rows, n) -> tuple[float, float]:
    """Least squares for t = ca*alpha + cb*size*(1/beta) in relative error (each size counts
    alike: in absolute error the largest sizes decide alpha too, from their noise);
    returns (alpha s, beta bytes/s)."""
    ca, cb = coefficients(rows[0]["op"], n)
    y = torch.tensor([r["time_us"] * 1e-6 for r in rows], dtype=torch.float64)
    A = torch.tensor([[ca, cb * r["size"]] for r in rows], dtype=torch.float64) / y.unsqueeze(1)
    sol = torch.linalg.lstsq(A, torch.ones_like(y).unsqueeze(1)).solution.flatten()
    alpha, inv_beta = sol.tolist()
    return alpha, (1 / inv_beta if inv_beta > 0 else float("inf"))


def memcpy_bandwidth(nbytes=256 * 2**20, reps=5, device=None) -> float:
    device = device or torch.device("cpu")  # called outside a job (tests)
    src = torch.ones(nbytes // 4, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    seconds = timed(lambda: [dst.copy_(src) for _ in range(reps)], device)
    return nbytes * reps / seconds


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="minddp bench", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-b", "--minbytes", type=parse_size, default=8)
    ap.add_argument("-e", "--maxbytes", type=parse_size, default=parse_size("64MiB"))
    ap.add_argument("-f", "--stepfactor", type=float, default=4)
    ap.add_argument("--op", default="all_reduce", help=f"one of {OPS}, or all")
    ap.add_argument("-d", "--dtype", default="float32", choices=sorted(DTYPES))
    ap.add_argument("-w", "--warmup", type=int, default=3)
    ap.add_argument("-n", "--iters", type=int, default=10)
    ap.add_argument("--backend", default="auto", choices=["auto", "gloo", "nccl"],
                    help="auto: nccl on CUDA (device cuda:LOCAL_RANK), else gloo on CPU")
    ap.add_argument("--repeats", type=int, default=1,
                    help="with --calibrate: measure everything this often, keep the medians")
    ap.add_argument("--calibrate", metavar="FILE",
                    help="then `minddp calibrate` on these rows: write the calibration JSON")
    ap.add_argument("--csv")
    ap.add_argument("--json")
    return ap


def main(argv=None) -> None:
    args = _parser().parse_args(argv)
    device = start(args.backend).device
    n, rank = dist.get_world_size(), dist.get_rank()
    sizes = sweep_sizes(args.minbytes, args.maxbytes, args.stepfactor)
    ops = OPS if args.op == "all" else args.op.split(",")
    all_rows = []
    for op in ops:
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
    if args.calibrate:
        from .calibrate import calibrate

        calibrate(args.calibrate, ops, sizes, args.warmup, args.iters, args.repeats, device, all_rows)
    bw = memcpy_bandwidth(device=device) if rank == 0 else 0.0
    if rank == 0:
        print(f"\n# memory copy bandwidth ({device.type}, 256 MiB): {bw / 1e9:.2f} GB/s")
        _write_rows(args, all_rows, n, bw)
    bad = sum(r["wrong"] for r in all_rows)
    dist.destroy_process_group()
    if bad:
        raise SystemExit(f"{bad} wrong elements")


def _write_rows(args, all_rows: list[dict], n: int, bw: float) -> None:
    if args.csv:
        with open(args.csv, "w") as f:
            f.write("op,size,count,type,time_us,algbw,busbw,wrong\n")
            for r in all_rows:
                f.write(",".join(str(r[k]) for k in ("op", "size", "count", "type", "time_us",
                                                     "algbw", "busbw", "wrong")) + "\n")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"world_size": n, "rows": all_rows, "memcpy_gbs": bw / 1e9}, f, indent=1)


if __name__ == "__main__":
    main()
