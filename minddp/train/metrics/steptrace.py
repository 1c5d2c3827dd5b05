"""The runtime half of the overlap timeline: record one step on this rank.

The trainer (`train.trace_step=N`) and `minddp timeline` use it; `write` exports the
gathered trace as Chrome/Perfetto JSON and a PNG. Why not torch.profiler's export (which
`train.profile_steps` gives, per rank): this trace is the engine's own bucket launch/done and
end-of-backward marks from every rank on one clock, with the exposed wait cut out of backward,
drawn as one figure; a profiler trace holds ops per rank, not the reducer's moments.
"""

from __future__ import annotations

import json
import time
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.distributed as dist

from ...io.atomic import atomic_write
from ...perf.plot import pyplot


class StepTrace:
    """Collects one step on this rank: compute spans (marked by the caller) and the
    engine's bucket events (ddp.trace), with times relative to start()."""

    def __init__(self, ddp):
        self.ddp, self.spans = ddp, []
        self.t0 = None

    def start(self) -> "StepTrace":
        self.ddp.trace = []
        self.t0 = time.perf_counter()
        return self

    def now(self) -> float:
        """The host clock once the device has finished what was queued (a CUDA host only
        enqueues: a traced step synchronises, so its spans are the work, not its launch)."""
        if self.ddp.device.type == "cuda":
            torch.cuda.synchronize(self.ddp.device)
        return time.perf_counter()

    @contextmanager
    def phase(self, name: str):
        """A compute span around the block (`with trace.phase("forward 0"): ...`)."""
        start = self.now()
        yield
        self.span(name, start, self.now())

    def span(self, name: str, start: float, end: float) -> None:
        self.spans.append((name, start - self.t0, end - self.t0))

    def stop(self) -> dict:
        events, self.ddp.trace = self.ddp.trace, None
        launch = {b: t - self.t0 for e, b, t in events if e == "launch"}
        done = {b: t - self.t0 for e, b, t in events if e == "done"}
        marks = {e: t - self.t0 for e, b, t in events if b is None}
        comm = [(f"bucket {b}", launch[b], done.get(b, launch[b])) for b in sorted(launch)]
        gathers, exposed = _gathers([(e, b, t - self.t0) for e, b, t in events])
        comm += gathers
        self.spans += exposed
        if "backward_end" in marks and "wait_end" in marks:
            # backward() returns after the engine's end-of-backward wait: split the span
            end = marks["backward_end"]
            self.spans = [(n, s, min(e, end) if n == "backward" and s <= end <= e else e)
                          for n, s, e in self.spans]
            self.spans.append(("exposed wait", end, marks["wait_end"]))
        return {"compute": self.spans, "comm": comm}


def profiler(profile_steps, start: int, run_dir: str, info):
    """train.profile_steps=[a,b]: a torch.profiler trace of steps a..b on every rank, in
    <run dir>/profile/ (TensorBoard's trace handler: open with TensorBoard or Perfetto); None
    when not asked for."""
    if not profile_steps:
        return None
    first, last = profile_steps
    activities = [torch.profiler.ProfilerActivity.CPU]
    if info.device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    prof = torch.profiler.profile(
        activities=activities, record_shapes=True,
        schedule=torch.profiler.schedule(skip_first=max(0, first - 1 - start), wait=0, warmup=0,
                                         active=last - first + 1, repeat=1),
        on_trace_ready=torch.profiler.tensorboard_trace_handler(f"{run_dir}/profile",
                                                                worker_name=f"rank{info.rank}"))
    prof.start()
    return prof


def _gathers(events: list[tuple]) -> tuple[list, list]:
    """ZeRO-1's all-gathers (minddp.optim.zero), launched by a step and waited for by the next
    forward: (comm bars from launch to done, compute spans the forward spent waiting). A
    gather launched before the trace started starts at 0; one still running ends at the
    last event."""
    start, bars, exposed, waiting = {}, [], [], {}
    end = max((t for _, _, t in events), default=0.0)
    for e, b, t in events:
        if e == "gather_launch":
            start[b] = t
        elif e == "gather_wait":  # noted when the wait returned, its done right after
            waiting[b] = t
        elif e == "gather_done":
            bars.append((f"all-gather {b}", start.pop(b, 0.0), t))
            if b in waiting:
                exposed.append(("exposed all-gather", waiting.pop(b), t))
    bars += [(f"all-gather {b}", t, end) for b, t in start.items()]
    return sorted(bars, key=lambda x: x[1]), exposed


def gather(trace: dict) -> list[dict]:
    """Every rank's trace, on every rank (a collective)."""
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, trace)
    return out


def chrome_trace(per_rank: list[dict], label: str = "") -> list[dict]:
    ev = []
    for rank, tr in enumerate(per_rank):
        for lane in ("compute", "comm"):
            for name, s, e in tr[lane]:
                ev.append({"name": name, "ph": "X", "pid": f"rank {rank}", "tid": f"{label}{lane}",
                           "ts": s * 1e6, "dur": max(e - s, 0) * 1e6})
    return ev


def render(traces: dict[str, list[dict]], png: str) -> None:
    """One panel per label (e.g. overlap on / off); per rank a compute and a comm lane."""
    plt = pyplot()
    colors = {"forward": "#4C72B0", "backward": "#55A868", "optimizer": "#8172B2",
              "exposed wait": "#C44E52", "exposed all-gather": "#937860"}
    fig, axes = plt.subplots(len(traces), 1, figsize=(11, 1.6 + 1.3 * len(next(iter(traces.values())))
                                                            * len(traces)), squeeze=False)
    for ax, (label, per_rank) in zip(axes[:, 0], traces.items()):
        ticks, names = [], []
        for rank, tr in enumerate(per_rank):
            y = rank * 3
            for name, s, e in tr["compute"]:
                kind = name if name.startswith("exposed") else name.split()[0]
                ax.barh(y + 1, (e - s) * 1e3, left=s * 1e3, height=0.8, color=colors.get(kind, "#999"),
                        edgecolor="white", linewidth=0.5)
            for i, (_name, s, e) in enumerate(tr["comm"]):
                ax.barh(y, (e - s) * 1e3, left=s * 1e3, height=0.8, color="#DD8452" if i % 2 else "#E6A157",
                        edgecolor="#805020", linewidth=0.5)
            ticks += [y, y + 1]
            names += [f"rank {rank} comm", f"rank {rank} compute"]
        ax.set_yticks(ticks, names)
        ax.set_title(label)
        ax.set_xlabel("ms since the step started")
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in list(colors.values()) + ["#DD8452"]]
    fig.legend(handles, list(colors) + ["collective (bucket, all-gather)"], loc="upper right", ncol=6,
               fontsize=8)
    fig.tight_layout(rect=(0, 0, 1, 0.95))
    fig.savefig(png, dpi=110)
    plt.close(fig)


def write(traces: dict[str, list[dict]], out_prefix: str) -> tuple[str, str]:
    Path(out_prefix).parent.mkdir(parents=True, exist_ok=True)
    events = [e for label, per_rank in traces.items() for e in chrome_trace(per_rank, f"{label}: ")]
    atomic_write(out_prefix + ".json", json.dumps({"traceEvents": events, "displayTimeUnit": "ms"}))
    render(traces, out_prefix + ".png")
    return out_prefix + ".json", out_prefix + ".png"
