"""`minddp calibrate`: what the DDP cost model needs beyond alpha and beta, measured on this
machine and written as JSON for `minddp costmodel --calibration` and `minddp scaling`.

    torchrun --standalone --nproc_per_node=2 -m minddp calibrate --out docs/calibration.json

- alpha and beta: the collective sweep of `minddp bench` (its nccl-tests-style rows), fitted
  per op; the engine's own ZeRO-1 collectives (zero1_*) stand for reduce-scatter/all-gather;
- contention: a 4 MB all-reduce timed alone and launched under the backward of make scaling's
  GPT (every rank computing, as during training), less the completion floor; where
  communication shares cores with compute, the ratio is > 1;
- the engine's CPU cost per bucket (launch, hooks, wait), with communication stubbed out;
- the per-bucket completion floor: the engine at world 1 (each rank in a group of one) on
  make scaling's GPT, busy time per bucket launched under backward (`completion_floor`);
- under backward: the slowdown and delay for which the cost model's bucket simulation gives the
  busy times the engine shows at other caps than make scaling's (`under_backward_fit`).
With --repeats everything is measured that often and each figure is the median.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.distributed as dist

from ..ddp import DistributedDataParallel
from ..perf.calibration import combine, fit_ops, fit_under_backward
from ..perf.clock import PhaseClock, after_warmup, timed
from ..perf.engine_cost import per_bucket_cost
from ..perf.sweep import run_op, sweep_sizes
from .cli import parse_size, start
from .workload import GPT_PRESETS, STUDY, STUDY_BATCH, build, lm_loss

# make scaling's GPT and its micro-batch (train.micro_batch_size=2): the floor and the contention
# depend on what backward runs beside the communication
FLOOR_MODEL, FLOOR_BATCH = GPT_PRESETS[STUDY], STUDY_BATCH[1]


def contention_factor(device, floor_s: float = 0.0, model_cfg=None, batch: int = FLOOR_BATCH,
                      nbytes: int = 4 * 2**20, reps: int = 6) -> dict:
    """A bucket-sized all-reduce timed alone, and launched under the backward of make scaling's
    GPT (what the engine's buckets share the cores with: every rank computing at once, memory
    traffic included), to its completion callback as the engine notices it. Less the
    completion floor (`floor_s`, counted apart), the ratio says how much backward slows
    communication on these cores."""
    model, x = build(model_cfg or FLOOR_MODEL, device, batch)
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
    return {"bytes": nbytes, "batch": batch, "alone_s": t[0].item(), "under_backward_s": t[1].item(),
            "floor_s": floor_s, "factor": max(1.0, (t[1].item() - floor_s) / t[0].item())}


def engine_overhead_per_bucket(device) -> float:
    """Seconds of the engine's own CPU work per bucket, communication stubbed out."""
    base, x = build(GPT_PRESETS["gpt-small"], device, batch=4)
    return max(0.0, per_bucket_cost(base, x, lm_loss, reps=10)["minddp"][0])


def completion_floor(device, model_cfg=None, batch: int = FLOOR_BATCH, cap_mb: float = 1.0,
                     reps: int = 4) -> dict:
    """The per-bucket completion floor at world 1: each rank runs the engine alone in a group of
    one (all ranks at once, as they share the cores at world 2), so nothing crosses a wire, and
    the busy time per bucket launched under backward is what noticing completions costs (a
    callback that needs the GIL backward holds). The last bucket is launched when backward
    ends and is noticed at once: it is not counted."""

    cfg = model_cfg or FLOOR_MODEL
    groups = [dist.new_group([r]) for r in range(dist.get_world_size())]  # every rank makes each
    model, x = build(cfg, device, batch)
    ddp = DistributedDataParallel(model, process_group=groups[dist.get_rank()], bucket_cap_mb=cap_mb)

    def step():
        lm_loss(ddp, x).backward()
        s = ddp.comm_stats
        ddp.zero_grad(set_to_none=True)
        return s.num_collectives, s.busy_s / max(1, s.num_collectives - 1)

    per = after_warmup(step, reps)  # (buckets, busy per bucket launched under backward)
    buckets = per[-1][0]
    per = [p for n, p in per if n > 1]
    t = torch.tensor([statistics.median(per) if per else 0.0], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.AVG)
    return {"per_bucket_s": t.item(), "buckets": buckets, "cap_mb": cap_mb, "batch": batch, "model": cfg}


# caps the under-backward fit runs the engine at: other bucket layouts than make scaling's caps
# (1, 5, 25, 100 MB) give, so its predictions there are out of sample
UNDER_CAPS = (3.0, 8.0, 12.0, 16.0)


def under_backward_fit(device, alone: tuple[float, float], op: str = "all_reduce", caps=UNDER_CAPS,
                       model_cfg=None, batch: int = FLOOR_BATCH, reps: int = 10) -> dict:
    """How much slower a bucket's collective progresses while backward runs beside it, fitted
    from the engine itself at this world size on make scaling's GPT: the slowdown for which
    `costmodel.simulate_buckets` (the alone (alpha, beta) fit, buckets in order, slowed until
    backward ends) gives the busy times measured at `caps`. It takes in all that makes a
    bucket wait under backward here: cores shared with compute, the completion callback,
    the ranks' skew. Also measured: backward's share of forward + backward."""
    cfg, n = model_cfg or FLOOR_MODEL, dist.get_world_size()
    points = []
    for cap in caps:
        model, x = build(cfg, device, batch)
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
    slowdown, delay = fit_under_backward(points, alone, op, n)
    share = statistics.median(p["backward_s"] / (p["backward_s"] + p["forward_s"]) for p in points)
    return {"slowdown": slowdown, "delay_s": delay, "backward_share": share, "batch": batch, "points": points}


def write_calibration(path, rows, n, device, floor: dict | None = None, under: dict | None = None,
                      more_rows=()) -> dict:
    """alpha and beta from `rows`, then contention, engine cost, the completion floor and the
    under-backward fits (`floor`, `under`: completion_floor's and under_backward_fit's
    arguments, for a quicker measurement in tests). With `more_rows` (the sweep repeated),
    everything is measured once per sweep and each figure is the median over the repeats."""
    cal = combine([_calibration(r, n, device, floor, under) for r in [rows, *more_rows]])
    if dist.get_rank() == 0:
        with open(path, "w") as f:
            json.dump(cal, f, indent=1)
    return cal


def _calibration(rows, n, device, floor: dict | None, under: dict | None) -> dict:
    alpha, beta, ops = fit_ops(rows, n)
    cal = {"world_size": n, "backend": dist.get_backend(), "alpha": alpha, "beta": beta, "ops": ops,
           "overhead_per_bucket_s": engine_overhead_per_bucket(device),
           "floor": completion_floor(device, **(floor or {}))}
    quick = {k: v for k, v in (floor or {}).items() if k in ("model_cfg", "batch")}
    cal["contention"] = contention_factor(device, cal["floor"]["per_bucket_s"], **quick)
    if n > 1:  # the engine's own collectives under backward (ZeRO-1's where its fit was measured)
        fits = {"all_reduce": (alpha, beta), **{op: (ops[op]["alpha"], ops[op]["beta"])
                                                for op in ("reduce_scatter",) if op in ops}}
        cal["under_backward"] = {op: under_backward_fit(device, ab, op, **(under or {}), **quick)
                                 for op, ab in fits.items()}
    return cal


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="minddp calibrate", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="docs/calibration.json", help="the calibration JSON")
    ap.add_argument("--ops", default="all_reduce,zero1_reduce_scatter,zero1_all_gather",
                    help="the collectives swept for alpha and beta (of minddp bench's)")
    ap.add_argument("-b", "--minbytes", type=parse_size, default=8)
    ap.add_argument("-e", "--maxbytes", type=parse_size, default=parse_size("64MiB"))
    ap.add_argument("-f", "--stepfactor", type=float, default=4)
    ap.add_argument("-w", "--warmup", type=int, default=5)
    ap.add_argument("-n", "--iters", type=int, default=30)
    ap.add_argument("--repeats", type=int, default=3, help="measure everything this often, keep the medians")
    ap.add_argument("--backend", default="auto", choices=["auto", "gloo", "nccl"])
    return ap


def calibrate(path, ops, sizes, warmup: int, iters: int, repeats: int, device, rows=None) -> dict:
    """Sweep `ops` `repeats` times (the first sweep may be given: `rows`), write the calibration."""
    def sweep():
        return [r for op in ops for r in run_op(op, sizes, torch.float32, warmup, iters, device)]

    runs = [rows or sweep()] + [sweep() for _ in range(repeats - 1)]
    cal = write_calibration(path, runs[0], dist.get_world_size(), device, more_rows=runs[1:])
    if dist.get_rank() == 0:
        print(summary(path, cal))
    return cal


def summary(path, cal: dict) -> str:
    floor_ms, engine_us = cal["floor"]["per_bucket_s"] * 1e3, cal["overhead_per_bucket_s"] * 1e6
    lines = [f"# calibration -> {path}: alpha {cal['alpha'] * 1e6:.1f} us, beta {cal['beta'] / 1e9:.3f} "
             f"GB/s, contention x{cal['contention']['factor']:.2f}, engine {engine_us:.0f} us per bucket, "
             f"completion floor {floor_ms:.2f} ms per bucket under backward"]
    for op, fit in cal.get("under_backward", {}).items():
        caps = ", ".join(f"{p['cap_mb']:g}" for p in fit["points"])
        lines.append(f"# {op} under backward (the engine at caps {caps} MB): x{fit['slowdown']:.2f} slower "
                     f"after {fit['delay_s'] * 1e3:.2f} ms per bucket, backward {fit['backward_share']:.2f} "
                     "of forward + backward")
    return "\n".join(lines)


def main(argv=None) -> None:
    args = _parser().parse_args(argv)
    device = start(args.backend).device
    sizes = sweep_sizes(args.minbytes, args.maxbytes, args.stepfactor)
    calibrate(args.out, args.ops.split(","), sizes, args.warmup, args.iters, args.repeats, device)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
