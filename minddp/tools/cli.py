"""Start-up shared by the command-line tools (bench, bench_ddp, bench_trainer, bench_debug,
timeline, scaling): threads, core pinning, the process group on the right device, timing
that is true on every backend, and a headless matplotlib."""

from __future__ import annotations

import os
import statistics
import time

import torch
import torch.distributed as dist

from ..dist import DistInfo, init_distributed

BACKEND_DEVICE = {"auto": "auto", "gloo": "cpu", "nccl": "cuda"}


def pin_to_core() -> None:
    """One rank per core: no two ranks time-share a core, and no migration noise."""
    cores = sorted(os.sched_getaffinity(0))
    local = int(os.environ.get("LOCAL_RANK", "0"))
    os.sched_setaffinity(0, {cores[local % len(cores)]})


def start(backend: str = "auto", pin: bool = False) -> DistInfo:
    """Threads from OMP_NUM_THREADS, the process group whose backend follows the device
    (`cuda:LOCAL_RANK` with nccl, else CPU with gloo), and with `pin` each CPU rank on a core of
    its own. GPU ranks are never pinned: NCCL's proxy, the watchdog and autograd's device
    thread would share that one core."""
    if backend not in BACKEND_DEVICE:
        raise SystemExit(f"--backend must be one of {', '.join(BACKEND_DEVICE)}, got {backend!r}")
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    on_gpu = backend == "nccl" or (backend == "auto" and torch.cuda.is_available())
    if pin and not on_gpu:  # before the process group: its threads inherit the core
        pin_to_core()
    return init_distributed(BACKEND_DEVICE[backend])


def ranks_phrase(world: int, device: torch.device) -> str:
    """How the ranks of a measurement ran, for its report."""
    if device.type == "cuda":
        return f"{world} nccl ranks, one {torch.cuda.get_device_name(device)} each"
    return f"{world} gloo ranks pinned to a core each, {torch.get_num_threads()} thread(s)"


def timing_strategy(device: torch.device) -> str:
    """On CUDA a collective returns once enqueued: synchronise around what is timed (or use
    CUDA events); on CPU the host clock sees the work itself."""
    return "cuda-sync" if device.type == "cuda" else "host-clock"


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn, device: torch.device) -> float:
    """Seconds that fn's work takes on `device` (synchronised on CUDA)."""
    sync(device)
    t0 = time.perf_counter()
    fn()
    sync(device)
    return time.perf_counter() - t0


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


class PhaseClock:
    """Phase boundaries on the device's own clock: host time on CPU; on CUDA an event per
    boundary (the host only enqueued the work), put on the host clock from the start."""

    def __init__(self, device: torch.device):
        self.cuda, self.t0 = device.type == "cuda", time.perf_counter()
        self.marks = [(None, self._now())]

    def _now(self):
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def mark(self, name: str) -> None:
        self.marks.append((name, self._now()))

    def spans(self) -> list[tuple[str, float, float]]:
        times = [t for _, t in self.marks]
        if self.cuda:
            torch.cuda.synchronize()
            times = [self.t0 + times[0].elapsed_time(e) / 1e3 for e in times]
        return [(name, a, z) for (name, _), a, z in zip(self.marks[1:], times, times[1:])]


def pyplot():
    """matplotlib without a display."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt
