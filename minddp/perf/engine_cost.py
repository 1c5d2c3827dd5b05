"""What the engine itself costs per bucket, communication stubbed out: the CPU work of its
hooks, launches and wait (`make bench`'s per-bucket table, `make calibrate`'s overhead).

At a cap of one parameter per bucket every bucket is launched with a comm hook that returns
a finished future; backward time minus the same model's backward without any wrapper,
divided by the number of buckets. Noise cannot move it much: no wire, no peer.
"""

from __future__ import annotations

import copy
import statistics

import torch
from torch.distributed.algorithms.ddp_comm_hooks.debugging_hooks import noop_hook

from .. import _compat
from ..engine.ddp import DistributedDataParallel
from .clock import after_warmup, timed


def torch_buckets(model) -> int | None:
    """torch DDP's bucket count after its rebuild (from its logging data); None where it logged
    none (a model small enough for one bucket)."""
    sizes = _compat.ddp_rebuilt_bucket_sizes(model)
    return len(sizes.split(",")) if sizes else None


def per_bucket_cost(base, x, loss_fn, reps: int = 20) -> dict[str, tuple[float, int]]:
    """{engine: (seconds of engine CPU work per bucket, buckets)} with communication stubbed out,
    for copies of `base` on input `x` under `loss_fn(model, x)`."""
    plain = copy.deepcopy(base)
    ours = DistributedDataParallel(copy.deepcopy(base), bucket_cap_mb=1e-6)
    ours.register_comm_hook(None, lambda state, b: _done(b.buffer()))
    theirs = _compat.TORCH_DDP(copy.deepcopy(base), bucket_cap_mb=1e-6)
    theirs.register_comm_hook(None, noop_hook)
    models = {"plain": plain, "minddp": ours, "torch DDP": theirs}

    def backward(m) -> float:
        loss = loss_fn(m, x)
        seconds = timed(loss.backward, x.device)
        m.zero_grad()
        return seconds

    times = after_warmup(lambda: {name: backward(m) for name, m in models.items()}, reps)
    med = {k: statistics.median(t[k] for t in times) for k in models}
    n = {"minddp": len(ours.bucket_assignment), "torch DDP": torch_buckets(theirs)}
    n["torch DDP"] = n["torch DDP"] or len(list(theirs.parameters()))  # one parameter per bucket
    return {k: ((med[k] - med["plain"]) / n[k], n[k]) for k in n}


def _done(t):
    f = torch.futures.Future()
    f.set_result(t)
    return f
