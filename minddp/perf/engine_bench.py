"""minddp against torch DDP on one model, in the same processes (`make bench`'s measurements):

1. step time per bucket cap: every configuration wraps its own copy of the model; rounds of
   steps of every configuration in an order rotated every round (clock.interleaved), so the
   machine's drift hits all alike; per repeat the ratio of medians minddp / torch DDP;
2. optimizer setups (fused AdamW): minddp DDP, torch DDP, minddp ZeRO-1 (`ShardedOptimizer`),
   torch DDP + `ZeroRedundancyOptimizer`, minddp `optimizer_overlap`: step time against the
   first two, forward / backward / optimizer-step times on the device's clock, state bytes;
3. whole-model torch.compile: minddp and torch DDP around `torch.compile(model)`, minddp around
   per-block compile and around one whole graph: step time, exposed communication (backward
   minus the same backward under no_sync). With `link_gbps`, every configuration's buckets go
   over a modelled link instead (minddp.perf.link: a comm hook on both engines' public
   `register_comm_hook`; wall time, no CPU, gradients not averaged), so the overlap shows on
   a machine whose cores would otherwise both compute and sum.
The per-bucket CPU cost is engine_cost.per_bucket_cost.
"""

from __future__ import annotations

import contextlib
import copy
import inspect

import torch
import torch.distributed as dist

from .. import _compat
from ..engine.ddp import DistributedDataParallel
from ..engine.options import DEFAULT_BUCKET_CAP_MB
from ..optim.overlap import OverlappedOptimizer
from ..optim.zero import ShardedOptimizer
from .clock import PhaseClock, interleaved, sync, timed
from .engine_cost import torch_buckets
from .link import Link, link_hook
from .memory import state_bytes
from .workload import compiled, lm_loss


def step(model, opt, x) -> float:
    def work():
        opt.zero_grad()
        lm_loss(model, x).backward()
        opt.step()

    return timed(work, x.device)


def interleaved_steps(configs, x, rounds: int, per_round: int) -> list[float]:
    """Median step time (SGD) of each (label, cap, model), in rotated rounds (clock.interleaved)."""
    opts = [torch.optim.SGD(m.parameters(), lr=1e-4) for _, _, m in configs]
    steps = [lambda m=m, o=o: step(m, o, x) for (_, _, m), o in zip(configs, opts)]
    return [m[0] for m in interleaved(steps, rounds, per_round, x.device)]


def optimizer_configs(base, cap):
    """(label, model, optimizer) for the ways to run AdamW data-parallel, minddp DDP first."""
    from torch.distributed.optim import ZeroRedundancyOptimizer

    adamw = {"lr": 1e-4, "fused": True}
    plain = DistributedDataParallel(copy.deepcopy(base), bucket_cap_mb=cap)
    sharded = DistributedDataParallel(copy.deepcopy(base), bucket_cap_mb=cap, shard_optimizer=True)
    theirs = _compat.TORCH_DDP(copy.deepcopy(base), bucket_cap_mb=cap)
    theirs_zero = _compat.TORCH_DDP(copy.deepcopy(base), bucket_cap_mb=cap)
    AdamW = torch.optim.AdamW
    configs = [("minddp DDP + AdamW", plain, AdamW(plain.parameters(), **adamw)),
               ("torch DDP + AdamW", theirs, AdamW(theirs.parameters(), **adamw)),
               ("minddp shard_optimizer (ZeRO-1)", sharded, ShardedOptimizer(sharded, AdamW, **adamw)),
               ("torch DDP + ZeroRedundancyOptimizer", theirs_zero,
                ZeroRedundancyOptimizer(theirs_zero.parameters(), optimizer_class=AdamW, **adamw))]
    overlap = overlap_config(base, cap, adamw)
    return configs + [overlap]


def overlap_config(base, cap, adamw):
    """minddp with the optimizer stepped per bucket as its reduction completes (`optimizer_overlap`)."""
    model = DistributedDataParallel(copy.deepcopy(base), bucket_cap_mb=cap, optimizer_overlap=True)
    return ("minddp optimizer_overlap", model, OverlappedOptimizer(model, torch.optim.AdamW, **adamw))


def phases(model, opt, x, start=lambda: None) -> list[tuple[str, float, float]]:
    """(name, start, end) of one step's forward, backward and optimizer step, on the device's
    clock (CUDA events: a sync after the step would move ZeRO-1's all-gathers, which the
    forward waits for, into it); the work queued before is finished first, then `start()` (a
    trace's)."""
    sync(x.device)
    start()
    clock = PhaseClock(x.device)
    loss = lm_loss(model, x)
    clock.mark("forward")
    loss.backward()
    clock.mark("backward")
    opt.step()
    clock.mark("optimizer")
    return clock.spans()


def step_then_next(model, opt, x, start=lambda: None) -> list[tuple[str, float, float]]:
    """(name, start, end) of an optimizer step (gradients already there), then the next forward
    and backward, on the device's clock with no synchronisation between them, so ZeRO-1's
    all-gathers, launched in the step, may run under the forward that waits for them. The work
    queued before is finished first, then `start()` (a trace's)."""
    sync(x.device)
    start()
    clock = PhaseClock(x.device)
    opt.step()
    clock.mark("optimizer")
    loss = lm_loss(model, x)
    clock.mark("forward")
    loss.backward()
    clock.mark("backward")
    return clock.spans()


def phased_step(model, opt, x) -> tuple[float, float, float]:
    """Seconds of forward, backward and optimizer step (`phases`), gradients zeroed first."""
    opt.zero_grad()
    forward, backward, step = (z - a for _, a, z in phases(model, opt, x))
    return forward, backward, step


def interleaved_phases(configs, x, rounds: int, per_round: int) -> list[list[float]]:
    """Per (label, model, optimizer), the medians of [step, forward, backward, optimizer step]."""
    def phases(model, opt):
        p = phased_step(model, opt, x)
        return [sum(p), *p]

    steps = [lambda m=m, o=o: phases(m, o) for _, m, o in configs]
    return interleaved(steps, rounds, per_round, x.device)


def optimizer_section(base, x, repeats: int, rounds: int, per_round: int) -> list[dict]:
    """Per AdamW setup: step time against minddp DDP and torch DDP (ratios of medians, one per
    repeat), forward / backward / optimizer-step medians, optimizer-state bytes on each rank."""
    configs = optimizer_configs(base, DEFAULT_BUCKET_CAP_MB)
    rows = [{"label": label, "vs_minddp": [], "vs_torch": [], "phases": [], "state": state_bytes(opt)}
            for label, _, opt in configs]
    for _ in range(repeats):
        med = interleaved_phases(configs, x, rounds, per_round)
        for row, m in zip(rows, med):
            row["vs_minddp"].append(m[0] / med[0][0])
            row["vs_torch"].append(m[0] / med[1][0])
            row["phases"].append(m)
    everyone = [None] * dist.get_world_size()  # after the steps: AdamW's states exist from the first
    dist.all_gather_object(everyone, [state_bytes(opt) for _, _, opt in configs])
    for k, row in enumerate(rows):
        row["state"] = [e[k] for e in everyone]
    return rows


def exposed_gather(rows: list[dict]) -> list[float]:
    """ZeRO-1's exposed all-gather per repeat (seconds): its forward minus minddp DDP's, of
    optimizer_section's rows. ZeRO-1's forward waits for the all-gathers its step launched; DDP's
    waits for nothing. [] without a ZeRO-1 row."""
    by = {r["label"]: r for r in rows}
    zero, plain = by.get("minddp shard_optimizer (ZeRO-1)"), by["minddp DDP + AdamW"]
    return [z[1] - p[1] for z, p in zip(zero["phases"], plain["phases"])] if zero else []


def cap_sweep(base, x, caps, repeats: int, rounds: int, per_round: int) -> tuple[dict, dict, dict]:
    """minddp against torch DDP at each cap, every configuration its own copy of `base`: per cap
    the ratio of median step times minddp / torch DDP and minddp's median step (ms), one per
    repeat; and each engine's bucket count {(label, cap): n} after its rebuild."""
    configs = []  # (label, cap, model)
    for cap in caps:
        theirs = _compat.TORCH_DDP(copy.deepcopy(base), bucket_cap_mb=cap)
        configs.append(("torch DDP", cap, theirs))
        configs.append(("minddp", cap, DistributedDataParallel(copy.deepcopy(base), bucket_cap_mb=cap)))
    ratios, ours_ms = {cap: [] for cap in caps}, {cap: [] for cap in caps}
    for _ in range(repeats):
        med = interleaved_steps(configs, x, rounds, per_round)
        by = {(label, cap): m for (label, cap, _), m in zip(configs, med)}
        for cap in caps:
            ratios[cap].append(by[("minddp", cap)] / by[("torch DDP", cap)])
            ours_ms[cap].append(by[("minddp", cap)] * 1e3)
    buckets = {(label, cap): (len(m.bucket_assignment) if label == "minddp" else torch_buckets(m))
               for label, cap, m in configs}
    return ratios, ours_ms, buckets


ONE_GRAPH = "minddp DDP(compile(model)), one graph"


def compile_configs(base, backend: str, cap: float | None) -> list:
    """(label, wrapper) around a compiled GPT: the whole model (dynamo splits it at bucket
    boundaries for both engines), each block, and the whole model kept one graph (how minddp ran
    it before it gave dynamo torch DDP's handshake). Each whole model is compiled on its own
    (own_compile): the one graph never runs a split graph compiled for another."""
    def whole():
        return own_compile(copy.deepcopy(base), backend)

    blocks = compiled(copy.deepcopy(base), "blocks", backend)
    return [("minddp DDP(compile(model))", DistributedDataParallel(whole(), bucket_cap_mb=cap)),
            ("torch DDP(compile(model))", _compat.TORCH_DDP(whole(), bucket_cap_mb=cap)),
            ("minddp, each block compiled", DistributedDataParallel(blocks, bucket_cap_mb=cap)),
            (ONE_GRAPH, DistributedDataParallel(whole(), bucket_cap_mb=cap))]


def own_compile(model, backend: str):
    """torch.compile(model) with graphs of its own. Dynamo keeps compiled graphs on the code object,
    guarded by the module's type and shapes and the backend, not the instance: models compiled with
    the same backend share them, and the one-graph setup, compiled after the split ones, ran their
    split graph. `isolate_recompiles`, where torch.compile has it (2.13 does), gives each its own;
    a torch without it shares them (its one-graph row is then no baseline)."""
    isolate = "isolate_recompiles" in inspect.signature(torch.compile).parameters
    return torch.compile(model, backend=backend, **({"isolate_recompiles": True} if isolate else {}))


def step_and_local_backward(model, opt, x) -> list[float]:
    """[step, backward] of a synchronised step, the backward of the same step under no_sync (the
    difference of the backwards is the communication the backward did not hide, engine-agnostic),
    minddp's own end-of-backward wait (NaN for torch DDP, which does not say), and over a modelled
    link: how long it still transferred after the last bucket left, and its transfer time of
    every bucket of the step (NaN without one)."""
    nan, link = float("nan"), getattr(model, "minddp_bench_link", None)
    sent = link.sent_s if link is not None else nan
    forward, backward, optimizer = phased_step(model, opt, x)
    wait = model.comm_stats.exposed_wait_s if isinstance(model, DistributedDataParallel) else nan
    tail, sent = (link.tail_s(), link.sent_s - sent) if link is not None else (nan, nan)
    opt.zero_grad()
    with model.no_sync():
        loss = lm_loss(model, x)
        local = timed(loss.backward, x.device)
    opt.zero_grad()
    return [forward + backward + optimizer, backward, local, wait, tail, sent]


def over_link(ddp, gbps: float | None):
    """`ddp` with its buckets sent over a modelled link of `gbps` Gbit/s (minddp.perf.link), kept
    as `ddp.minddp_bench_link`; as it is without `gbps`."""
    if gbps:
        ddp.minddp_bench_link = Link(gbps)
        ddp.register_comm_hook(ddp.minddp_bench_link, link_hook)
    return ddp


def compile_section(base, x, backend: str, cap: float | None, repeats: int, rounds: int,
                    per_round: int, link_gbps: float | None = None) -> list[dict]:
    """Per compiled setup: step time against torch DDP compiled (ratio of medians per repeat), step,
    exposed communication, the backward under no_sync and, over a modelled link, the link's tail and
    whole transfer (ms, per repeat)."""
    configs = [(label, over_link(ddp, link_gbps), torch.optim.SGD(ddp.parameters(), lr=1e-4))
               for label, ddp in compile_configs(base, backend, cap)]
    for label, ddp, opt in configs:  # compile (and rebuild the buckets) before the clock runs
        with _compat.dynamo_one_graph() if label == ONE_GRAPH else contextlib.nullcontext():
            for _ in range(2):
                step(ddp, opt, x)
    rows = [{"label": label, "vs_torch": [], "step_ms": [], "exposed_ms": [], "wait_ms": [], "local_ms": [],
             "tail_ms": [], "transfer_ms": []} for label, _, _ in configs]
    steps = [lambda m=m, o=o: step_and_local_backward(m, o, x) for _, m, o in configs]
    for _ in range(repeats):
        med = interleaved(steps, rounds, per_round, x.device)
        for row, (total, backward, local, wait, tail, transfer) in zip(rows, med):
            row["vs_torch"].append(total / med[1][0])
            row["step_ms"].append(total * 1e3)
            row["exposed_ms"].append((backward - local) * 1e3)
            row["local_ms"].append(local * 1e3)
            row["wait_ms"].append(wait * 1e3)
            row["tail_ms"].append(tail * 1e3)
            row["transfer_ms"].append(transfer * 1e3)
    return rows
