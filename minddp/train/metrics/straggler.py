"""The slowest rank: each rank's own time per step, gathered every train.check_every steps on
the replica check's all-gather (no collective of its own), so rank 0 can log the spread.

A rank's time is from the step's start to its arrival at the step's agreement (the one
all-reduce every step ends with): its own forward, backward and gradient reduction, before
it waits for the others there. A rank that stalls arrives last; the others' times stay short.
Host clock on CPU; CUDA events on a GPU (the host only enqueues), read after the agreement's
host read, so no extra synchronisation.
"""

from __future__ import annotations

import statistics
import time

import torch


class ArrivalClock:
    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.total, self.steps, self.t0 = 0.0, 0, 0.0
        if self.cuda:
            self.begin_ev = torch.cuda.Event(enable_timing=True)
            self.arrive_ev = torch.cuda.Event(enable_timing=True)

    def begin(self) -> None:
        if self.cuda:
            self.begin_ev.record()
        else:
            self.t0 = time.perf_counter()

    def arrive(self) -> None:
        """Just before the step's agreement all-reduce."""
        if self.cuda:
            self.arrive_ev.record()
        else:
            self.total += time.perf_counter() - self.t0
            self.steps += 1

    def settled(self) -> None:
        """After the agreement's host read: on CUDA both events have completed by then."""
        if self.cuda:
            self.total += self.begin_ev.elapsed_time(self.arrive_ev) / 1e3
            self.steps += 1

    def take(self) -> float:
        """This rank's mean time per step since the last take (seconds), and start again."""
        mean = self.total / max(1, self.steps)
        self.total, self.steps = 0.0, 0
        return mean


def spread(times: dict[int, float]) -> dict:
    """{global rank: seconds} -> the metrics row's rank/* keys."""
    slowest = max(times, key=times.get)
    return {"rank/step_time_min_s": min(times.values()),
            "rank/step_time_median_s": statistics.median(times.values()),
            "rank/step_time_max_s": times[slowest], "rank/slowest": slowest}
