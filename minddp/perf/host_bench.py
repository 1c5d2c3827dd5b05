"""The engine's host cost where the host paces the step: many small tensors, almost no compute
(what a GPU sees of a small or medium model: its backward waits for the host to launch kernels).

Workload (the model is the caller's: minddp.tools.bench_host builds a GPT of tiny layers, 32
wide, 1 head, a vocabulary of 64) on one sequence of 8 tokens, SGD, one bucket (cap 25 MB), each
step `zero_grad(set_to_none=...)` -> forward -> backward -> `step()`. Two measurements, both
as ratios of what each engine adds to the same step:
- `step_costs`: `none` (no wrapper, no communication), torch DDP and minddp interleaved, in an
  order rotated every round, wall time and the process's own CPU time (which other processes
  do not move) per step; with `.grad` set to None each step (the default of `zero_grad()`) and
  kept (zeroed in place);
- `hook_costs`: the engine's gradient path alone, communication stubbed (both engines get a
  comm hook that returns a finished future): the process's CPU time of one forward and
  backward, less the plain model's, per ready gradient (µs). The forward is in: each engine
  prepares its backward at the forward's end (minddp points `.grad` at the buckets there).
  Nothing travels and no peer waits, so noise hardly moves it.
"""

from __future__ import annotations

import copy
import statistics
import time

import torch
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks.debugging_hooks import noop_hook

from .. import _compat
from ..engine.ddp import DistributedDataParallel

ENGINES = ("none", "torch DDP", "minddp")
VOCAB, TOKENS = 64, 8  # the model's vocabulary and the one sequence's length (minddp.tools.bench_host)


def num_tensors(model: nn.Module) -> int:
    return sum(1 for _ in model.parameters())


def _wrapped(base: nn.Module, engine: str, stub: bool) -> nn.Module:
    model = copy.deepcopy(base)
    if engine == "none":
        return model
    if engine == "torch DDP":
        model = _compat.TORCH_DDP(model, bucket_cap_mb=25)
        if stub:
            model.register_comm_hook(None, noop_hook)
        return model
    model = DistributedDataParallel(model, bucket_cap_mb=25)
    if stub:
        model.register_comm_hook(None, lambda state, bucket: _done(bucket.buffer()))
    return model


def _done(t: torch.Tensor) -> torch.futures.Future:
    fut = torch.futures.Future()
    fut.set_result(t)
    return fut


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return (torch.randint(0, VOCAB, (1, TOKENS), generator=g),
            torch.randint(0, VOCAB, (1, TOKENS), generator=g))


def _loss(model, x, y) -> torch.Tensor:
    return nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten())


def step_costs(base: nn.Module, rounds: int, steps: int, set_to_none: bool) -> dict[str, dict[str, float]]:
    """{engine: {"wall": s, "cpu": s}}: median per step over rounds of `steps` steps each, the
    engines (each its own copy of `base`) interleaved in an order rotated every round (the first
    round is warm-up)."""
    x, y = _batch()
    models = {e: _wrapped(base, e, stub=False) for e in ENGINES}
    opts = {e: torch.optim.SGD(m.parameters(), lr=1e-3) for e, m in models.items()}
    samples = {e: {"wall": [], "cpu": []} for e in ENGINES}
    for r in range(rounds + 1):
        order = ENGINES[r % 3:] + ENGINES[: r % 3]
        for e in order:
            m, opt = models[e], opts[e]
            c0, w0 = time.process_time(), time.perf_counter()
            for _ in range(steps):
                opt.zero_grad(set_to_none=set_to_none)
                _loss(m, x, y).backward()
                opt.step()
            if r:
                samples[e]["wall"].append((time.perf_counter() - w0) / steps)
                samples[e]["cpu"].append((time.process_time() - c0) / steps)
    return {e: {k: statistics.median(v) for k, v in s.items()} for e, s in samples.items()}


def added_ratio(costs: dict[str, dict[str, float]], clock: str) -> float:
    """What minddp adds to the step over what torch DDP adds (1.0: the same)."""
    none = costs["none"][clock]
    return (costs["minddp"][clock] - none) / (costs["torch DDP"][clock] - none)


def hook_costs(base: nn.Module, reps: int, set_to_none: bool) -> dict[str, float]:
    """{engine: µs of process CPU time per ready gradient}, communication stubbed: one forward
    and backward with each engine less the plain model's, interleaved, median over `reps`."""
    x, y = _batch()
    models = {e: _wrapped(base, e, stub=True) for e in ENGINES}
    n = num_tensors(base)
    samples = {e: [] for e in ENGINES}
    for r in range(reps + 2):  # two warm-up rounds: minddp rebuilds its buckets after the first
        for e in ENGINES[r % 3:] + ENGINES[: r % 3]:
            m = models[e]
            m.zero_grad(set_to_none=set_to_none)
            c0 = time.process_time()
            _loss(m, x, y).backward()
            if r >= 2:
                samples[e].append(time.process_time() - c0)
    med = {e: statistics.median(s) for e, s in samples.items()}
    return {e: (med[e] - med["none"]) / n * 1e6 for e in ENGINES if e != "none"}
