"""The collective benchmark checks every result, and the scaling study runs end to end."""


import pytest
import torch

from minddp.perf.costmodel import busbw_factor
from minddp.perf.sweep import OPS, run_op
from tests import launch


def _all_ops(rank, world_size):
    out = {}
    for op in OPS:
        rows = run_op(op, [8, 1000, 70_000], torch.float32, warmup=1, iters=2)
        for r in rows:
            assert r["wrong"] == 0, r
            assert r["busbw"] == pytest.approx(r["algbw"] * busbw_factor(op, world_size))
        out[op] = rows
    return out


@pytest.mark.parametrize("world_size", [2, 3])
def test_every_op_is_checked_and_correct(world_size):
    rows = launch.ranks(_all_ops, world_size, timeout=120)[0]
    for op, rs in rows.items():
        assert [r["size"] for r in rs] == sorted({r["size"] for r in rs}), (op, rs)  # three sizes, rising
        for r in rs:  # the columns are nccl-tests': algbw = size / time, in GB/s
            assert r["size"] == r["count"] * 4 and r["count"] % world_size == 0
            assert r["algbw"] == pytest.approx(r["size"] / (r["time_us"] * 1e-6) / 1e9)


def _wrong_counts(rank, world_size):
    """The sweep's check of an all-reduce case, run over a collective that does nothing and over
    the real one (no torch function patched: the case takes its collective)."""
    from minddp.perf import sweep

    c = sweep._Inputs(64, torch.float32, world_size, rank, torch.device("cpu"))
    _, broken = sweep._sum_of_ranks(c, lambda: None)
    _, real = sweep._sum_of_ranks(c, lambda: torch.distributed.all_reduce(c.x))
    return broken(), real()


def test_wrong_results_are_counted():
    for broken, real in launch.ranks(_wrong_counts, 2):
        assert broken == 16 and real == 0  # every one of the 16 elements is wrong, then none
