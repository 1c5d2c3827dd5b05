"""The runtime half of the overlap timeline: record one step on this rank.

The trainer (`train.trace_step=N`) and `python -m minddp.timeline` use it; plotting and
the Chrome/Perfetto export live in minddp.timeline.
"""

from __future__ import annotations

import time

import torch.distributed as dist


class StepTrace:
    """Collects one step on this rank: compute spans (marked by the caller) and the
    engine's bucket events (ddp.trace), with times relative to start()."""

    def __init__(self, ddp):
        self.ddp, self.spans = ddp, []
        self.t0 = None

    def start(self) -> None:
        self.ddp.trace = []
        self.t0 = time.perf_counter()

    def span(self, name: str, start: float, end: float) -> None:
        self.spans.append((name, start - self.t0, end - self.t0))

    def stop(self) -> dict:
        events, self.ddp.trace = self.ddp.trace, None
        launch = {b: t - self.t0 for e, b, t in events if e == "launch"}
        done = {b: t - self.t0 for e, b, t in events if e == "done"}
        marks = {e: t - self.t0 for e, b, t in events if b is None}
        comm = [(f"bucket {b}", launch[b], done.get(b, launch[b])) for b in sorted(launch)]
        if "backward_end" in marks and "wait_end" in marks:
            # backward() returns after the engine's end-of-backward wait: split the span
            end = marks["backward_end"]
            self.spans = [(n, s, min(e, end) if n == "backward" and s <= end <= e else e)
                          for n, s, e in self.spans]
            self.spans.append(("exposed wait", end, marks["wait_end"]))
        return {"compute": self.spans, "comm": comm}


def gather(trace: dict) -> list[dict]:
    """Every rank's trace, on every rank (a collective)."""
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, trace)
    return out
