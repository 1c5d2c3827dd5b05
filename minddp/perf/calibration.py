"""What `minddp calibrate` measures beyond alpha and beta, and the fits it makes.

The workload is given as `make()`: a fresh (model, token batch), seeded alike on every rank
(the tools pass make scaling's GPT: what backward runs beside the communication decides it).

- alpha and beta per collective from the sweep's rows (sweep.fit_alpha_beta); the engine's own
  ZeRO-1 collectives (zero1_*) stand for reduce-scatter and all-gather;
- contention: a bucket-sized all-reduce alone and launched under backward, less the floor;
- the completion floor: the engine at world 1, busy time per bucket launched under backward;
- the under-backward slowdown and delay: a grid search for the pair with which
  `costmodel.simulate_buckets` gives the busy times the engine showed at several caps;
- repeats combined: the median of each figure, or the middle one of a measurement whose parts
  belong together.
"""

from __future__ import annotations

import json
import math
import statistics
import time

import torch
import torch.distributed as dist

from ..engine.ddp import DistributedDataParallel
from .clock import PhaseClock, after_warmup, timed
from .costmodel import BUCKET_OPS, simulate_buckets
from .engine_cost import per_bucket_cost
from .sweep import fit_alpha_beta
from .workload import lm_loss

# caps the under-backward fit runs the engine at: other bucket layouts than make scaling's caps
# (1, 5, 25, 100 MB) give, so its predictions there are out of sample
UNDER_CAPS = (3.0, 8.0, 12.0, 16.0)


def fit_ops(rows: list[dict], n: int) -> tuple[float, float, dict]:
    """(alpha, beta) of the all-reduce, and {op: {"alpha", "beta"}} of every other op swept."""
    alpha, beta = fit_alpha_beta([r for r in rows if r["op"] == "all_reduce"], n)
    ops = {}
    for op in sorted({r["op"] for r in rows} - {"all_reduce"}):
        a, b = fit_alpha_beta([r for r in rows if r["op"] == op], n)
        ops[op] = {"alpha": a, "beta": b}
    for op in [op for op in ops if op.startswith("zero1_")]:
        ops[op.removeprefix("zero1_")] = ops[op]  # what the cost model's reduce-scatter means here
    return alpha, beta, ops


# slowdown x1.05^k (x1 to x17) and delay d * 0.25 ms (0 to 20 ms)
GRID = [(1.05 ** k, d * 2.5e-4) for k in range(60) for d in range(80)]


def fit_under_backward(points: list[dict], alone: tuple[float, float], op: str,
                       n: int) -> tuple[float, float]:
    """(slowdown, delay_s) on GRID whose simulated busy times are closest, in log ratio, to the
    measured `points` ({"bucket_bytes", "backward_s", "busy_s"} per cap), each bucket's work
    being the `alone` (alpha, beta) fit's time for `op`."""
    cost = BUCKET_OPS[op]

    def error(guess: tuple[float, float]) -> float:
        total = 0.0
        for p in points:
            work = [cost(b, n, *alone) for b in p["bucket_bytes"]]
            busy = simulate_buckets(p["bucket_bytes"], work, p["backward_s"], *guess)[0]
            total += math.log(busy / p["busy_s"]) ** 2
        return total

    return min(GRID, key=error)


def contention_factor(device, make, floor_s: float = 0.0, nbytes: int = 4 * 2**20, reps: int = 6) -> dict:
    """A bucket-sized all-reduce timed alone, and launched under the workload's backward (what
    the engine's buckets share the cores with: every rank computing at once, memory traffic
    included), to its completion callback as the engine notices it. Less the completion floor
    (`floor_s`, counted apart), the ratio says how much backward slows communication here."""
    model, x = make()
    buf = torch.ones(nbytes // 4, device=device)
    alone, busy = [], []
    for _ in range(reps):
        alone.append(timed(lambda: dist.all_reduce(buf), device))
        loss = lm_loss(model, x)
        dist.barrier()
        done = []  # the host clock on purpose: when the host learns of completion is what this measures
        t0 = time.perf_counter()
        work = dist.all_reduce(buf, async_op=True)
        work.get_future().then(lambda f, done=done: done.append(time.perf_counter()))
        loss.backward()  # far longer than the all-reduce: it runs entirely under backward
        work.wait()
        model.zero_grad(set_to_none=True)
        busy.append((done[0] if done else time.perf_counter()) - t0)
    t = torch.tensor([statistics.median(alone), statistics.median(busy)], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return {"bytes": nbytes, "alone_s": t[0].item(), "under_backward_s": t[1].item(),
            "floor_s": floor_s, "factor": max(1.0, (t[1].item() - floor_s) / t[0].item())}


def completion_floor(device, make, cap_mb: float = 1.0, reps: int = 4) -> dict:
    """The per-bucket completion floor at world 1: each rank runs the engine alone in a group of
    one (all ranks at once, as they share the cores at world 2), so nothing crosses a wire, and
    the busy time per bucket launched under backward is what noticing completions costs (a
    callback that needs the GIL backward holds). The last bucket is launched when backward
    ends and is noticed at once: it is not counted."""
    groups = [dist.new_group([r]) for r in range(dist.get_world_size())]  # every rank makes each
    model, x = make()
    ddp = DistributedDataParallel(model, process_group=groups[dist.get_rank()], bucket_cap_mb=cap_mb)

    def step():
        lm_loss(ddp, x).backward()
        s = ddp.comm_stats
        ddp.zero_grad(set_to_none=True)
        return s.num_collectives, s.busy_s / max(1, s.num_collectives - 1)

    per = after_warmup(step, reps)  # (buckets, busy per bucket launched under backward)
    t = torch.tensor([statistics.median([p for n, p in per if n > 1] or [0.0])], dtype=torch.float64,
                     device=device)
    dist.all_reduce(t, op=dist.ReduceOp.AVG)
    return {"per_bucket_s": t.item(), "buckets": per[-1][0], "cap_mb": cap_mb}


def engine_points(device, make, op: str, caps, reps: int) -> list[dict]:
    """The engine at each cap (ZeRO-1's reduce-scatters for op="reduce_scatter"): its buckets and
    the medians of busy time, backward (less the exposed wait) and forward, averaged over ranks."""
    points = []
    for cap in caps:
        model, x = make()
        ddp = DistributedDataParallel(model, bucket_cap_mb=cap, shard_optimizer=op == "reduce_scatter")

        def step(ddp=ddp, x=x):
            clock = PhaseClock(device)
            loss = lm_loss(ddp, x)
            clock.mark("forward")
            loss.backward()
            clock.mark("backward")
            (_, f0, f1), (_, _, b1) = clock.spans()
            s = ddp.comm_stats
            # zeroed in place: backward accumulates into the bucket views, as the synchronised
            # micro-step does in training (set to None, each gradient would be copied in)
            ddp.zero_grad(set_to_none=False)
            return s.busy_s, b1 - f1 - s.exposed_wait_s, f1 - f0

        runs = after_warmup(step, reps)  # (busy, backward, forward) per step
        t = torch.tensor([statistics.median(v) for v in zip(*runs)], dtype=torch.float64, device=device)
        dist.all_reduce(t, op=dist.ReduceOp.AVG)
        points.append({"cap_mb": cap, "bucket_bytes": [b.grad_nbytes for b in ddp.layout.buckets],
                       "busy_s": t[0].item(), "backward_s": t[1].item(), "forward_s": t[2].item()})
    return points


def under_backward_fit(device, make, alone: tuple[float, float], op: str, caps, reps: int = 10) -> dict:
    """How much slower a bucket's collective progresses while backward runs beside it, fitted
    from the engine itself at this world size: the slowdown for which `simulate_buckets` (the
    alone (alpha, beta) fit, buckets in order, slowed until backward ends) gives the busy times
    measured at `caps`. It takes in all that makes a bucket wait under backward here: cores
    shared with compute, the completion callback, the ranks' skew. Also measured: backward's
    share of forward + backward."""
    points = engine_points(device, make, op, caps, reps)
    slowdown, delay = fit_under_backward(points, alone, op, dist.get_world_size())
    share = statistics.median(p["backward_s"] / (p["backward_s"] + p["forward_s"]) for p in points)
    return {"slowdown": slowdown, "delay_s": delay, "backward_share": share, "points": points}


def measure(rows, device, make, make_small, caps, floor: dict | None = None, under: dict | None = None,
            about: dict | None = None) -> dict:
    """One calibration: the fits of the sweep's `rows`, the engine's cost per bucket (on
    `make_small`'s model), the completion floor, contention and the under-backward fits (on
    `make`'s). `floor`, `under`: completion_floor's and under_backward_fit's keywords; `about`
    (the workload's description) goes into each measurement's record."""
    n, about = dist.get_world_size(), about or {}
    alpha, beta, ops = fit_ops(rows, n)
    cal = {"world_size": n, "backend": dist.get_backend(), "alpha": alpha, "beta": beta, "ops": ops,
           "overhead_per_bucket_s": max(0.0, per_bucket_cost(*make_small(), lm_loss, reps=10)["minddp"][0]),
           "floor": {**completion_floor(device, make, **(floor or {})), **about}}
    cal["contention"] = {**contention_factor(device, make, cal["floor"]["per_bucket_s"]), **about}
    if n > 1:  # the engine's own collectives under backward (ZeRO-1's where its fit was measured)
        fits = {"all_reduce": (alpha, beta), **{op: (ops[op]["alpha"], ops[op]["beta"])
                                                for op in ("reduce_scatter",) if op in ops}}
        kw = {"caps": caps, **(under or {})}
        cal["under_backward"] = {op: {**under_backward_fit(device, make, ab, op, **kw), **about}
                                 for op, ab in fits.items()}
    return cal


def combine(runs: list[dict]) -> dict:
    """One calibration from repeated ones: the median alpha, beta and engine cost; per op the
    median fit; the floor, contention and each under-backward fit the middle measurement."""
    cal = {**runs[0], "repeats": len(runs), "alpha": _median(runs, "alpha"), "beta": _median(runs, "beta"),
           "overhead_per_bucket_s": _median(runs, "overhead_per_bucket_s")}
    cal["ops"] = {op: {k: _median([r["ops"][op] for r in runs], k) for k in ("alpha", "beta")}
                  for op in runs[0]["ops"]}
    cal["floor"] = _middle([r["floor"] for r in runs], "per_bucket_s")
    cal["contention"] = _middle([r["contention"] for r in runs], "factor")
    if "under_backward" in cal:
        cal["under_backward"] = {op: _middle([r["under_backward"][op] for r in runs], "slowdown")
                                 for op in runs[0]["under_backward"]}
    return cal


def _median(dicts: list[dict], key: str) -> float:
    return statistics.median(d[key] for d in dicts)


def _middle(dicts: list[dict], key: str) -> dict:
    """The measurement whose `key` is the median (the lower middle one of an even count)."""
    return sorted(dicts, key=lambda d: d[key])[(len(dicts) - 1) // 2]


def write(path, sweeps: list[list[dict]], device, make, make_small, floor: dict | None = None,
          under: dict | None = None, about: dict | None = None) -> dict:
    """One calibration per sweep's rows (`measure`, at UNDER_CAPS unless `under` says), combined
    (the medians over the repeats), written as JSON by rank 0; every rank returns it."""
    cal = combine([measure(rows, device, make, make_small, UNDER_CAPS, floor, under, about)
                   for rows in sweeps])
    if dist.get_rank() == 0:
        with open(path, "w") as f:
            json.dump(cal, f, indent=1)
    return cal
