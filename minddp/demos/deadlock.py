"""The forbidden conditional collective, `if rank == 0: all_reduce(...)`, and the fix.

Rank 0 waits for partners that never come. With no timeout that is a silent hang.
1. torch's collective fingerprints (TORCH_DISTRIBUTED_DEBUG=DETAIL, `ddp.debug=true` in the
   trainer) compare every collective before it runs: the others' next collective (a barrier)
   does not match rank 0's all_reduce, and every rank raises an error naming both calls.
2. Without them, a short group timeout turns the hang into an error on rank 0.
3. The corrected version calls the collective on every rank and branches afterwards.
"""

from datetime import timedelta

import torch
import torch.distributed as dist

from minddp.train.metrics import flight_recorder

from .common import device, print_table

TIMEOUT_S = 3


def run() -> None:
    r = dist.get_rank()
    level = dist.get_debug_level()
    flight_recorder.enable_fingerprints()
    checked = dist.new_group(timeout=timedelta(seconds=30))  # groups created now are checked
    dist.set_debug_level(level)
    fingerprint_error = ""
    try:
        if r == 0:  # WRONG
            dist.all_reduce(torch.ones(1, device=device()), group=checked)
        dist.barrier(group=checked)
    except RuntimeError as e:
        fingerprint_error = str(e)
    assert "Detected mismatch between collectives" in fingerprint_error, fingerprint_error
    assert r != 0 or "OpType=ALLREDUCE" in fingerprint_error, fingerprint_error
    print_table("deadlock with torch's fingerprints (DETAIL): every rank gets the error at once",
                [fingerprint_error.split(", TensorDtypes")[0].split(", TensorShape")[0][:150]])

    # every rank creates it; gloo even under nccl, whose watchdog would abort the process on
    # a timeout instead of raising (TORCH_NCCL_ASYNC_ERROR_HANDLING), ending the demo
    short = dist.new_group(timeout=timedelta(seconds=TIMEOUT_S), backend="gloo")  # see above
    t = torch.ones(1, device="cpu")  # a gloo group: host tensor
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
    fixed = torch.ones(1, device=device())
    dist.all_reduce(fixed)
    assert fixed.item() == dist.get_world_size()
    print_table("deadlock fixed: every rank calls all_reduce, then branches",
                [f"sum={fixed.item()}", "prints" if r == 0 else "stays quiet"])
