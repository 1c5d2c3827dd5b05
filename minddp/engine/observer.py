"""What the engine reports about its communication, kept out of its core path.

The reducer (minddp.engine.reducer) tells an observer what happens and does not know what it
records; the observer only listens (it never wraps or replaces what the reducer waits on):

    layout_changed(n)         the buckets were (re)built: n buckets
    start(n)                  a synchronised forward begins a new iteration
    launch(b, nbytes, kind)   bucket b's reduction is about to start
    launched(b, started)      ... and has started (`Started`: its future, and the backend's Work
                              or None); the observer may add a done-callback to the future
    poll()                    a gradient arrived (a cheap moment to notice completions)
    backward_end(k)           autograd finished (k buckets were launched during it); the
                              reducer now launches the rest and waits
    done(b)                   the reducer's wait for bucket b returned
    wait_end(wire_bytes)      every bucket is reduced
    read()                    `ddp.comm_stats` was read

A bucket's completion is noted once: by the future's callback (on the thread that completed it:
the exact time) or by `done(b)`, whichever comes first (a future's waiters can wake before its
callbacks have run), so a late callback of one iteration never marks the next.

`Observer` keeps `CommStats` (host clock), the optional trace (`ddp.trace = []` records
(event, bucket, time) tuples: see minddp.train.metrics.steptrace) and torch.profiler ranges.
`CudaObserver` times the work itself with CUDA events: on nccl a collective's future
completes when it is enqueued, so a host clock would read ~0 (events are read lazily,
when `comm_stats` is read: no host sync per step).
"""

from __future__ import annotations

import collections
import functools
import threading
import time
from dataclasses import dataclass, field

import torch

from .. import _compat


@dataclass
class CommStats:
    """Communication of the last synchronised iteration.

    num_collectives counts the gradient-bucket reductions (one per bucket); the
    one-off broadcast of the rebuilt bucket plan after the first iteration is
    not included. comm_time_s runs from the first bucket launch to the last
    completion (under overlap it spans most of backward); busy_s is the time at least
    one bucket was in flight (the union of launch-to-completion intervals), the number
    to compare with a cost model; exposed_wait_s is how long the end-of-backward callback blocked
    waiting for communication (the part overlap did not hide).
    """

    num_buckets: int = 0
    num_collectives: int = 0
    bytes: int = 0  # on the wire: 16-bit sizes under compress=fp16/bf16
    comm_time_s: float = 0.0
    busy_s: float = 0.0
    exposed_wait_s: float = 0.0
    launched_in_backward: int = 0
    launch_order: list[int] = field(default_factory=list)
    overlap: bool = True


def clock_for(device_type: str, backend: str) -> str:
    """How a bucket's communication is timed (pure): "cuda-events" where the backend runs the
    collective as CUDA work whose future carries its CUDA events (nccl), else "host" (gloo, also with
    CUDA tensors: its futures carry no CUDA event, so an end event would wait on nothing and could
    precede its start event on a busy compute stream; its collectives complete on the host)."""
    return "cuda-events" if device_type == "cuda" and "nccl" in backend else "host"


class _Once:
    """Which buckets' completion was noted in one iteration: the first of the future's callback
    and the reducer's `done(b)` notes it (they can run on two threads at once)."""

    def __init__(self, num_buckets: int):
        self._noted = [False] * num_buckets
        self._lock = threading.Lock()

    def claim(self, b: int) -> bool:
        with self._lock:
            first, self._noted[b] = not self._noted[b], True
            return first


def observer_for(device: torch.device, overlap: bool, group=None) -> "Observer":
    import torch.distributed as dist

    backend = str(dist.get_backend(group)) if dist.is_initialized() else ""
    if clock_for(device.type, backend) == "cuda-events":
        return CudaObserver(device, overlap)
    return Observer(overlap)


class Observer:
    """CommStats from the host clock, the trace, and profiler ranges."""

    def __init__(self, overlap: bool = True):
        self.overlap = overlap
        self.trace: list | None = None  # set to a list to record (event, bucket, time) tuples
        self.stats = CommStats(overlap=overlap)
        self._range = self._wait_range = None
        # the current iteration's (start() renews them)
        self._t_launch: list[float | None] = []
        self._t_done: list[float | None] = []
        self._once = _Once(0)
        self._inflight: collections.deque[tuple[int, object]] = collections.deque()  # (bucket, Work)
        self._t_first_launch = self._t_last_done = self._t_wait = None

    def layout_changed(self, num_buckets: int) -> None:
        self.stats.num_buckets = num_buckets

    def start(self, num_buckets: int) -> None:
        self.stats = CommStats(num_buckets=num_buckets, overlap=self.overlap)
        self._t_launch = [None] * num_buckets
        self._t_done = [None] * num_buckets
        self._once = _Once(num_buckets)
        self._inflight = collections.deque()
        self._t_first_launch = self._t_last_done = None

    def launch(self, b: int, nbytes: int, kind: str) -> None:
        now = time.perf_counter()
        if self._t_first_launch is None:
            self._t_first_launch = now
        self._t_launch[b] = now
        self.note("launch", b, now)
        if _compat.profiler_enabled():  # a named range in torch.profiler traces
            self._range = torch.profiler.record_function(f"minddp: bucket {b} {kind} ({nbytes} B)")
            self._range.__enter__()

    def launched(self, b: int, started) -> None:
        self._end_range()
        self.stats.launch_order.append(b)
        future = started.future
        if isinstance(future, torch.futures.Future):
            # the completion time, exactly (busy_s): a callback on the thread that completes it
            future.add_done_callback(functools.partial(self._on_done, self._once, self._t_done, b))
        else:  # a collective's own future or a Work without one (gloo's reduce-scatter): polled
            self._inflight.append((b, future))

    def poll(self) -> None:
        """Note the completion time of launched buckets that have finished (in launch order)."""
        while self._inflight and self._inflight[0][1].done():
            b = self._inflight.popleft()[0]
            if self._once.claim(b):
                self._mark_done(self._t_done, b)

    def _end_range(self) -> None:
        if self._range is not None:
            self._range, r = None, self._range
            r.__exit__(None, None, None)

    def _on_done(self, once: _Once, t_done: list, b: int, fut) -> None:
        if once.claim(b):  # (its iteration's marks: a callback never marks a later iteration)
            self._mark_done(t_done, b)

    def _mark_done(self, t_done: list, b: int) -> None:
        self._t_last_done = t_done[b] = time.perf_counter()
        self.note("done", b, t_done[b])

    def note(self, event: str, b, t: float) -> None:
        if self.trace is not None:
            self.trace.append((event, b, t))

    def backward_end(self, launched_in_backward: int) -> None:
        self.stats.launched_in_backward = launched_in_backward
        self._t_wait = time.perf_counter()
        if self.trace is not None:
            self.trace.append(("backward_end", None, self._t_wait))
        if _compat.profiler_enabled():
            self._wait_range = torch.profiler.record_function("minddp: wait for buckets")
            self._wait_range.__enter__()

    def done(self, b: int) -> None:
        if self._inflight and self._inflight[0][0] == b:  # not seen finished by a poll: now
            self._inflight.popleft()
        if self._once.claim(b):  # no poll or callback noted it yet
            self._mark_done(self._t_done, b)

    def wait_end(self, wire_bytes: int) -> None:
        if self._wait_range is not None:
            self._wait_range, r = None, self._wait_range
            r.__exit__(None, None, None)
        done = time.perf_counter()
        if self.trace is not None:
            self.trace.append(("wait_end", None, done))
        s = self.stats
        s.exposed_wait_s = done - self._t_wait
        s.comm_time_s = (self._t_last_done or done) - self._t_first_launch
        s.busy_s = _union_length([(t, d or done) for t, d in zip(self._t_launch, self._t_done)])
        s.num_collectives = s.num_buckets
        s.bytes = wire_bytes

    def read(self) -> CommStats:
        return self.stats


class CudaObserver(Observer):
    """Per-bucket CUDA events time the collectives themselves, never blocking the host: a
    bucket's end event is recorded on a timing stream made to wait for the collective's own end
    event (`Work.wait()` only orders streams on NCCL, and unlike a future's wait() it does not
    record the bucket or its 16-bit copy on the timing stream, which would delay their reuse).
    A hook's future without a Work is waited on the same way; a worker thread's future records
    the end when it completes, on that thread. No completion is read from the host: an NCCL Work
    reads done at enqueue, which would draw zero-width bars."""

    def __init__(self, device: torch.device, overlap: bool = True):
        super().__init__(overlap)
        self.device = device
        self._stream = torch.cuda.Stream(device)
        self._events: list[tuple] = []
        self._marks: dict | None = None
        self._anchor: tuple | None = None  # a traced step: (an event, the host time it was recorded)

    def start(self, num_buckets: int) -> None:
        super().start(num_buckets)
        while len(self._events) < num_buckets:
            self._events.append((torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)))
        self._marks = None
        if self.trace is not None:  # a traced step: GPU times on the host clock, from an idle GPU
            torch.cuda.synchronize(self.device)
            self._anchor = (torch.cuda.Event(enable_timing=True), time.perf_counter())
            self._anchor[0].record()

    def launch(self, b: int, nbytes: int, kind: str) -> None:
        super().launch(b, nbytes, kind)
        self._events[b][0].record()  # on the compute stream: the bucket is handed to the backend here

    def launched(self, b: int, started) -> None:
        self._end_range()
        self.stats.launch_order.append(b)
        future = started.future
        if started.work is not None:  # the collective's own end event orders the timing stream
            self._record_end(self._once, b, started.work)
        elif isinstance(future, torch.futures.Future) and not future.done():  # a worker thread's:
            future.add_done_callback(functools.partial(self._record_end, self._once, b))  # when it ends
        else:
            self._record_end(self._once, b, future)

    def _record_end(self, once: _Once, b: int, future) -> None:
        """`future`: a Work, a Works (ZeRO's reduce-scatter) or a future."""
        if not once.claim(b):  # the reducer's done(b) came first
            return
        with torch.cuda.device(self.device), torch.cuda.stream(self._stream):
            future.wait()  # the timing stream waits for the collective, the host does not
            self._events[b][1].record()

    def poll(self) -> None:
        pass  # completion times come from the events

    def done(self, b: int) -> None:
        if self._once.claim(b):  # a callback that has not run yet: the compute stream waited for it
            self._events[b][1].record()

    def note(self, event: str, b, t: float) -> None:
        if event not in ("launch", "done"):  # those come from the events (wait_end)
            super().note(event, b, t)

    def backward_end(self, launched_in_backward: int) -> None:
        super().backward_end(launched_in_backward)
        self._marks = {k: torch.cuda.Event(enable_timing=True) for k in ("backward_end", "wait_end")}
        self._marks["backward_end"].record()

    def wait_end(self, wire_bytes: int) -> None:
        super().wait_end(wire_bytes)
        self._marks["wait_end"].record()  # after the compute stream waited for every bucket
        if self.trace is not None:
            self._trace_from_events()

    def _trace_from_events(self) -> None:
        """The traced step's launch and done times, from the events (a traced step may sync)."""
        torch.cuda.synchronize(self.device)
        ref, t0 = self._anchor
        for b, (a, z) in enumerate(self._events[: self.stats.num_buckets]):
            self.trace.append(("launch", b, t0 + ref.elapsed_time(a) / 1e3))
            self.trace.append(("done", b, t0 + ref.elapsed_time(z) / 1e3))

    def read(self) -> CommStats:
        """CUDA events resolved on the first read after an iteration."""
        if self._marks is not None:
            marks, self._marks = self._marks, None
            marks["wait_end"].synchronize()
            ref = self._events[0][0]
            sec = lambda ev: ref.elapsed_time(ev) / 1e3  # noqa: E731 - seconds since the first launch
            spans = [(sec(a), sec(z)) for a, z in self._events[: self.stats.num_buckets]]
            s = self.stats
            s.busy_s = _union_length(spans)
            s.comm_time_s = max(e for _, e in spans) - min(b for b, _ in spans)
            s.exposed_wait_s = max(0.0, sec(marks["wait_end"]) - sec(marks["backward_end"]))
        return self.stats


def _union_length(intervals: list[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for s, e in sorted(intervals):
        if e > end:
            total += e - max(s, end)
            end = e
    return total
