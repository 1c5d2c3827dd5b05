"""Collective benchmark in the style of NVIDIA's nccl-tests, plus an alpha-beta fit.

    torchrun --standalone --nproc_per_node=2 -m minddp bench -b 8 -e 64M -f 4 --op all_reduce
    torchrun ... -m minddp bench --op all          # every op, one table each
    torchrun ... -m minddp bench --op ring_all_reduce --csv out.csv --json out.json

Columns as nccl-tests: size (bytes), count (elements), type, time (us: the median of the
timed iterations on the slowest rank; nccl-tests takes the mean, which one stall on a
shared VM ruins), algbw = size / time, busbw = algbw * the op's factor (all-reduce
2(n-1)/n; reduce-scatter, all-gather, all-to-all (n-1)/n; broadcast, reduce 1), and
#wrong: elements that differ from the closed-form result of one checked call with known
inputs. "size" is the largest buffer involved (the input of reduce-scatter, the output
of all-gather).
Then t = ca*alpha + cb*size/beta (the op's own cost coefficients) is fitted by least
squares, and the machine's memory-copy bandwidth is printed as the physical reference.

`--calibrate FILE` (make calibrate) also measures what the DDP cost model needs beyond
alpha and beta, and writes all of it as JSON for `minddp costmodel --calibration`
and `minddp scaling`:
- contention: a 4 MB all-reduce timed alone and launched under the backward of make scaling's
  GPT (every rank computing, as during training), less the completion floor; where
  communication shares cores with compute, the ratio is > 1;
- the engine's CPU cost per bucket (launch, hooks, wait), with communication stubbed out;
- the per-bucket completion floor: the engine at world 1 (each rank in a group of one) on
  make scaling's GPT, busy time per bucket launched under backward (`completion_floor`).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics

import torch
import torch.distributed as dist

from .. import collectives as C
from ..costmodel import busbw_factor, coefficients, parse_size, simulate_buckets
from .cli import start, timed
from .scaling import STUDY_BATCH, STUDY_GPT
from .workload import lm_loss

OPS = ["all_reduce", "reduce_scatter", "all_gather", "broadcast", "reduce", "all_to_all",
       "ring_all_reduce", "rs_ag_all_reduce", "tree_all_reduce",
       "zero1_reduce_scatter", "zero1_all_gather"]  # ZeRO-1's in place (minddp.collectives)
DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16,
          "float16": torch.float16}


class _Inputs:
    """One size's buffers on known values (small integers: exact in every dtype), so a check
    can count the wrong elements after one call."""

    def __init__(self, nbytes: int, dtype, n: int, r: int, device):
        esize = torch.empty((), dtype=dtype).element_size()
        self.count = max(n, nbytes // esize // n * n)  # a multiple of n elements
        self.n, self.r, self.per, self.dtype, self.device = n, r, self.count // n, dtype, device
        self.x = torch.ones(self.count, dtype=dtype, device=device)
        self.pos = torch.arange(self.count, device=device) % 3
        self.block = torch.arange(self.count, device=device) // self.per  # whose slice an element is in
        self.mine = slice(r * self.per, (r + 1) * self.per)

    def summed(self, pos=None):  # what a sum of pos + rank + 1 over the ranks gives
        pos = self.pos if pos is None else pos
        return (self.n * pos + self.n * (self.n + 1) / 2).to(self.dtype)

    def wrong(self, got, want) -> int:
        return (got != want.to(self.dtype)).sum().item()


def _sum_of_ranks(c: _Inputs, fn, got=None, want=None):
    """(fn, check) for a reduction of pos + rank + 1: `got` (default the whole buffer) must hold
    `want` (default the sum everywhere)."""
    def check():
        c.x.copy_(c.pos + c.r + 1)
        fn()
        return c.wrong(c.x if got is None else got(), c.summed() if want is None else want())
    return fn, check


def _gathered(c: _Inputs, fn, fill):
    """(fn, check) for a gather: after `fill()`, every element must be its owner's rank + 1."""
    def check():
        fill()
        fn()
        return c.wrong(c.x, c.block + 1)
    return fn, check


def _reduce_scatter(c):
    out = torch.empty(c.per, dtype=c.dtype, device=c.device)
    return _sum_of_ranks(c, lambda: dist.reduce_scatter_tensor(out, c.x), lambda: out,
                         lambda: c.summed(c.pos[c.mine]))


def _all_gather(c):
    mine = torch.empty(c.per, dtype=c.dtype, device=c.device)
    return _gathered(c, lambda: dist.all_gather_into_tensor(c.x, mine), lambda: mine.fill_(c.r + 1))


def _zero1_all_gather(c):
    def fill():
        c.x.fill_(-1)
        c.x[c.mine] = c.r + 1
    return _gathered(c, lambda: C.all_gather_in_place(c.x, dist.group.WORLD).wait(), fill)


def _broadcast(c):
    def check():
        c.x.copy_(c.pos + c.r)
        fn()
        return c.wrong(c.x, c.pos)
    fn = lambda: dist.broadcast(c.x, src=0)  # noqa: E731
    return fn, check


def _all_to_all(c):
    out = torch.empty_like(c.x)
    fn = lambda: dist.all_to_all_single(out, c.x)  # noqa: E731

    def check():
        c.x.copy_(c.block * 10 + c.r)  # block j of rank r: 10j + r
        fn()
        return c.wrong(out, c.r * 10 + c.block)
    return fn, check


# op -> (fn, check) builder over _Inputs
_CASES = {
    "all_reduce": lambda c: _sum_of_ranks(c, lambda: dist.all_reduce(c.x)),
    "ring_all_reduce": lambda c: _sum_of_ranks(c, lambda: C.ring_all_reduce(c.x)),
    "rs_ag_all_reduce": lambda c: _sum_of_ranks(c, lambda: C.all_reduce_via_rs_ag(c.x)),
    "tree_all_reduce": lambda c: _sum_of_ranks(c, lambda: C.tree_all_reduce(c.x)),
    "reduce_scatter": _reduce_scatter,
    "zero1_reduce_scatter": lambda c: _sum_of_ranks(  # the engine's own: in place, this rank's slice
        c, lambda: C.reduce_scatter_in_place(c.x, dist.group.WORLD, dist.ReduceOp.SUM).wait(),
        lambda: c.x[c.mine], lambda: c.summed(c.pos[c.mine])),
    "zero1_all_gather": _zero1_all_gather,
    "all_gather": _all_gather,
    "broadcast": _broadcast,
    "reduce": lambda c: _sum_of_ranks(c, lambda: dist.reduce(c.x, dst=0), lambda: c.x,
                                      lambda: c.summed() if c.r == 0 else c.x),
    "all_to_all": _all_to_all,
}


def _setup(op: str, nbytes: int, dtype, n: int, r: int, device=None):
    """(element count, callable, check) for one size: check() runs one call on known inputs and
    returns the number of wrong elements."""
    if op not in _CASES:
        raise ValueError(f"unknown op {op!r}; one of {OPS}")
    c = _Inputs(nbytes, dtype, n, r, device)
    return (c.count, *_CASES[op](c))


def run_op(op, sizes, dtype, warmup, iters, device=None):
    device = device or torch.device("cpu")  # called outside a job (tests)
    n, r = dist.get_world_size(), dist.get_rank()
    rows = []
    for nbytes in sizes:
        count, fn, check = _setup(op, nbytes, dtype, n, r, device)
        size = count * torch.empty((), dtype=dtype).element_size()
        for _ in range(warmup):
            fn()
        dist.barrier()
        # synchronised on CUDA: a collective returns once enqueued (cli.timing_strategy)
        times = [timed(fn, device) for _ in range(iters)]
        # the median iteration: on a shared 2-core VM single iterations stall for milliseconds
        t = torch.tensor([statistics.median(times)], dtype=torch.float64, device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)  # the slowest rank sets the time
        wrong = torch.tensor([check()], dtype=torch.int64, device=device)
        dist.all_reduce(wrong)
        sec = t.item()
        algbw = size / sec / 1e9
        rows.append({"op": op, "size": size, "count": count, "type": str(dtype).removeprefix("torch."),
                     "time_us": sec * 1e6, "algbw": algbw, "busbw": algbw * busbw_factor(op, n),
                     "wrong": int(wrong.item())})
    return rows


def fit_alpha_beta(rows, n) -> tuple[float, float]:
    """Least squares for t = ca*alpha + cb*size*(1/beta) in relative error (each size counts
    alike: in absolute error the largest sizes decide alpha too, from their noise);
    returns (alpha s, beta bytes/s)."""
    ca, cb = coefficients(rows[0]["op"], n)
    y = torch.tensor([r["time_us"] * 1e-6 for r in rows], dtype=torch.float64)
    A = torch.tensor([[ca, cb * r["size"]] for r in rows], dtype=torch.float64) / y.unsqueeze(1)
    sol = torch.linalg.lstsq(A, torch.ones_like(y).unsqueeze(1)).solution.flatten()
    alpha, inv_beta = sol.tolist()
    return alpha, (1 / inv_beta if inv_beta > 0 else float("inf"))


def memcpy_bandwidth(nbytes=256 * 2**20, reps=5, device=None) -> float:
    device = device or torch.device("cpu")  # called outside a job (tests)
    src = torch.ones(nbytes // 4, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    seconds = timed(lambda: [dst.copy_(src) for _ in range(reps)], device)
    return nbytes * reps / seconds


# make scaling's GPT and its micro-batch (train.micro_batch_size=2): the floor and the contention
# depend on what backward runs beside the communication
FLOOR_MODEL, FLOOR_BATCH = STUDY_GPT, STUDY_BATCH[1]


def _study_gpt(device, cfg: dict, batch: int):
    """(make scaling's GPT, a batch of tokens for it), seeded alike on every rank."""
    from ..train.model import GPT, GPTConfig

    torch.manual_seed(0)
    model = GPT(GPTConfig(**cfg)).to(device)
    return model, torch.randint(0, 256, (batch, cfg["block_size"] + 1), device=device)


def contention_factor(device, floor_s: float = 0.0, model_cfg=None, batch: int = FLOOR_BATCH,
                      nbytes: int = 4 * 2**20, reps: int = 6) -> dict:
    """A bucket-sized all-reduce timed alone, and launched under the backward of make scaling's
    GPT (what the engine's buckets share the cores with: every rank computing at once, memory
    traffic included), to its completion callback as the engine notices it. Less the
    completion floor (`floor_s`, counted apart), the ratio says how much backward slows
    communication on these cores."""
    import time



    model, x = _study_gpt(device, model_cfg or FLOOR_MODEL, batch)
    buf = torch.ones(nbytes // 4, device=device)
    alone, busy = [], []
    for _ in range(reps):
        alone.append(timed(lambda: dist.all_reduce(buf), device))
        loss = lm_loss(model, x)
        dist.barrier()
        done = []
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
    from ..train.model import GPT, GPTConfig
    from .bench_ddp import per_bucket_cost

    torch.manual_seed(0)
    base = GPT(GPTConfig(n_layer=2, n_head=4, n_embd=64, block_size=32)).to(device)
    x = torch.randint(0, 256, (4, 33), device=device)
    return max(0.0, per_bucket_cost(base, x, reps=10)["minddp"][0])




def completion_floor(device, model_cfg=None, batch: int = FLOOR_BATCH, cap_mb: float = 1.0,
                     reps: int = 4) -> dict:
    """The per-bucket completion floor at world 1: each rank runs the engine alone in a group of
    one (all ranks at once, as they share the cores at world 2), so nothing crosses a wire, and
    the busy time per bucket launched under backward is what noticing completions costs (a
    callback that needs the GIL backward holds). The last bucket is launched when backward
    ends and is noticed at once: it is not counted."""

    from ..ddp import DistributedDataParallel

    cfg = model_cfg or FLOOR_MODEL
    groups = [dist.new_group([r]) for r in range(dist.get_world_size())]  # every rank makes each
    model, x = _study_gpt(device, cfg, batch)
    ddp = DistributedDataParallel(model, process_group=groups[dist.get_rank()], bucket_cap_mb=cap_mb)
    per, buckets = [], 0
    for r in range(reps + 2):  # the first two: the bucket rebuild and warm-up
        lm_loss(ddp, x).backward()
        s = ddp.comm_stats
        buckets = s.num_collectives
        if r >= 2 and buckets > 1:
            per.append(s.busy_s / (buckets - 1))
        ddp.zero_grad(set_to_none=True)
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
    import time

    from ..costmodel import BUCKET_OPS
    from ..ddp import DistributedDataParallel

    cfg, n = model_cfg or FLOOR_MODEL, dist.get_world_size()
    points = []
    for cap in caps:
        model, x = _study_gpt(device, cfg, batch)
        ddp = DistributedDataParallel(model, bucket_cap_mb=cap, shard_optimizer=op == "reduce_scatter")
        busy, backward, forward = [], [], []
        for r in range(reps + 2):  # the first two: the bucket rebuild and warm-up
            t0 = time.perf_counter()
            loss = lm_loss(ddp, x)
            t1 = time.perf_counter()
            loss.backward()
            s = ddp.comm_stats
            if r >= 2:
                busy.append(s.busy_s)
                forward.append(t1 - t0)
                backward.append(time.perf_counter() - t1 - s.exposed_wait_s)
            # zeroed in place: backward accumulates into the bucket views, as the synchronised
            # micro-step does in training (set to None, each gradient would be copied in)
            ddp.zero_grad(set_to_none=False)
        t = torch.tensor([statistics.median(v) for v in (busy, backward, forward)], dtype=torch.float64,
                         device=device)
        dist.all_reduce(t, op=dist.ReduceOp.AVG)
        points.append({"cap_mb": cap, "bucket_bytes": [b.grad_nbytes for b in ddp.layout.buckets],
                       "busy_s": t[0].item(), "backward_s": t[1].item(), "forward_s": t[2].item()})
    cost = BUCKET_OPS[op]

    def error(guess: tuple[float, float]) -> float:
        total = 0.0
        for p in points:
            work = [cost(b, n, *alone) for b in p["bucket_bytes"]]
            busy = simulate_buckets(p["bucket_bytes"], work, p["backward_s"], *guess)[0]
            total += math.log(busy / p["busy_s"]) ** 2
        return total

    grid = [(1.05 ** k, d * 2.5e-4) for k in range(60) for d in range(80)]  # x1-17, 0-20 ms
    slowdown, delay = min(grid, key=error)
    share = statistics.median(p["backward_s"] / (p["backward_s"] + p["forward_s"]) for p in points)
    return {"slowdown": slowdown, "delay_s": delay, "backward_share": share, "batch": batch, "points": points}


def write_calibration(path, rows, n, device, floor: dict | None = None, under: dict | None = None,
                      more_rows=()) -> dict:
    """alpha and beta from `rows`, then contention, engine cost, the completion floor and the
    under-backward fits (`floor`, `under`: completion_floor's and under_backward_fit's
    arguments, for a quicker measurement in tests). With `more_rows` (the sweep repeated),
    everything is measured once per sweep and each figure is the median over the repeats."""
    runs = [_calibration(r, n, device, floor, under) for r in [rows, *more_rows]]
    cal = {**runs[0], "repeats": len(runs), "alpha": _median(runs, "alpha"), "beta": _median(runs, "beta"),
           "overhead_per_bucket_s": _median(runs, "overhead_per_bucket_s")}
    cal["ops"] = {op: {k: _median([r["ops"][op] for r in runs], k) for k in ("alpha", "beta")}
                  for op in runs[0]["ops"]}
    cal["floor"] = _middle([r["floor"] for r in runs], "per_bucket_s")
    cal["contention"] = _middle([r["contention"] for r in runs], "factor")
    if "under_backward" in cal:
        cal["under_backward"] = {op: _middle([r["under_backward"][op] for r in runs], "slowdown")
                                 for op in runs[0]["under_backward"]}
    if dist.get_rank() == 0:
        with open(path, "w") as f:
            json.dump(cal, f, indent=1)
    return cal


def _median(dicts: list[dict], key: str) -> float:
    return statistics.median(d[key] for d in dicts)


def _middle(dicts: list[dict], key: str) -> dict:
    """The measurement whose `key` is the median (the lower middle one of an even count)."""
    return sorted(dicts, key=lambda d: d[key])[(len(dicts) - 1) // 2]


def _calibration(rows, n, device, floor: dict | None, under: dict | None) -> dict:
    alpha, beta = fit_alpha_beta([r for r in rows if r["op"] == "all_reduce"], n)
    ops = {}  # every other measured collective's own fit; the engine's own ZeRO-1 collectives
    for op in sorted({r["op"] for r in rows} - {"all_reduce"}):  # (zero1_*) stand for the op
        a, b = fit_alpha_beta([r for r in rows if r["op"] == op], n)
        ops[op] = {"alpha": a, "beta": b}
    for op in [op for op in ops if op.startswith("zero1_")]:
        ops[op.removeprefix("zero1_")] = ops[op]  # what the cost model's reduce-scatter means here
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
    ap = argparse.ArgumentParser(prog="minddp bench", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-b", "--minbytes", type=parse_size, default=8)
    ap.add_argument("-e", "--maxbytes", type=parse_size, default=parse_size("64MiB"))
    ap.add_argument("-f", "--stepfactor", type=float, default=4)
    ap.add_argument("--op", default="all_reduce", help=f"one of {OPS}, or all")
    ap.add_argument("-d", "--dtype", default="float32", choices=sorted(DTYPES))
    ap.add_argument("-w", "--warmup", type=int, default=3)
    ap.add_argument("-n", "--iters", type=int, default=10)
    ap.add_argument("--backend", default="auto", choices=["auto", "gloo", "nccl"],
                    help="auto: nccl on CUDA (device cuda:LOCAL_RANK), else gloo on CPU")
    ap.add_argument("--repeats", type=int, default=1,
                    help="with --calibrate: measure everything this often, keep the medians")
    ap.add_argument("--calibrate", metavar="FILE",
                    help="also measure contention and per-bucket engine cost; write the calibration JSON")
    ap.add_argument("--csv")
    ap.add_argument("--json")
    return ap


def main(argv=None) -> None:
    args = _parser().parse_args(argv)
    device = start(args.backend).device
    n, rank = dist.get_world_size(), dist.get_rank()
    sizes, s = [], int(args.minbytes)
    while s <= args.maxbytes:
        sizes.append(s)
        s = max(s + 1, int(s * args.stepfactor))
    ops = OPS if args.op == "all" else args.op.split(",")
    all_rows = []
    for op in ops:
        rows = run_op(op, sizes, DTYPES[args.dtype], args.warmup, args.iters, device)
        all_rows += rows
        if rank == 0:
            print(f"\n# {op}, {n} ranks ({dist.get_backend()}), {args.warmup} warm-up + {args.iters} timed")
            print(f"{'size':>12} {'count':>12} {'type':>9} {'time(us)':>11} {'algbw(GB/s)':>12} "
                  f"{'busbw(GB/s)':>12} {'#wrong':>7}")
            for r in rows:
                print(f"{r['size']:>12} {r['count']:>12} {r['type']:>9} {r['time_us']:>11.1f} "
                      f"{r['algbw']:>12.3f} {r['busbw']:>12.3f} {r['wrong']:>7}")
            if n > 1 and len(rows) >= 2:
                alpha, beta = fit_alpha_beta(rows, n)
                print(f"# alpha-beta fit ({op}): alpha = {alpha * 1e6:.1f} us, beta = {beta / 1e9:.3f} GB/s")
    if args.calibrate:
        sweep = lambda: [r for op in ops  # noqa: E731
                         for r in run_op(op, sizes, DTYPES[args.dtype], args.warmup, args.iters, device)]
        more = [sweep() for _ in range(args.repeats - 1)]
        cal = write_calibration(args.calibrate, all_rows, n, device, more_rows=more)
        if rank == 0:
            print(f"\n# calibration -> {args.calibrate}: alpha {cal['alpha'] * 1e6:.1f} us, beta "
                  f"{cal['beta'] / 1e9:.3f} GB/s, contention x{cal['contention']['factor']:.2f}, engine "
                  f"{cal['overhead_per_bucket_s'] * 1e6:.0f} us per bucket, completion floor "
                  f"{cal['floor']['per_bucket_s'] * 1e3:.2f} ms per bucket under backward")
            for op, fit in cal.get("under_backward", {}).items():
                caps = ", ".join(f"{p['cap_mb']:g}" for p in fit["points"])
                print(f"# {op} under backward (the engine at caps {caps} MB): x{fit['slowdown']:.2f} slower "
                      f"after {fit['delay_s'] * 1e3:.2f} ms per bucket, backward {fit['backward_share']:.2f} "
                      "of forward + backward")
    bw = memcpy_bandwidth(device=device) if rank == 0 else 0.0
    if rank == 0:
        print(f"\n# memory copy bandwidth ({device.type}, 256 MiB): {bw / 1e9:.2f} GB/s")
        _write_rows(args, all_rows, n, bw)
    bad = sum(r["wrong"] for r in all_rows)
    dist.destroy_process_group()
    if bad:
        raise SystemExit(f"{bad} wrong elements")


def _write_rows(args, all_rows: list[dict], n: int, bw: float) -> None:
    if args.csv:
        with open(args.csv, "w") as f:
            f.write("op,size,count,type,time_us,algbw,busbw,wrong\n")
            for r in all_rows:
                f.write(",".join(str(r[k]) for k in ("op", "size", "count", "type", "time_us",
                                                     "algbw", "busbw", "wrong")) + "\n")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"world_size": n, "rows": all_rows, "memcpy_gbs": bw / 1e9}, f, indent=1)


if __name__ == "__main__":
    main()
