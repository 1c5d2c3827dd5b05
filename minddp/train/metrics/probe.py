"""The step's instrumentation, behind one object the step calls at named points, so that
`Trainer.train_step` reads as nanoGPT's loop (micro-steps, backward, clip, the agreement, the
optimizer step, zero_grad) and nothing else:

    probe.begin(step)              the flight recorder's context (its dict, updated in place), a
                                   traced step's StepTrace, the arrival clock's start
    with probe.forward(m): ...     a traced step's phases (nothing otherwise)
    with probe.backward(m): ...
    probe.after_backward(step, model, loss_sum)   injected faults (train.fault_*), then the
                                   flight recorder's "optimizer" phase
    probe.memory_slot()            this rank's peak RSS in its own slot: the agreement's average,
                                   times the world, holds every rank's
    probe.arrive() / settled()     the arrival clock around the agreement (the straggler report)
    probe.end(step)                a traced step's trace gathered from every rank (a collective,
                                   every rank calls it) and written by rank 0
"""

from __future__ import annotations

import contextlib
import logging
import resource
import time

import torch

from . import flight_recorder, steptrace

log = logging.getLogger("minddp")


class ArrivalClock:
    """A rank's time from the step's start to its arrival at the step's agreement (the one
    all-reduce every step ends with): its own forward, backward and gradient reduction, before
    it waits for the others. A rank that stalls arrives last (straggler.py: the spread). Host
    clock on CPU; CUDA events on a GPU (the host only enqueues), read after the agreement's host
    read, so no extra synchronisation."""

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


class StepProbe:
    def __init__(self, ddp, faults, device, *, trace_step: int | None, run_dir: str, overlap: bool,
                 rank: int, world: int):
        self.ddp, self.faults = ddp, faults if faults.in_step else None
        self.clock = ArrivalClock(device)  # read by the replica check (check_every): clock.take()
        self.trace_step, self.run_dir, self.overlap = trace_step, run_dir, overlap
        self.rank, self.world = rank, world
        self.trace = None  # the traced step's StepTrace, between begin and end
        self.where = flight_recorder.CONTEXT  # what a dump says of the step: updated here in place

    def begin(self, step: int) -> None:
        self.where.update(step=step, phase="forward/backward")
        if step == self.trace_step:
            self.trace = steptrace.StepTrace(self.ddp).start()
        self.clock.begin()

    def forward(self, m: int) -> contextlib.AbstractContextManager:
        return self.trace.phase(f"forward {m}") if self.trace else contextlib.nullcontext()

    def backward(self, m: int) -> contextlib.AbstractContextManager:
        return self.trace.phase(f"backward {m}") if self.trace else contextlib.nullcontext()

    def after_backward(self, step: int, model, loss_sum) -> None:
        if self.faults is not None:  # a train.fault_* set for a step
            self.faults.after_backward(step, model, loss_sum)
        self.where["phase"] = "optimizer"

    def memory_slot(self) -> list[float]:
        """[0, ..., this rank's peak RSS (MiB) x world, ..., 0]: averaged over ranks, each slot
        holds its rank's own peak."""
        slots = [0.0] * self.world
        slots[self.rank] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024 * self.world
        return slots

    def arrive(self) -> None:
        self.clock.arrive()

    def settled(self) -> None:
        self.clock.settled()

    def end(self, step: int) -> None:
        if self.trace is None:
            return
        trace, self.trace = self.trace, None
        # a collective (every rank's trace to every rank), then rank 0 writes
        traces = {f"step {step}, overlap={self.overlap}": steptrace.gather(trace.stop())}
        if self.rank == 0:
            files = steptrace.write(traces, f"{self.run_dir}/trace_step{step}")
            log.info(f"wrote {files[0]} and {files[1]}")
