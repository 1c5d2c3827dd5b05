"""The collective sweep behind `minddp bench` and `minddp calibrate`, in the style of NVIDIA's
nccl-tests, and the alpha-beta fit of its rows.

Each size's buffers hold known values, so one checked call counts the wrong elements; the
time is the median of the timed iterations on the slowest rank (nccl-tests takes the mean,
which one stall on a shared VM ruins). "size" is the largest buffer involved (the input of
reduce-scatter, the output of all-gather). The fit is t = ca*alpha + cb*size/beta with the
op's own cost coefficients (costmodel.coefficients).
"""

from __future__ import annotations

import statistics

import torch
import torch.distributed as dist

from ..comm import collectives as C
from .clock import timed
from .costmodel import busbw_factor, coefficients

OPS = ["all_reduce", "reduce_scatter", "all_gather", "broadcast", "reduce", "all_to_all",
       "ring_all_reduce", "rs_ag_all_reduce", "tree_all_reduce",
       "zero1_reduce_scatter", "zero1_all_gather"]  # ZeRO-1's in place (minddp.comm.collectives)
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
        # the device's clock: on CUDA a collective returns once enqueued
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
