"""The forbidden conditional collective, `if rank == 0: all_reduce(...)`, and the fix.

Rank 0 waits for partners that never come. With no timeout that is a silent hang.
1. minddp's fingerprints (minddp.debug) compare every collective before it runs: the
   others' next collective (a barrier) does not match rank 0's all_reduce, and every rank
   raises an error naming both calls, at once.
2. Without them, a short group timeout turns the hang into an error on rank 0.
3. The corrected version calls the collective on every rank and branches afterwards.
"""

from datetime import timedelta

import torch
import torch.distributed as dist

from minddp import debug

from .common import print_table

TIMEOUT_S = 3


def run() -> None:
    r = dist.get_rank()
    debug.enable(record=100, fingerprints=True, timeout_s=30)
    fingerprint_error = ""
    try:
        if r == 0:  # WRONG
            dist.all_reduce(torch.ones(1))
        dist.barrier()
    except debug.CollectiveMismatchError as e:
        fingerprint_error = str(e)
    finally:
        debug.disable()
    assert "called all_reduce" in fingerprint_error and "called barrier" in fingerprint_error
    print_table("deadlock with minddp fingerprints: every rank gets the error at once",
                [fingerprint_error[:150]])

    short = dist.new_group(timeout=timedelta(seconds=TIMEOUT_S))  # every rank creates it
    t = torch.ones(1)
    caught = ""
    if r == 0:  # WRONG: only rank 0 enters the collective
        try:
            dist.all_reduce(t, group=short)
        except RuntimeError as e:
            caught = str(e).splitlines()[0].split("] ")[-1][:160]
    dist.barrier()  # the others wait here (on the default group) until rank 0 has timed out
    if r == 0:
        assert caught, "the conditional all_reduce should have timed out"
        print(f"deadlock: rank 0 alone in all_reduce -> after {TIMEOUT_S}s: {caught!r}")
    dist.destroy_process_group(short)  # its state is poisoned: gloo may still hold the op

    # RIGHT: every rank calls the collective; only what happens after depends on the rank
    fixed = torch.ones(1)
    dist.all_reduce(fixed)
    assert fixed.item() == dist.get_world_size()
    print_table("deadlock fixed: every rank calls all_reduce, then branches",
                [f"sum={fixed.item()}", "prints" if r == 0 else "stays quiet"])
