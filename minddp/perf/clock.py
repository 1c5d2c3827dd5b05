"""The one clock every measurement reads: device time, true on every backend.

On CPU the host clock sees the work itself. On CUDA a kernel or an nccl collective returns
once enqueued, so the host clock would time the enqueue: there each mark is a CUDA event on
the current stream (a blocking collective makes that stream wait for nccl's), read back once
the last one has completed. No tool reads `time.perf_counter` for work on the device.
"""

from __future__ import annotations

import statistics
import time
from collections import defaultdict

import torch
import torch.distributed as dist


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timing_strategy(device: torch.device) -> str:
    """How `timed` reads a device: CUDA events between synchronisations, or the host clock."""
    return "cuda-sync" if device.type == "cuda" else "host-clock"


class Clock:
    """Marks on the device's own clock: host time on CPU; on CUDA an event per mark (the host
    only enqueued the work), put on the host clock from the clock's start."""

    def __init__(self, device: torch.device):
        self.device, self.cuda = device, device.type == "cuda"
        self.t0 = time.perf_counter()
        self.origin = self.mark()

    def mark(self):
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def at(self, mark) -> float:
        """A mark as seconds on the host clock (waits for a CUDA event to complete)."""
        if not self.cuda:
            return mark
        mark.synchronize()
        return self.t0 + self.origin.elapsed_time(mark) / 1e3

    def seconds(self, start, end) -> float:
        return self.at(end) - self.at(start)


def timed(fn, device: torch.device) -> float:
    """Seconds that fn's work takes on `device` (on CUDA: the work enqueued before is finished
    first, so it is not counted)."""
    sync(device)
    clock = Clock(device)
    start = clock.mark()
    fn()
    return clock.seconds(start, clock.mark())


class PhaseClock(Clock):
    """Named phase boundaries on the device's clock: mark(name) at the end of each phase."""

    def __init__(self, device: torch.device):
        super().__init__(device)
        self.marks = [(None, self.origin)]

    def mark(self, name: str | None = None):
        m = super().mark()
        if name is not None:
            self.marks.append((name, m))
        return m

    def spans(self) -> list[tuple[str, float, float]]:
        times = [self.at(m) for _, m in self.marks]
        return [(name, a, z) for (name, _), a, z in zip(self.marks[1:], times, times[1:])]


def after_warmup(step, reps: int, warmup: int = 2) -> list:
    """step() warmup + reps times, the results of the last reps: the first call rebuilds the
    buckets (the engine's and torch DDP's), the second warms the optimizer's states."""
    return [step() for _ in range(warmup + reps)][warmup:]


def interleaved(steps: list, rounds: int, per_round: int, device: torch.device) -> list[list[float]]:
    """Run each of `steps` (callables returning a time, or a list of times) `per_round` times a
    round, in an order rotated every round, so that the machine's drift hits all alike; round
    0 only warms up (bucket rebuilds, optimizer states). Per step, the median of each of its
    times over the measured rounds, each taken from the slowest rank."""
    times = [[] for _ in steps]
    for r in range(rounds + 1):
        for k in [(i + r) % len(steps) for i in range(len(steps))]:
            for _ in range(per_round):
                dist.barrier()
                t = steps[k]()
                if r:
                    times[k].append(list(t) if isinstance(t, (list, tuple)) else [t])
    t = torch.tensor(times, dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return [[statistics.median(col) for col in zip(*rows)] for rows in t.tolist()]


def timed_methods(parts: dict[str, tuple], clock: Clock) -> dict[str, list]:
    """Wrap methods of some objects to time every call on `clock` (instance attributes only: the
    class is untouched): {label: (object, method name)} -> {label: [(start, end) marks]}, read
    with clock.seconds once the measurement is over."""
    spent = defaultdict(list)  # a method never called: no entry
    for label, (obj, name) in parts.items():
        fn = getattr(obj, name)

        def wrapper(*a, _fn=fn, _label=label, **kw):
            start = clock.mark()
            out = _fn(*a, **kw)
            spent[_label].append((start, clock.mark()))
            return out

        setattr(obj, name, wrapper)
    return spent
