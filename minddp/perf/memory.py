"""Memory per rank: what a data-parallel setup holds by construction (one model, read by
`minddp costmodel zero` and `minddp bench-memory`), the configurations bench-memory builds, and
what a run measured (`PeakMeter`, `peak_run`).

The model, per rank, for n parameters: weights + separate gradients + bucket buffers (the
gradients themselves where they are bucket views) + optimizer states, the states divided by
dp where sharded (ZeRO-1). AdamW keeps exp_avg and exp_avg_sq: 8 B per fp32 parameter.
"""

from __future__ import annotations

import resource

import torch

from .workload import lm_loss

CONFIGS = {  # name -> what it is
    "local": "no wrapper, each rank trains alone (reference)",
    "torch-ddp": "torch DDP, default arguments",
    "torch-ddp-view": "torch DDP, gradient_as_bucket_view=True",
    "minddp-ddp": "minddp DDP, default arguments",
    "minddp-zero1": "minddp DDP(shard_optimizer=True) + minddp.ShardedOptimizer",
    "torch-zero": "torch DDP + ZeroRedundancyOptimizer",
    "minddp-overlap": "minddp DDP(optimizer_overlap=True) + minddp.OverlappedOptimizer",
}
# what each configuration holds per rank, in units of P (the fp32 parameter
# bytes): (weights, separate gradients, bucket buffers, states sharded, the table's words)
HOLDS = {
    "local": (1, 1, 0, False, "params P, grads P, states 2P"),
    "torch-ddp": (1, 1, 1, False, "params P, grads P, buckets P, states 2P"),
    "torch-ddp-view": (1, 0, 1, False, "params P, grads = bucket views P, states 2P"),
    "minddp-ddp": (1, 0, 1, False, "params P, grads = bucket views P, states 2P"),
    "minddp-zero1": (1, 0, 1, True, "params P (flat buffers), grads = bucket views P, states 2P/dp"),
    "torch-zero": (1, 1, 1, True, "params P, grads P, buckets P, states 2P/dp"),
    "minddp-overlap": (1, 0, 1, False, "params P, grads = bucket views P, states 2P"),
}


def memory_per_rank(n_params: float, dp: int, weight_bytes: float = 4, grad_bytes: float = 4,
                    state_bytes: float = 8, sharded: bool = False, bucket_bytes: float = 0) -> dict:
    """Bytes per rank: weights + gradients + bucket buffers + optimizer states (AdamW: 8 B per
    fp32 parameter), the states divided by dp under ZeRO-1. Bytes are per parameter; bucket
    buffers default to none (the gradients are the bucket views)."""
    states = n_params * state_bytes / (dp if sharded else 1)
    w, g, b = n_params * weight_bytes, n_params * grad_bytes, n_params * bucket_bytes
    return {"weights": w, "gradients": g, "buckets": b, "optimizer_states": states,
            "total": w + g + b + states}


def modeled_bytes(config: str, param_bytes: int, dp: int) -> dict:
    """What one rank of a bench-memory configuration (HOLDS) holds, for `param_bytes` of fp32
    parameters: the model above in the table's units."""
    params, grads, buckets, sharded, _ = HOLDS[config]
    m = memory_per_rank(param_bytes / 4, dp, 4 * params, 4 * grads, 8, sharded, 4 * buckets)
    return {"params": m["weights"], "grads": m["gradients"], "buckets": m["buckets"],
            "states": m["optimizer_states"], "total": m["total"]}


def state_bytes(opt) -> int:
    """Optimizer state held on this rank (minddp's optimizers and ZeroRedundancyOptimizer keep the
    torch optimizer, a shard's under ZeRO-1, in .optim)."""
    inner = getattr(opt, "optim", opt)
    return sum(v.numel() * v.element_size() for st in inner.state.values() for v in st.values()
               if isinstance(v, torch.Tensor))


def configuration(config: str, model, device):
    """(module to call, optimizer) for one configuration; the same AdamW everywhere."""
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.nn.parallel import DistributedDataParallel as TorchDDP

    from ..engine.ddp import DistributedDataParallel as DDP
    from ..optim.overlap import OverlappedOptimizer
    from ..optim.zero import ShardedOptimizer

    kw = {"lr": 1e-4, "weight_decay": 0.1, "fused": device.type in ("cpu", "cuda")}
    ids = [device.index] if device.type == "cuda" else None
    if config == "local":
        return model, torch.optim.AdamW(model.parameters(), **kw)
    if config in ("torch-ddp", "torch-ddp-view", "torch-zero"):
        wrapped = TorchDDP(model, device_ids=ids, gradient_as_bucket_view=config == "torch-ddp-view")
        if config == "torch-zero":
            return wrapped, ZeroRedundancyOptimizer(model.parameters(), torch.optim.AdamW, **kw)
        return wrapped, torch.optim.AdamW(model.parameters(), **kw)
    if config == "minddp-zero1":
        wrapped = DDP(model, device_ids=ids, shard_optimizer=True)
        return wrapped, ShardedOptimizer(wrapped, torch.optim.AdamW, **kw)
    if config == "minddp-overlap":
        wrapped = DDP(model, device_ids=ids, optimizer_overlap=True)
        return wrapped, OverlappedOptimizer(wrapped, torch.optim.AdamW, **kw)
    return DDP(model, device_ids=ids), torch.optim.AdamW(model.parameters(), **kw)


def warm_up_optimizer() -> None:
    """The first AdamW built and stepped imports its machinery (about 70 MB of code here):
    common to every configuration, so done before the baseline."""
    p = torch.nn.Parameter(torch.ones(8))
    p.grad = torch.ones(8)
    torch.optim.AdamW([p], fused=True).step()


def peak_run(config: str, make, meter: PeakMeter, device, steps: int, batch: int, block: int,
             seed: int = 0) -> dict:
    """One rank's peaks under `config`: the high-water mark after init, the model (`make()`),
    wrap + optimizer, and every step of random tokens; the states held, the parameter bytes."""
    meter.on(device)
    marks = {"init": meter.peak()}
    model = make()
    marks["model"] = meter.peak()
    wrapped, opt = configuration(config, model, device)
    marks["wrap"] = meter.peak()
    g = torch.Generator().manual_seed(seed)
    for s in range(steps):
        x = torch.randint(0, 256, (batch, block + 1), generator=g).to(device)
        lm_loss(wrapped, x).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        marks[f"step{s + 1}"] = meter.peak()
    return {"marks": marks, "peak": meter.peak(), "absolute": meter.absolute(), "baseline": meter.baseline,
            "states": state_bytes(opt), "method": meter.method, "device": str(device),
            "param_bytes": sum(p.numel() * p.element_size() for p in model.parameters())}


def largest(row: dict, key: str) -> float:
    """A measured configuration's figure on its largest rank."""
    return max(r[key] for r in row["ranks"])


def figures(row: dict) -> dict:
    """A measured configuration's bytes: modeled (what it holds by construction), and on its
    largest rank the states, the peak (above the baseline and absolute), how far wrap +
    optimizer raised the peak; `marks`: the high-water mark after each phase on the rank with
    the highest peak."""
    top = max(row["ranks"], key=lambda x: x["peak"])
    return {"modeled": modeled_bytes(row["config"], row["ranks"][0]["param_bytes"], row["dp"])["total"],
            "states": largest(row, "states"), "peak": largest(row, "peak"),
            "absolute": largest(row, "absolute"), "marks": list(top["marks"].values()),
            "wrap": max(x["marks"]["wrap"] - x["marks"]["model"] for x in row["ranks"])}


RESOLUTION = 4e6  # bytes: two runs of one configuration peak up to ~2 MB apart (allocator, imports)


def zero_criterion(rows: list[dict], plain: str, sharded: str) -> dict | None:
    """ZeRO-1's peak below DDP's by >= 80% of the optimizer state it saves (the target); "pass"
    None where the states saved are below what the meter resolves (a small model: no verdict)."""
    by = {r["config"]: r for r in rows if "ranks" in r}
    if plain not in by or sharded not in by:
        return None
    saved = largest(by[plain], "states") - largest(by[sharded], "states")
    lowered = largest(by[plain], "peak") - largest(by[sharded], "peak")
    return {"saved": saved, "lowered": lowered, "peak_plain": largest(by[plain], "peak"),
            "peak_sharded": largest(by[sharded], "peak"),
            "fraction": lowered / saved if saved else float("nan"),
            "pass": lowered >= 0.8 * saved if saved >= RESOLUTION else None}


def ddp_criterion(rows: list[dict]) -> dict | None:
    """minddp DDP's peak at or below torch DDP's with default arguments (and, beside them, torch
    DDP's with gradient_as_bucket_view where measured); "pass" None where the parameters (torch's
    extra bucket copy) are below what the meter resolves."""
    by = {r["config"]: r for r in rows if "ranks" in r}
    if not {"torch-ddp", "minddp-ddp"} <= set(by):
        return None
    t, m = largest(by["torch-ddp"], "peak"), largest(by["minddp-ddp"], "peak")
    view = largest(by["torch-ddp-view"], "peak") if "torch-ddp-view" in by else None
    small = by["minddp-ddp"]["ranks"][0]["param_bytes"] < RESOLUTION
    return {"torch": t, "torch_view": view, "minddp": m, "pass": None if small else m <= t}


class PeakMeter:
    """Peak memory since construction: VmHWM (reset at start) or ru_maxrss on CPU, the
    allocator's max_memory_allocated on CUDA (after `on(device)`)."""

    def __init__(self):
        self.device = None
        self.reset = _reset_hwm()
        self.baseline = _rss_bytes()
        self.method = "VmHWM - RSS after import" if self.reset else "ru_maxrss - RSS after import"

    def on(self, device) -> None:
        self.device = device
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
            self.baseline, self.method = torch.cuda.memory_allocated(device), "cuda max_memory_allocated"

    def peak(self) -> int:
        """Bytes above the baseline at the highest point so far."""
        if self.device is not None and self.device.type == "cuda":
            return torch.cuda.max_memory_allocated(self.device) - self.baseline
        return _hwm_bytes(self.reset) - self.baseline

    def absolute(self) -> int:
        return self.peak() + self.baseline


def _reset_hwm() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # Linux >= 4.0: VmHWM := VmRSS
        return True
    except OSError:
        return False


def _status_kb(key: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(key))


def _rss_bytes() -> int:
    try:
        return _status_kb("VmRSS:") * 1024
    except (OSError, StopIteration):
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _hwm_bytes(reset: bool) -> int:
    if reset:
        return _status_kb("VmHWM:") * 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
