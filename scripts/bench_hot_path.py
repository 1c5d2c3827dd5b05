"""The engine's hot path on the CPU, each change against the path it replaced, in one process
(interleaved, rotated rounds: the same machine load for every variant; process time, medians).

    python scripts/bench_hot_path.py [--preset gpt-small] [--reps 101]

1. Per-bucket cost, one parameter per bucket, the collective stubbed (minddp's all-reduce returns a
   finished future: this process only): backward minus a plain backward, per bucket, for the fused
   scale (the average's 1/n in the copy into the bucket), the unfused one (a plain copy, then a pass
   over the bucket: `reduction.prescale = None`), and torch DDP on a world-1 gloo group (its
   collective real but trivial; with a comm hook torch DDP would skip its scale).
2. optimizer_overlap's step per bucket: Adam's functional step on prebuilt lists against
   optimizer.step() with its groups cut (what it did before; forced by a no-op step hook), beside
   DDP + AdamW stepping once; a whole training step each.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import minddp  # noqa: E402
import minddp.engine.communicator as communicator  # noqa: E402
from minddp.tools.workload import GPT_PRESETS, build  # noqa: E402


class _Done:
    def __init__(self, t):
        self.t = t

    def get_future(self):
        f = torch.futures.Future()
        f.set_result([self.t])
        return f


class _StubbedDist:
    """minddp's view of torch.distributed with the all-reduce stubbed (torch itself untouched)."""

    def __getattr__(self, name):
        return getattr(dist, name)

    @staticmethod
    def all_reduce(t, op=None, group=None, async_op=False):
        return _Done(t)


def rotated(models: dict, reps: int, fn) -> dict[str, float]:
    """Median process seconds of fn(model) per model, rounds rotated, 3 warm-up rounds."""
    times = {k: [] for k in models}
    items = list(models.items())
    for r in range(reps + 3):
        for k, m in items[r % len(items):] + items[: r % len(items)]:
            seconds = fn(m)
            if r >= 3:
                times[k].append(seconds)
    return {k: statistics.median(v) for k, v in times.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="gpt-small", choices=sorted(GPT_PRESETS))
    ap.add_argument("--reps", type=int, default=101)
    args = ap.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    base, x = build(GPT_PRESETS[args.preset], torch.device("cpu"), 4)
    n = len(list(base.parameters()))

    def loss_of(m):
        logits = m(x[:, :-1])
        return F.cross_entropy(logits.reshape(-1, logits.size(-1)), x[:, 1:].reshape(-1))

    def backward(m) -> float:
        loss = loss_of(m)
        t = time.process_time()
        loss.backward()
        seconds = time.process_time() - t
        m.zero_grad(set_to_none=True)
        return seconds

    communicator.dist = _StubbedDist()
    unfused = minddp.DDP(copy.deepcopy(base), bucket_cap_mb=1e-6)
    unfused.reduction.prescale = None
    models = {"plain": copy.deepcopy(base), "fused": minddp.DDP(copy.deepcopy(base), bucket_cap_mb=1e-6),
              "unfused": unfused,
              "torch DDP": nn.parallel.DistributedDataParallel(copy.deepcopy(base), bucket_cap_mb=1e-6)}
    med = rotated(models, args.reps, backward)
    print(f"{args.preset}, {n} buckets, median of {args.reps}: per-bucket cost " + ", ".join(
        f"{k} {(med[k] - med['plain']) / n * 1e6:.1f} us" for k in ("fused", "unfused", "torch DDP")))

    def full_step(pair) -> float:
        m, o = pair
        t = time.process_time()
        loss_of(m).backward()
        o.step()
        o.zero_grad(set_to_none=True)
        return time.process_time() - t

    def engine(**options):
        m = minddp.DDP(copy.deepcopy(base), bucket_cap_mb=1e-6, **options)
        cls = minddp.OverlappedOptimizer if options else minddp.ReplicatedOptimizer
        return m, cls(m, torch.optim.AdamW, lr=1e-4)

    generic = engine(optimizer_overlap=True)
    generic[1].optim.register_step_pre_hook(lambda *a: None)  # forces optimizer.step() per bucket
    med = rotated({"ddp + AdamW": engine(), "overlap, functional": engine(optimizer_overlap=True),
                   "overlap, optimizer.step()": generic}, max(args.reps // 3, 5), full_step)
    print("training step (ms): " + ", ".join(f"{k} {v * 1e3:.2f}" for k, v in med.items()))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
